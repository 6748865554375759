"""`ane-spec probe parity|block|drift|row-invariance|overflow|residency|all`: run gates on a build, report,
record in the manifest."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import LoadedManifest, load_manifest, record_drift
from ane_spec.probes.block import run_block
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.parity import run_parity
from ane_spec.probes.report import GateReport, save_report
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.runtime.backend import BackendName, Precision, make_backend
from ane_spec.runtime.decode_shape import DecodeShape
from ane_spec.runtime.pipeline import ShardPipeline

# Row invariance first: on new hardware it is the property everything exact rests on; overflow
# isolation next, the other half of it (a row that overflows must not reach other rows).
GATES = ("row-invariance", "overflow", "parity", "block", "drift", "residency")


def open_pipeline(manifest: str | os.PathLike[str], backend: BackendName, precision: Precision,
                  *, verify: bool = True, decode_shape: DecodeShape = "fixed",
                  defer_start: bool = False) -> tuple[LoadedManifest, ShardPipeline]:
    loaded = load_manifest(manifest, verify=verify)
    # The decode shape picks Core ML's reshape hint as well as the pass width.
    return loaded, ShardPipeline(
        loaded, make_backend(backend, precision=precision, decode_shape=decode_shape),
        decode_shape, defer_start)


def gate_parity(loaded: LoadedManifest, pipeline: ShardPipeline,
                gguf: str | os.PathLike[str] | None = None) -> GateReport:
    from ane_spec.model.gguf_file import open_gguf

    source = Path(gguf or loaded.manifest.source.path)
    if not source.is_file():
        raise AneSpecError(f"the parity gate needs the source GGUF; {source} is not there "
                           "(pass --gguf PATH)")
    try:
        import torch  # noqa: F401
    except ImportError:
        raise AneSpecError("the parity gate needs torch for the reference forward pass: "
                           "pip install 'ane-spec[reference]'") from None
    return run_parity(loaded, pipeline, open_gguf(source))


def residency_or_lint(package: Path, compute_units: str = "CPU_AND_NE",
                      sha256: str | None = None) -> GateReport:
    """One package: MLComputePlan where Core ML runs; everywhere, the static lint (warnings).
    `sha256`: the package's hash from the manifest, the compiled-model cache's key."""
    from ane_spec.probes.residency import ane_lint, residency_report
    from ane_spec.runtime.backend import BackendUnavailable

    lint = [vars(w) | {"package": Path(w.package).name} for w in ane_lint(package)]
    try:
        r = residency_report(package, compute_units, sha256)
    except BackendUnavailable as exc:  # "unavailable: needs macOS 15 (this is ...): ..."
        return GateReport("residency", False, "coreml", None, {"lint_warnings": len(lint)},
                          {"compute_non_ane": 0}, {"lint": lint},
                          skipped=f"{exc}; the static ANE lint ran instead: {len(lint)} warnings")
    figures = {k: getattr(r, k) for k in RESIDENCY_COUNTS} | {"lint_warnings": len(lint)}
    skipped = None
    if r.undetermined:
        ops = r.conv_total + sum(r.unplanned.values())
        skipped = f"{r.undetermined}; structure only: {ops} op(s) read, placement unknown"
    return GateReport("residency", r.passed, "coreml", None, figures, {"compute_non_ane": 0},
                      {"lint": lint, "packages": [r.to_dict()]}, skipped=skipped)


RESIDENCY_COUNTS = ("conv_total", "conv_non_ane", "compute_total", "compute_non_ane")


def gate_residency(loaded: LoadedManifest, compute_units: str = "CPU_AND_NE") -> GateReport:
    """Every package of a build; passes only at zero non-ANE ops across all of them."""
    files = [p.file for p in [*loaded.manifest.shards, *loaded.manifest.heads]]
    parts = [residency_or_lint(loaded.path(f), compute_units, f.sha256) for f in files]
    lint = [w for r in parts for w in r.details["lint"]]
    if any(r.skipped for r in parts):
        return GateReport("residency", False, "coreml", None, {"lint_warnings": len(lint)},
                          {"compute_non_ane": 0},
                          {"lint": lint, "packages": [p for r in parts
                                                      for p in r.details.get("packages", [])]},
                          skipped="; ".join(dict.fromkeys(r.skipped for r in parts if r.skipped)))
    figures = {k: sum(r.figures[k] for r in parts) for k in RESIDENCY_COUNTS}
    # MLComputePlan plans the RangeDim default shape only: the one shape this verdict covers.
    figures["planned_t"] = loaded.manifest.build.default_t
    figures["lint_warnings"] = len(lint)
    return GateReport("residency", all(r.passed for r in parts), "coreml", None, figures,
                      {"compute_non_ane": 0},
                      {"lint": lint, "packages": [p for r in parts for p in r.details["packages"]]})


def run_gates(manifest: str | os.PathLike[str], gates: tuple[str, ...], *,
              backend: BackendName, precision: Precision, gguf: str | None = None,
              verify: bool = True, save: bool = True, decode_shape: DecodeShape = "fixed"
              ) -> list[GateReport]:
    loaded, pipeline = None, None
    reports = []
    for gate in gates:
        if gate == "residency":
            loaded = loaded or load_manifest(manifest, verify=verify)
            report = gate_residency(loaded)
        else:
            if pipeline is None:
                loaded, pipeline = open_pipeline(manifest, backend, precision, verify=verify,
                                                 decode_shape=decode_shape)
                verify = False  # hashed once is enough
            if gate == "parity":
                report = gate_parity(loaded, pipeline, gguf)
            elif gate == "drift":
                report = measure_drift(pipeline)
                pipeline.manifest.drift[pipeline.drift_key] = report.figures["drift"]
                record_drift(loaded.root, pipeline.drift_key, report.figures["drift"])
            elif gate == "row-invariance":
                report = run_row_invariance(pipeline)
            elif gate == "overflow":
                report = run_overflow(pipeline)
            else:
                report = run_block(pipeline)
        if save:
            save_report(report, loaded)
        reports.append(report)
    return reports


def platform_note() -> str:
    return ("macOS: Core ML and MLComputePlan available" if sys.platform == "darwin" else
            f"{sys.platform}: Core ML cannot run here; the MIL interpreter executes the packages "
            "and residency is reduced to the static ANE lint")
