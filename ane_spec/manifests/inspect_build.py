"""A build folder's weights in a human- and machine-readable summary (`ane-spec inspect
FOLDER`): per package, each tensor's stored format, cosine and the reason it got it, read from
the manifest. A GGUF file's summary is model/inspect.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from ane_spec.manifests.residual_report import describe as describe_residual_scale
from ane_spec.manifests.schema import ResidualScale
from ane_spec.manifests.store import load_manifest


def describe_build(folder: Path) -> dict[str, Any]:
    """A build folder's weights: per package, each tensor's format, cosine and reason."""
    m = load_manifest(folder, verify=False).manifest
    packages = {}
    for entry in [*m.shards, *m.heads]:
        packages[entry.file.path] = {
            "bytes": entry.file.bytes, "requested": entry.quant.format,
            "worst_cosine": entry.quant.worst_cosine, "worst_tensor": entry.quant.worst_tensor,
            "tensors": {n: t.model_dump() for n, t in entry.quant.tensors.items()}}
    formats = Counter(t["format"] for p in packages.values() for t in p["tensors"].values())
    return {"path": str(folder), "name": m.name, "source": m.source.path,
            "weights": m.build.weights, "min_weight_cosine": m.build.min_weight_cosine,
            "mask_form": m.build.mask_form, "kv_write": m.build.kv_write,
            "head_layout": m.build.head_layout,
            "formats": dict(sorted(formats.items())), "embeddings": m.embeddings.format,
            "residual_scale": (None if m.residual_scale is None
                               else m.residual_scale.model_dump()),
            "packages": packages}


def format_build(d: dict[str, Any]) -> str:
    lines = [f"{d['path']}  (build '{d['name']}' of {d['source']})",
             f"  weights {d['weights']}, floor {d['min_weight_cosine']}: "
             + (", ".join(f"{f} x{n}" for f, n in d["formats"].items())
                or "no per-tensor record (built before per-tensor formats)")
             + f"; host embeddings {d['embeddings']}; mask form {d['mask_form']}"
             + f"; K/V write {d['kv_write']}; head layout {d.get('head_layout', 'channels')}"]
    lines += ["  " + line for line in _residual_lines(d.get("residual_scale"))]
    for path, p in d["packages"].items():
        lines.append(f"  {path} ({p['bytes'] / 2**20:,.1f} MiB)")
        for name, t in p["tensors"].items():
            lines.append(f"    {name:<32} {t['format']:<13} cos {t['cosine']:.6f}  "
                         f"{t['reason']}")
    return "\n".join(lines)


def _residual_lines(recorded: dict[str, Any] | None) -> list[str]:
    # The wording is shared with build and doctor (residual_report.py).
    return describe_residual_scale(
        None if recorded is None else ResidualScale.model_validate(recorded))
