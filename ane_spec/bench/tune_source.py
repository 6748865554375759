"""What `ane-spec tune` builds its variants from: the user's build (`--manifest`: its source GGUF
rebuilt with its own options, one changed at a time), or a small synthetic model of real widths
(a preset's dimensions, a few layers), so the programs are the shapes the device will run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import LoadedManifest, load_manifest

# Today's defaults of the tuned options: the baseline of a synthetic tune.
DEFAULTS: dict[str, Any] = {"mask_form": "select", "layout": "BCT1", "head_layout": "channels",
                            "prefill_t": 64, "kv_write": "scatter"}
# A shard budget no variant can exceed: its topology is given, one the user's build passed.
NO_SHARD_BUDGET_MB = 1 << 20


def from_manifest(manifest: str | Path) -> tuple[Path, dict[str, Any], str]:
    """(source GGUF, BuildRequest fields, description) of a build: every option it recorded."""
    loaded: LoadedManifest = load_manifest(manifest)
    source = Path(loaded.manifest.source.path)
    if not source.is_file():
        raise AneSpecError(f"tune --manifest rebuilds the build's variants from its source GGUF; "
                           f"{source} is not there")
    return source, *options_of(loaded)


def options_of(loaded: LoadedManifest) -> tuple[dict[str, Any], str]:
    """(BuildRequest fields, description) of a build: every option it recorded."""
    m = loaded.manifest
    source = Path(m.source.path)
    b = m.build
    log2 = m.residual_scale.log2_factor if m.residual_scale is not None else 0
    request = {"topology": ",".join(str(n) for n in b.topology), "max_seq": b.max_seq,
               "weights": b.weights, "head_chunks": b.head_chunks,
               "head_argmax": b.head_argmax, "min_weight_cosine": b.min_weight_cosine,
               "residual_scale": f"2^{log2}" if log2 else "off",
               "max_shard_mb": NO_SHARD_BUDGET_MB, "swa_ring": bool(b.swa_ring) or
               not m.model.sliding_window,
               "mask_form": b.mask_form, "layout": b.layout, "head_layout": b.head_layout,
               "prefill_t": b.prefill_t, "kv_write": b.kv_write}
    return request, f"the build {loaded.root} ({m.name}, from {source.name})"


def synthetic(folder: Path, preset_name: str, layers: int, max_seq: int,
              vocab: int | None = None) -> tuple[Path, dict[str, Any], str]:
    """(GGUF, BuildRequest fields, description) of a random model of `preset_name`'s widths with
    `layers` layers, in one shard."""
    from ane_spec.model.synthetic import preset, write_synthetic_gguf

    spec = preset(preset_name, num_layers=layers, vocab_size=vocab)
    folder.mkdir(parents=True, exist_ok=True)
    path = write_synthetic_gguf(folder / f"tune-{preset_name}-{layers}l.gguf", spec)
    c = spec.to_config()
    request = {"topology": str(layers), "max_seq": max_seq, "residual_scale": "off",
               "max_shard_mb": NO_SHARD_BUDGET_MB, **DEFAULTS,
               "prefill_t": min(DEFAULTS["prefill_t"], max_seq)}
    return path, request, (f"synthetic {preset_name} widths (d={c.hidden_size}, "
                           f"vocabulary {c.vocab_size:,}), {layers} layer(s), context {max_seq}, "
                           "random weights")
