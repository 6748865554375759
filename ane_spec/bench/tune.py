"""`ane-spec tune`: one command for the first Mac run. It builds the open variants, measures each
through the backend in a process of its own, and picks, per choice, what the measurements favour.

The open choices (`tune_model.DIMENSIONS`) are build options: the mask form, the hidden-state
layout, the head's output layout, the prefill P and the K/V write. The variants are one baseline
(today's defaults, or the options of the build given with `--manifest`) and, for each choice,
the baseline with that one option changed: one factor at a time, 8 builds rather than the 64 of
every combination, so each choice is decided against the same reference.

Each variant (its build included: a conversion can crash too) runs in a worker process
(`worker_process`: spawn, a death noticed and named) under a deadline: a variant that kills its
process, hangs past the deadline (its process is killed), raises, or computes wrong is one row
that says so, and the next variant starts in a fresh process.

For each variant, through the backend (Core ML on a Mac; elsewhere the fp16 MIL interpreter,
whose times say nothing about the device, and the report says so):
- placement: the residency gate's MLComputePlan verdict where Core ML runs;
- time: the median of `reps` decode/verify passes (T=4, the argmax of row 0 read, as decoding
  reads it) after `warmup` passes, and the same for one prefill pass of P rows;
- bits: its logits against the fp16 interpreter's on the same passes (on Core ML), and the
  probes (row invariance, overflow, fp16 parity against the fp32 reference).
"""

from __future__ import annotations

import dataclasses
import functools
import platform
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.bench.tune_model import (
    CHOICES,
    DIMENSIONS,
    FLAGS,
    Check,
    Choice,
    TuneResult,
    VariantResult,
)
from ane_spec.errors import AneSpecError
from ane_spec.worker_process import Channel, WorkerDied, WorkerProcess

BITS = ("interpreter", "row-invariance", "overflow", "parity")
DEFAULT_REPS, DEFAULT_WARMUP = 30, 3
DEFAULT_DEADLINE_S = 900.0
# An alternative replaces a default only when its median is this much faster: closer than that
# is within the noise of a median over tens of passes, and the default has more runs behind it.
DEFAULT_MARGIN = 0.05
DECODE_TOKENS = 4
INTERPRETER_TIMINGS = ("the fp16 MIL interpreter's, on this machine's CPU: NOT the device's; they "
                       "rank the variants by the interpreter's costs, not the Neural Engine's")
DEVICE_TIMINGS = "Core ML's on this machine (CPU_AND_NE), measured through the worker process"

Progress = Callable[[str], None]


@dataclasses.dataclass(frozen=True)
class VariantJob:
    """One variant, as plain values the worker process unpickles."""

    name: str
    dimension: str | None
    options: dict[str, Any]      # the five tuned options
    request: dict[str, Any]      # every BuildRequest field the build takes
    gguf: str
    out: str
    backend: str                 # "coreml" or "mil"
    reps: int
    warmup: int
    bits: tuple[str, ...]
    keep_build: bool


# --- what runs in the variant's process -------------------------------------------------------

def measure_variant(job: VariantJob, progress: Progress) -> dict[str, Any]:
    """Build the variant, load it on the backend, place, time and check it: VariantResult's
    fields. A Core ML worker that dies under it makes the row `crashed`."""
    from ane_spec.shards.build import BuildRequest, build

    row: dict[str, Any] = {"name": job.name, "dimension": job.dimension,
                           "options": job.options, "outcome": "ok"}
    started = time.monotonic()
    progress(f"{job.name}: building")
    build(job.gguf, job.out, BuildRequest(**job.request), force=True,
          progress=lambda m: progress(f"{job.name}: {m}"))
    row["build_seconds"] = round(time.monotonic() - started, 2)
    try:
        _measure_build(job, row, progress)
    except WorkerDied as exc:
        row |= {"outcome": "crashed", "reason": f"the Core ML worker died ({exc.how}) during "
                f"{exc.during}"}
    finally:
        if not job.keep_build:
            shutil.rmtree(job.out, ignore_errors=True)
    return row


def _measure_build(job: VariantJob, row: dict[str, Any], progress: Progress) -> None:
    from ane_spec.probes.gates import open_pipeline

    precision = "fp16" if job.backend == "mil" else "fp32"  # Core ML computes fp16 anyway
    loaded, pipeline = open_pipeline(job.out, job.backend, precision, verify=False)
    try:
        row |= _placement(job, loaded, progress)
        progress(f"{job.name}: timing {job.reps} passes after {job.warmup} warm-up")
        row |= _timings(pipeline, job.reps, job.warmup)
        checks = [_check(name, job, loaded, pipeline, progress) for name in job.bits]
    finally:
        # A Core ML worker process: end it here. This process leaves through os._exit
        # (multiprocessing's children do), which runs no atexit hook to close it, and its
        # shared-memory slabs would outlive it.
        close = getattr(pipeline.backend, "close", None)
        if close is not None:
            close()
    row["checks"] = [c.model_dump() for c in checks]
    if any(c.passed is False for c in checks):
        row |= {"outcome": "wrong", "reason": "failed: " + "; ".join(
            f"{c.name} ({c.summary})" for c in checks if c.passed is False)}


def _placement(job: VariantJob, loaded, progress: Progress) -> dict[str, Any]:  # noqa: ANN001
    if job.backend == "mil":
        return {"placement": "not measured: the MIL interpreter has no placement "
                             "(MLComputePlan needs Core ML, macOS 15)"}
    from ane_spec.probes.gates import gate_residency

    progress(f"{job.name}: MLComputePlan")
    report = gate_residency(loaded)
    if report.skipped:
        return {"placement": f"unknown: {report.skipped}"}
    figures = {k: v for k, v in report.figures.items() if isinstance(v, int)}
    verdict = "every op on the ANE" if report.passed else (
        f"{figures.get('compute_non_ane', '?')} of {figures.get('compute_total', '?')} compute "
        "ops off the ANE")
    return {"placement": verdict, "placement_figures": figures}


def _timings(pipeline, reps: int, warmup: int) -> dict[str, Any]:  # noqa: ANN001
    vocab = pipeline.config.vocab_size
    tokens = [(7 * i + 1) % vocab for i in range(max(DECODE_TOKENS, pipeline.prefill_t))]
    state = pipeline.new_state()

    def decode() -> None:
        pipeline.run(tokens[:DECODE_TOKENS], 0, state).row_argmax(0)

    out: dict[str, Any] = {}
    times = _timed(decode, reps, warmup)
    out["decode_ms"] = round(statistics.median(times), 4)
    out["decode_ms_spread"] = (round(min(times), 4), round(max(times), 4))
    if pipeline.prefill_t:
        p = pipeline.prefill_t

        def prefill() -> None:
            pipeline.run_prefill(tokens[:p], 0, state, head=True).row_argmax(0)

        median = statistics.median(_timed(prefill, reps, warmup))
        out["prefill_ms"] = round(median, 4)
        out["prefill_ms_per_token"] = round(median / p, 5)
    return out


def _timed(fn: Callable[[], None], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _check(name: str, job: VariantJob, loaded, pipeline, progress: Progress) -> Check:  # noqa: ANN001
    progress(f"{job.name}: {name}")
    try:
        if name == "interpreter":
            return _against_interpreter(job, pipeline)
        if name == "row-invariance":
            from ane_spec.probes.row_invariance import run_row_invariance

            report = run_row_invariance(pipeline)
        elif name == "overflow":
            from ane_spec.probes.overflow import run_overflow

            report = run_overflow(pipeline)
        else:
            from ane_spec.probes.gates import gate_parity

            report = gate_parity(loaded, pipeline)
    except WorkerDied:
        raise
    except AneSpecError as exc:  # e.g. parity without torch: it could not run here
        return Check(name=name, passed=None, summary=f"skipped: {exc}")
    if report.skipped:
        return Check(name=name, passed=None, summary=f"skipped: {report.skipped}")
    return Check(name=name, passed=report.passed, summary=_short(report))


def _short(report) -> str:  # noqa: ANN001 - GateReport
    keep = ("max_logit_diff", "max_state_diff", "differing_plans", "differing_cases",
            "non_finite_cases", "min_cosine", "argmax_agreement", "cases")
    figs = ", ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                     for k, v in report.figures.items() if k in keep)
    return f"{'PASS' if report.passed else 'FAIL'} ({figs})"


def _against_interpreter(job: VariantJob, pipeline) -> Check:  # noqa: ANN001
    """The backend's logits against the fp16 interpreter's on the same build and passes: every
    row's argmax the same, and how far apart the values are (the ANE's fp16 accumulation is not
    the interpreter's, so bitwise equality is not required; it is counted)."""
    if job.backend == "mil":
        return Check(name="interpreter", passed=None,
                     summary="skipped: the backend is the interpreter itself")
    from ane_spec.probes.gates import open_pipeline

    reference = open_pipeline(job.out, "mil", "fp16", verify=False)[1]
    vocab = pipeline.config.vocab_size
    prompt = [(13 * i + 5) % vocab for i in range(12)]
    states = [pipeline.new_state(), reference.new_state()]
    rows = equal = agree = 0
    worst = 0.0
    for start in range(0, len(prompt), DECODE_TOKENS):
        a, b = (p.run(prompt[start:start + DECODE_TOKENS], start, s)
                for p, s in zip((pipeline, reference), states))
        for r in range(a.rows):
            x, y = a.row_logits(r), b.row_logits(r)
            if not np.isfinite(x).all():
                return Check(name="interpreter", passed=False,
                             summary=f"non-finite logits at position {start + r}")
            rows += 1
            equal += bool(np.array_equal(x, y))
            agree += int(np.argmax(x) == np.argmax(y))
            worst = max(worst, float(np.max(np.abs(x - y))))
    return Check(name="interpreter", passed=agree == rows,
                 summary=f"{'PASS' if agree == rows else 'FAIL'} (argmax agreement "
                         f"{agree}/{rows}, bitwise-equal rows {equal}/{rows}, max |diff| "
                         f"{worst:.4g})")


class _Runner:
    def __init__(self, channel: Channel, measure: Callable[[VariantJob, Progress], dict]):
        self.channel, self.measure = channel, measure

    def run(self, job: VariantJob) -> dict[str, Any]:
        return self.measure(job, self.channel.progress)


def _make_runner(measure: Callable, channel: Channel) -> _Runner:
    return _Runner(channel, measure)


# --- the parent ---------------------------------------------------------------------------------

def run_isolated(label: str, job: Any, deadline_s: float, progress: Progress,
                 measure: Callable[[Any, Progress], dict]) -> dict[str, Any]:
    """`measure(job)` in a fresh worker process, killed at `deadline_s`: its dict, or, whatever
    happened there, `outcome` and `reason` saying what (hung, crashed, error). `measure` runs in
    the child (a module-level function: it is pickled)."""
    worker = WorkerProcess(f"tune {label}", functools.partial(_make_runner, measure),
                           progress=progress)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        worker.kill()

    timer = threading.Timer(deadline_s, expire)
    timer.daemon = True
    timer.start()
    try:
        return worker.call("run", job, during=label)
    except WorkerDied as exc:
        if expired.is_set():
            return {"outcome": "hung", "reason": f"still running at its {deadline_s:g} s "
                                                 "deadline: its process was killed"}
        return {"outcome": "crashed", "reason": f"its process died ({exc.how})"}
    except Exception as exc:  # noqa: BLE001 - one row, not the run (RemoteError included)
        return {"outcome": "error",
                "reason": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                if str(exc) else type(exc).__name__}
    finally:
        timer.cancel()
        worker.close()


def run_variant(job: VariantJob, deadline_s: float, progress: Progress,
                measure: Callable[[VariantJob, Progress], dict] = measure_variant
                ) -> VariantResult:
    """One variant in a fresh worker process (`run_isolated`); whatever happens there, a row
    comes back."""
    started = time.monotonic()
    base = {"name": job.name, "dimension": job.dimension, "options": job.options}
    try:
        row = VariantResult(**(base | run_isolated(job.name, job, deadline_s, progress,
                                                   measure)))
    finally:
        if not job.keep_build:
            shutil.rmtree(job.out, ignore_errors=True)
    row.seconds = round(time.monotonic() - started, 2)
    return row


def plan_variants(baseline: dict[str, Any], max_seq: int, head_argmax: bool,
                  dimensions: Sequence[str] = DIMENSIONS
                  ) -> tuple[list[tuple[str, str | None, dict[str, Any]]], list[VariantResult]]:
    """(name, dimension, options) of the baseline and of each one-option change, and the
    variants that cannot be built here, as skipped rows."""
    planned: list[tuple[str, str | None, dict[str, Any]]] = [("baseline", None, dict(baseline))]
    skipped = []
    for d in dimensions:
        for value in CHOICES[d]:
            if value == baseline[d]:
                continue
            options = baseline | {d: value}
            name = f"{d}={value}"
            why = None
            if d == "prefill_t" and value > max_seq:
                why = f"P {value} is over the context ({max_seq})"
            elif d == "head_layout" and head_argmax:
                why = "the build's head emits argmax only (--head-argmax): no logits to lay out"
            if why:
                skipped.append(VariantResult(name=name, dimension=d, options=options,
                                             outcome="skipped", reason=why))
            else:
                planned.append((name, d, options))
    return planned, skipped


def metric_of(dimension: str) -> tuple[str, str]:
    """(VariantResult field, words) a dimension is decided by: the prefill P by the time per
    prompt token; every other choice by the decode/verify pass, what speculative decoding
    spends its time on."""
    if dimension == "prefill_t":
        return "prefill_ms_per_token", "prefill time per prompt token"
    return "decode_ms", "decode/verify pass (T=4)"


def choose(rows: Sequence[VariantResult], margin: float, timings_note: str
           ) -> dict[str, Choice]:
    """Per dimension: the fastest variant that passed every check it ran, replacing the
    baseline's value only when faster by more than `margin`; the default where none passed."""
    base = next(r for r in rows if r.dimension is None)
    choices = {}
    for d in dimensions_of(rows):
        field, words = metric_of(d)
        default = base.options[d]
        candidates = [base, *[r for r in rows if r.dimension == d]]
        ok = [r for r in candidates if r.outcome == "ok" and getattr(r, field) is not None]
        others = "; ".join(f"{r.options[d]} {r.outcome}" + (f" ({r.reason})" if r.reason else "")
                           for r in candidates if r.outcome != "ok")
        tail = (f"; not ok: {others}" if others else "") + f"; timings: {timings_note}"
        if not ok:
            choices[d] = Choice(value=default, flag=FLAGS[d], measured=False,
                                rests_on=f"no variant passed its checks: kept the default "
                                         f"{default}" + tail)
            continue
        best = min(ok, key=lambda r: getattr(r, field))
        base_ok = base in ok
        ref = getattr(base, field) if base_ok else None
        if base_ok and best is not base and getattr(best, field) > ref * (1 - margin):
            best_value = getattr(best, field)
            rests = (f"kept {default}: {best.options[d]} ran {words} in {best_value:.4g} ms "
                     f"against {ref:.4g} ms, within the {margin:.0%} margin")
            best = base
        else:
            value = getattr(best, field)
            compared = ", ".join(f"{r.options[d]} {getattr(r, field):.4g} ms" for r in ok
                                 if r is not best)
            rests = (f"{best.options[d]}: {words} {value:.4g} ms (median)"
                     + (f" against {compared}" if compared else " (the only one that passed)"))
            if base_ok and best is not base:
                rests += f", {1 - value / ref:.0%} faster than the default {default}"
        checked = [c.name for c in best.checks if c.passed]
        rests += f"; checks passed: {', '.join(checked) or 'none ran'}"
        if best.placement:
            rests += f"; placement: {best.placement}"
        choices[d] = Choice(value=best.options[d], flag=FLAGS[d], measured=True,
                            rests_on=rests + tail)
    return choices


def dimensions_of(rows: Sequence[VariantResult]) -> list[str]:
    present = {r.dimension for r in rows}
    return [d for d in DIMENSIONS if d in present]


def run_tune(gguf: str | Path, out: Path, baseline_request: dict[str, Any], *, backend: str,
             backend_label: str, source: str, reps: int = DEFAULT_REPS,
             warmup: int = DEFAULT_WARMUP, deadline_s: float = DEFAULT_DEADLINE_S,
             bits: Sequence[str] = BITS, dimensions: Sequence[str] = DIMENSIONS,
             margin: float = DEFAULT_MARGIN, keep_builds: bool = False,
             progress: Progress = lambda m: None,
             on_row: Callable[[VariantResult], None] = lambda r: None,
             measure: Callable[[VariantJob, Progress], dict] = measure_variant) -> TuneResult:
    """Every variant of `baseline_request` (BuildRequest fields, the five tuned ones included),
    each in its own process; the result, with the choices, as tune.json holds it. No
    `dimensions`: no variant at all, not even the baseline (`tune --draft-only`)."""
    baseline = {d: baseline_request[d] for d in DIMENSIONS}
    planned, skipped = plan_variants(baseline, baseline_request["max_seq"],
                                     baseline_request.get("head_argmax", False),
                                     dimensions) if dimensions else ([], [])
    rows: list[VariantResult] = []
    builds = out / "variants"
    for name, dimension, options in planned:
        folder = builds / name.replace("=", "-")
        job = VariantJob(name=name, dimension=dimension, options=options,
                         request=baseline_request | options, gguf=str(gguf), out=str(folder),
                         backend=backend, reps=reps, warmup=warmup, bits=tuple(bits),
                         keep_build=keep_builds)
        progress(f"variant {len(rows) + 1}/{len(planned)}: {name}")
        row = run_variant(job, deadline_s, progress, measure)
        rows.append(row)
        on_row(row)
    rows += skipped
    timings = INTERPRETER_TIMINGS if backend == "mil" else DEVICE_TIMINGS
    placement = ("not measured: the MIL interpreter has no placement; MLComputePlan needs "
                 "Core ML (macOS 15)" if backend == "mil" else
                 "MLComputePlan per variant (the residency gate), where Core ML gives one")
    if not keep_builds:
        shutil.rmtree(builds, ignore_errors=True)
    return TuneResult(created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      platform=f"{platform.system()} {platform.release()} "
                               f"({platform.machine()}), Python {platform.python_version()}",
                      backend=backend_label, timings=timings, placement=placement,
                      source=source, reps=reps, warmup=warmup, deadline_s=deadline_s,
                      margin=margin, baseline=baseline, variants=rows,
                      choices=choose(rows, margin, "interpreter, not the device" if
                                     backend == "mil" else "device") if rows else {})
