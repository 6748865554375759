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
from ane_spec.runtime.decode_shape import DecodeShape, PrefillMode
from ane_spec.runtime.pipeline import ShardPipeline

# Row invariance first: on new hardware it is the property everything exact rests on; overflow
# isolation next, the other half of it (a row that overflows must not reach other rows).
GATES = ("row-invariance", "overflow", "parity", "block", "drift", "residency")


def open_pipeline(manifest: str | os.PathLike[str], backend: BackendName, precision: Precision,
                  *, verify: bool = True, decode_shape: DecodeShape = "fixed",
                  defer_start: bool = False, prefill: PrefillMode = "auto"
                  ) -> tuple[LoadedManifest, ShardPipeline]:
    loaded = load_manifest(manifest, verify=verify)
    # The decode shape picks Core ML's reshape hint as well as the pass width.
    return loaded, ShardPipeline(
        loaded, make_backend(backend, precision=precision, decode_shape=decode_shape),
        decode_shape, defer_start, prefill)


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
                      digest: str | None = None, strict: bool = False) -> GateReport:
    """One package: MLComputePlan where Core ML runs, each of its functions (a layer package's
    decode and prefill functions) judged apart; everywhere, the static lint (warnings).
    `digest`: the package's hash from the manifest, the compiled-model cache's key."""
    from ane_spec.probes.residency import ane_lint, residency_reports
    from ane_spec.runtime.backend import BackendUnavailable

    lint = [vars(w) | {"package": Path(w.package).name} for w in ane_lint(package)]
    try:
        reports = residency_reports(package, compute_units, digest, strict)
    except BackendUnavailable as exc:  # "unavailable: needs macOS 15 (this is ...): ..."
        return GateReport("residency", False, "coreml", None, {"lint_warnings": len(lint)},
                          {"compute_non_ane": 0}, {"lint": lint},
                          skipped=f"{exc}; the static ANE lint ran instead: {len(lint)} warnings")
    figures = residency_figures(reports) | {"lint_warnings": len(lint)}
    skipped = None
    undetermined = next((r.undetermined for r in reports if r.undetermined), None)
    if undetermined:
        ops = sum(r.conv_total + sum(r.unplanned.values()) for r in reports)
        skipped = (f"{undetermined}; structure only: {ops} op(s) of {len(reports)} "
                   "function(s) read, placement unknown")
    return GateReport("residency", all(r.passed for r in reports), "coreml", None, figures,
                      {"compute_non_ane": 0},
                      {"lint": lint, "packages": [r.to_dict() for r in reports]}, skipped=skipped)


RESIDENCY_COUNTS = ("conv_total", "conv_non_ane", "compute_total", "compute_non_ane")


def residency_figures(reports) -> dict[str, int]:  # noqa: ANN001 - list[ResidencyReport]
    """The counts over every function, then each non-default function's own non-ANE counts
    (`prefill_compute_non_ane`, ...): a decode function on the ANE must not hide a prefill
    function off it."""
    figures = {k: sum(getattr(r, k) for r in reports) for k in RESIDENCY_COUNTS}
    for r in reports:
        if r.function != "main":
            for k in RESIDENCY_COUNTS:
                figures[f"{r.function}_{k}"] = figures.get(f"{r.function}_{k}", 0) + getattr(r, k)
    return figures


def gate_residency(loaded: LoadedManifest, compute_units: str = "CPU_AND_NE",
                   strict: bool = False) -> GateReport:
    """Every package of a build, every function of each; passes only where every one passes
    (residency.ResidencyReport.passed: every conv on the ANE and the stated share of the cost,
    or with `strict` every op)."""
    files = [p.file for p in [*loaded.manifest.shards, *loaded.manifest.heads]]
    parts = [residency_or_lint(loaded.path(f), compute_units, f.digest, strict) for f in files]
    lint = [w for r in parts for w in r.details["lint"]]
    if any(r.skipped for r in parts):
        return GateReport("residency", False, "coreml", None, {"lint_warnings": len(lint)},
                          {"compute_non_ane": 0},
                          {"lint": lint, "packages": [p for r in parts
                                                      for p in r.details.get("packages", [])]},
                          skipped="; ".join(dict.fromkeys(r.skipped for r in parts if r.skipped)))
    keys = dict.fromkeys(k for r in parts for k in r.figures if k != "lint_warnings")
    figures = {k: sum(r.figures.get(k, 0) for r in parts) for k in keys}
    # MLComputePlan plans the RangeDim default shape only: the one decode shape this verdict
    # covers; the prefill function has one fixed shape, P.
    figures["planned_t"] = loaded.manifest.build.default_t
    if loaded.manifest.build.prefill_t:
        figures["planned_prefill_t"] = loaded.manifest.build.prefill_t
    figures["lint_warnings"] = len(lint)
    return GateReport("residency", all(r.passed for r in parts), "coreml", None, figures,
                      {"compute_non_ane": 0},
                      {"lint": lint, "packages": [p for r in parts for p in r.details["packages"]]})


def run_gates(manifest: str | os.PathLike[str], gates: tuple[str, ...], *,
              backend: BackendName, precision: Precision, gguf: str | None = None,
              verify: bool = True, save: bool = True, decode_shape: DecodeShape = "fixed",
              strict: bool = False) -> list[GateReport]:
    loaded, pipeline = None, None
    reports = []
    for gate in gates:
        if gate == "residency":
            loaded = loaded or load_manifest(manifest, verify=verify)
            report = gate_residency(loaded, strict=strict)
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
