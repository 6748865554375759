"""`ane-spec doctor`: one command that checks, on the machine it runs on, every assumption the
Core ML path makes, and says for each check `passed`, `failed` or `skipped` with a reason.

Checks are small functions listed in `CHECKS` with their names, run in order; each takes the
shared `DoctorRun` and returns a `Verdict` (or raises `Skip`). Adding a check is one function and
one line in that list. Checks marked `@core_ml_check` run, where Core ML runs, in a child process
(`doctor_worker`): a native crash there reads `crashed: signal N during <check>` and the checks
after it still run. `run_doctor` hands every result to `on_check` as it comes, so the report on
disk is never older than the last finished check. A check that needs
Core ML is skipped with Core ML's own one-line reason where it cannot run (Linux, macOS < 15); one
that needs a build is skipped without `--manifest`. With a manifest, the model checks run on
Core ML (`CPU_AND_NE`) where it runs, and on the fp16 MIL interpreter elsewhere.

Order matters on a Mac: Core ML JIT-specialises a program once per process and input shape on
its first prediction, so `cold-jit` must be the first check that predicts with the build's
shards; the residency check before it compiles and plans but never predicts.
"""

from __future__ import annotations

import functools
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from ane_spec.ane_limits import MIXED_SHAPE_NOTE, MIXED_SHAPE_SOURCE, SMALL_MAC_BYTES
from ane_spec.manifests.schema import HeadEntry
from ane_spec.manifests.residual_report import describe as describe_residual_scale
from ane_spec.manifests.residual_report import margin_problems
from ane_spec.manifests.store import LoadedManifest, load_manifest
from ane_spec.peak_memory import peak_rss_bytes
from ane_spec.probes.report import GateReport
from ane_spec.runtime.backend import BackendUnavailable, make_backend
from ane_spec.runtime.decode_shape import DecodeShapePolicy, check_decode_shape
from ane_spec.runtime.state_budget import ANE_PROCESS_BYTES, slot_budget
from ane_spec.worker_process import WorkerDied

Status = Literal["passed", "failed", "skipped"]
WARM_REPEATS = 5
# CPU_AND_NE must beat CPU_ONLY by this much at T=4 for the ANE to count as used (ane-book: a T=4
# pass costs about a T=1 pass on the ANE, several times more on the CPU).
MIN_ANE_SPEEDUP = 1.2


@dataclass
class Verdict:
    status: Status
    summary: str                       # one line: the figures, or why it failed or was skipped
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Check:
    name: str
    status: Status
    summary: str
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # wall time, a worker start included


CheckFn = Callable[["DoctorRun"], Verdict]


def head_label(h: HeadEntry, packages: int) -> str:
    """`head`, or with the head split into packages, each one's vocabulary rows."""
    return "head" if packages == 1 else f"head {h.chunks[0][0]}-{h.chunks[-1][1] - 1}"


def core_ml_check(fn: CheckFn) -> CheckFn:
    """Mark a check that calls into Core ML: where Core ML runs, it runs in the worker child."""
    fn.core_ml = True  # type: ignore[attr-defined]
    return fn


def runs_in_child(fn: Any) -> bool:
    return getattr(getattr(fn, "func", fn), "core_ml", False)


class Skip(Exception):
    """Raised inside a check: it cannot run here, for the reason given."""


@dataclass
class DoctorRun:
    """What the checks share: the build (if any), where scratch packages go, loaded pipelines."""

    build: LoadedManifest | None  # verified once by run_doctor
    work: Path
    decode_shape: str = "fixed"
    gguf: str | None = None
    progress: Callable[[str], None] = lambda msg: None
    pipelines: dict[str, Any] = field(default_factory=dict)
    measurements: dict[str, Any] = field(default_factory=dict)
    synthetic_packages: dict[str, tuple] = field(default_factory=dict)
    strict: bool = False  # --strict: residency wants every planned op on the ANE
    draft: str | None = None          # --draft-model, as a build folder
    draft_units: str | None = None    # --draft-units

    @property
    def reshape_frequency(self) -> str:
        return DecodeShapePolicy(self.decode_shape).reshape_frequency

    @cached_property
    def coreml_problem(self) -> str | None:
        """Why Core ML cannot run here (one line), or None."""
        from ane_spec.runtime.coreml_backend import require_macos

        try:
            require_macos("this check")
        except BackendUnavailable as exc:
            return str(exc)
        return None

    def need_coreml(self) -> None:
        if self.coreml_problem:
            raise Skip(self.coreml_problem)

    def need_hardware(self) -> None:
        """Skip a check that measures the hardware (placement, speed, JIT, memory) where Core
        ML's native layer is only a stand-in."""
        from ane_spec.runtime.coreml_backend import hardware_problem

        self.need_coreml()
        problem = hardware_problem()
        if problem:
            raise Skip(problem)

    @property
    def loaded(self) -> LoadedManifest:
        if self.build is None:
            raise Skip("needs --manifest (a build)")
        return self.build

    def need_build_on_coreml(self) -> None:
        self.loaded  # noqa: B018 (raises Skip without a build)
        self.need_coreml()

    def packages(self) -> list[tuple[str, Path, str]]:
        """(label, path, digest) of every package of the build, shards then head (`head`, or
        `head 0-50015`, ... for each package of a head split over --max-head-mb)."""
        m = self.loaded.manifest
        entries = [(f"shard {s.layers[0]}-{s.layers[1] - 1}", s) for s in m.shards]
        entries += [(head_label(h, len(m.heads)), h) for h in m.heads]
        return [(label, self.loaded.path(e.file), e.file.digest) for label, e in entries]

    def synthetic(self, dims: str):
        """(package, config, max_seq) of seeds/003's one-layer probe at `dims`, built once."""
        from ane_spec.probes.synthetic import build_synthetic_t4

        if dims not in self.synthetic_packages:
            self.progress(f"building the synthetic-t4 {dims} package")
            self.synthetic_packages[dims] = build_synthetic_t4(dims, self.work)
        return self.synthetic_packages[dims]

    def pipeline(self, units: str = "CPU_AND_NE"):
        """The build on Core ML with `units` where Core ML runs, else on the fp16 interpreter."""
        from ane_spec.runtime.pipeline import ShardPipeline

        loaded = self.loaded
        key = "mil-fp16" if self.coreml_problem else units
        if key not in self.pipelines:
            backend = (make_backend("mil", precision="fp16", decode_shape=self.decode_shape)
                       if self.coreml_problem else
                       make_backend("coreml", compute_units=units, decode_shape=self.decode_shape))
            self.progress(f"loading the build on {backend.describe()}")
            self.pipelines[key] = ShardPipeline(loaded, backend, self.decode_shape)
        return self.pipelines[key]


# --- environment ---------------------------------------------------------------------------

def native_bridge() -> str:
    """"loaded", or "not loaded (<why>)": coremltools' native module, libcoremlpython."""
    try:
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError as exc:
        return f"not loaded ({exc})"
    return "loaded"


def check_environment(run: DoctorRun) -> Verdict:
    import coremltools

    from ane_spec import __version__
    from ane_spec.runtime.compiled_cache import compiled_dir

    facts = {"os": _os_description(), "chip": _chip(), "python": platform.python_version(),
             "coremltools": coremltools.__version__, "ane_spec": __version__,
             "core_ml": run.coreml_problem or "available",
             "decode_shape": run.decode_shape, "reshape_frequency": run.reshape_frequency,
             "compiled_cache": str(compiled_dir())}
    bridge = native_bridge()
    facts["native_bridge"] = bridge
    # First: the Python and whether Core ML's native bridge loaded (coremltools 9.0 has macOS
    # wheels for 3.10-3.13 only; elsewhere its sdist installs without it, and Core ML is gone).
    summary = (f"Python {facts['python']}, Core ML native bridge {bridge}; {facts['os']}, "
               f"{facts['chip']}, coremltools {facts['coremltools']}; decode shape "
               f"{run.decode_shape} -> reshapeFrequency {run.reshape_frequency}")
    if run.reshape_frequency == "Frequent":
        facts["expected_placement"] = MIXED_SHAPE_NOTE
        summary += " (expected off the ANE; the decode-shape check measures it)"
    return Verdict("passed", summary, facts)


@core_ml_check
def check_neural_engine(run: DoctorRun) -> Verdict:
    run.need_coreml()
    from coremltools.models.compute_device import MLComputeDevice, MLNeuralEngineComputeDevice

    from ane_spec.runtime.coreml_backend import hardware_problem

    devices = MLComputeDevice.get_all_compute_devices()
    engines = [d for d in devices if isinstance(d, MLNeuralEngineComputeDevice)]
    names = [type(d).__name__ for d in devices]
    # Under a stand-in for Core ML's native layer the list is the stand-in's: say so.
    note = f" (device list from a stand-in: {hardware_problem()})" if hardware_problem() else ""
    if not engines:
        return Verdict("failed", f"no Neural Engine among {names}{note}",
                     {"devices": names})
    cores = engines[0].total_core_count
    return Verdict("passed", f"Neural Engine with {cores} cores{note}",
                 {"devices": names, "ane_cores": cores})


# --- static checks (anywhere) ------------------------------------------------------------------

def check_fp16_only(run: DoctorRun) -> Verdict:
    """Every value in every program fp16 (int32 for indices), no casts, no identity ops."""
    from ane_spec.shards.static_checks import dtype_problems, read_package_facts

    problems = {}
    packages = _packages_or_synthetic(run)
    for label, path, _ in packages:
        facts = read_package_facts(path)
        found = dtype_problems(facts)
        extra = sorted({"cast", "identity"} & set(facts.ops))
        if extra:
            found.append(f"{', '.join(extra)} op(s)")
        if found:
            problems[label] = found
    if problems:
        first = next(iter(problems.items()))
        return Verdict("failed", f"{len(problems)} package(s) not fp16-only, e.g. "
                     f"{first[0]}: {first[1][0]}", {"problems": problems})
    return Verdict("passed", f"{len(packages)} package(s): every op fp16, no cast, "
                 "no identity", {"packages": [label for label, _, _ in packages]})


def check_ane_lint(run: DoctorRun) -> Verdict:
    from ane_spec.probes.residency import INFORMATIONAL_LINT, ane_lint

    packages = _packages_or_synthetic(run)
    warnings = [{"package": label, "function": w.function, "code": w.code, "message": w.message}
                for label, path, _ in packages for w in ane_lint(path)]
    notes = sorted({w["code"] for w in warnings if w["code"] in INFORMATIONAL_LINT})
    failing = [w for w in warnings if w["code"] not in INFORMATIONAL_LINT]
    note = f"; notes: {', '.join(notes)}" if notes else ""
    if failing:
        codes = sorted({w["code"] for w in failing})
        return Verdict("failed", f"{len(failing)} pattern(s) known to leave the ANE: "
                     f"{', '.join(codes)}{note}", {"warnings": warnings})
    return Verdict("passed", f"{len(packages)} package(s), no pattern known to leave "
                 f"the ANE (a clean lint is not residency){note}", {"warnings": warnings})


# --- synthetic probes ----------------------------------------------------------------------------

def check_synthetic_tiny(run: DoctorRun) -> Verdict:
    """seeds/003's probe at tiny dims on the fp16 interpreter: the op pattern's numerics."""
    from ane_spec.probes.synthetic import probe_block

    path, config, max_seq = run.synthetic("tiny")
    backend = make_backend("mil", precision="fp16")
    report = probe_block(path, config, max_seq, "BCT1", backend, "synthetic-t4-tiny")
    return _from_gate(report)


@core_ml_check
def check_synthetic_on_coreml(dims: str, run: DoctorRun) -> Verdict:
    """seeds/003's probe at `dims` on Core ML: residency, and T=4 against four T=1 calls."""
    if run.coreml_problem:
        raise Skip(f"{run.coreml_problem} (a Core ML check: the interpreter would take "
                   f"minutes at {dims} dims)")
    run.need_hardware()  # a stand-in computes with the interpreter: minutes at these dims
    from ane_spec.probes.residency import residency_report
    from ane_spec.probes.synthetic import probe_block

    path, config, max_seq = run.synthetic(dims)
    backend = make_backend("coreml", decode_shape=run.decode_shape)
    block = probe_block(path, config, max_seq, "BCT1", backend, f"synthetic-t4-{dims}")
    residency = residency_report(path)
    passed = block.passed and residency.passed
    summary = (f"residency {_residency_line(residency)}; T=4 vs 4 x T=1 min cosine "
               f"{block.figures['min_cosine']:.6f}")
    return Verdict("passed" if passed else "failed", summary,
                   {"block": block.to_dict(), "residency": residency.to_dict()})


def synthetic_on_coreml(dims: str) -> CheckFn:
    # A partial of a module-level function, so the worker child can unpickle it.
    return functools.partial(check_synthetic_on_coreml, dims)


@core_ml_check
def check_mask_ops(run: DoctorRun) -> Verdict:
    """equal(NaN, NaN) false, select picks, greater_equal marks, clip(+-inf) saturates, on the
    device, and where a build shard's compute plan puts each: which `--mask-form` this Mac
    should use (probes/mask_ops.py). A wrong op fails the check; placement only steers the
    advice, and only a build's plan gives it: a small standalone program is placed on the CPU
    whatever its ops, so without --manifest the check reports the op results alone."""
    run.need_coreml()
    from ane_spec.probes import mask_ops
    from ane_spec.probes.residency import residency_report
    from ane_spec.runtime.backend import make_backend
    from ane_spec.runtime.coreml_backend import hardware_problem

    path = mask_ops.build_probe(run.work / "mask-ops.mlpackage")
    inputs = mask_ops.probe_inputs()
    # Through the backend, as the pipeline runs programs: in the Core ML worker, every input
    # a fresh float32 array the feed ring keeps alive past the call (the bridge's input-
    # lifetime rule, coreml_backend.FeedRing), not fp16 arrays that die with the call.
    backend = make_backend("coreml", compute_units="CPU_AND_NE")
    try:
        results, clip_nan = mask_ops.judge(backend.load(path).predict(inputs), inputs)
    finally:
        backend.close()
    where: dict[str, str] = {}
    source: dict[str, str] = {}
    if run.build is not None:  # the build's own plan says where its ops go
        from ane_spec.shards.static_checks import read_package_facts

        label, shard, digest = run.packages()[0]
        run.progress(f"compute plan of {label} (mask ops)")
        where = mask_ops.placements(residency_report(shard, "CPU_AND_NE", digest=digest),
                                    set(read_package_facts(shard).ops))
        source = dict.fromkeys(where, label)
    form, reason = mask_ops.recommend(results, where, built=run.build is not None)
    details = mask_ops.to_details(results, clip_nan, where, source, form, reason)
    if hardware_problem():  # results computed, and any placement given, by a stand-in
        details["stand_in"] = hardware_problem()
    wrong = [f"{op} ({r.example})" for op, r in results.items() if not r.right]
    placed = (", ".join(f"{op} {d}" for op, d in where.items())
              + f" (plan of {' and '.join(sorted(set(source.values())))})" if where else
              "placement needs --manifest (a build shard's compute plan)")
    advice = f"use --mask-form {form}" if form else "no mask-form advice"
    head = ("wrong: " + "; ".join(wrong) if wrong else
            "equal(NaN,NaN) false, select picks, greater_equal marks, clip(+-inf) saturates")
    note = (" (clip is wrong: both forms rely on it)" if not results["clip"].right else "")
    return Verdict("failed" if wrong else "passed",
                   f"{head}{note}; {clip_nan}; planned: {placed}; {advice}: {reason}", details)


# --- the build on Core ML -----------------------------------------------------------------

@core_ml_check
def check_residency(run: DoctorRun) -> Verdict:
    run.need_build_on_coreml()
    from ane_spec.probes.residency import residency_reports

    per_package = {}  # "shard 0-1", "shard 0-1 prefill", ..., "head": one per function
    packages = run.packages()
    for label, path, digest in packages:
        run.progress(f"compute plan of {label}")
        for r in residency_reports(path, "CPU_AND_NE", digest=digest, strict=run.strict):
            per_package[label if r.function == "main" else f"{label} {r.function}"] = r
    undetermined = next((r.undetermined for r in per_package.values() if r.undetermined), None)
    if undetermined:  # the plan loaded and its structure was read; placement is unknown
        ops = sum(r.conv_total + sum(r.unplanned.values()) for r in per_package.values())
        raise Skip(f"{undetermined}; structure only: {ops} op(s) of {len(per_package)} "
                   f"function(s) in {len(packages)} package(s) read, placement unknown")
    failed = [label for label, r in per_package.items() if not r.passed]
    build = run.loaded.manifest.build
    planned_t = build.default_t
    summary = f"planned at T={planned_t} (the RangeDim default)" + (
        f", the prefill function at its fixed T={build.prefill_t}" if build.prefill_t else "")
    summary += "; " + "; ".join(f"{label}: {_residency_line(r)}"
                                for label, r in per_package.items())
    uncovered = [t for t in DecodeShapePolicy(run.decode_shape).jit_widths if t != planned_t]
    if uncovered:  # mixed: its T=1 passes run at a shape the plan never saw
        summary += (f"; T={'/'.join(map(str, uncovered))} passes ({run.decode_shape} decode "
                    "shape) are not covered")
    argmax = {label: r.argmax_devices for label, r in per_package.items() if r.argmax_devices}
    if argmax:  # --head-argmax: say where the wide reduce_argmax really landed
        summary += "; reduce_argmax on " + ", ".join(
            f"{label}: {'/'.join(sorted(set(d)))}" for label, d in argmax.items())
    return Verdict("failed" if failed else "passed", summary,
                   {label: r.to_dict() for label, r in per_package.items()}
                   | {"planned_t": planned_t, "planned_prefill_t": build.prefill_t})


@core_ml_check
def check_cold_jit(run: DoctorRun) -> Verdict:
    """Seconds of the first prediction of each package at T=4 (and T=1 in the mixed shape), and
    of each layer package's prefill function at T=P: Core ML specialises a program once per
    process and input shape, before its first result."""
    run.need_build_on_coreml()
    run.need_hardware()
    t0 = time.perf_counter()
    pipeline = run.pipeline("CPU_AND_NE")
    load_s = time.perf_counter() - t0
    first = first_predictions(run, pipeline)
    total = sum(v for times in first.values() for v in times.values())
    per_package = ", ".join(f"{label} " + "/".join(f"{k} {v:.1f}s" for k, v in times.items())
                            for label, times in first.items())
    return Verdict("passed", f"load {load_s:.1f}s; first predictions {total:.1f}s in all: "
                   f"{per_package}", {"backend": pipeline.backend.describe(),
                                      "load_s": round(load_s, 3), "first_prediction_s": first,
                                      "jit_s": jit_by_function(first)})


def first_predictions(run: DoctorRun, pipeline) -> dict[str, dict[str, float]]:
    """Seconds of each package's first prediction at each shape it runs (`T=4`, and `T=1` in
    the mixed shape; a layer package's prefill function at `prefill T=P`), by package label:
    the first predictions only where nothing ran the pipeline before. Kept in
    `run.measurements` for the prefill check."""
    labels = [label for label, _, _ in run.packages()]
    shards = len(pipeline.shards)
    first: dict[str, dict[str, float]] = {label: {} for label in labels}

    def timed(label: str, shape: str, predict: Callable[[], Any]) -> Any:
        run.progress(f"first {shape} prediction of {label}")
        t = time.perf_counter()
        out = predict()
        first[label][shape] = round(time.perf_counter() - t, 2)
        return out

    for width in pipeline.shape.jit_widths:
        state = pipeline.new_state()
        inputs = pipeline.host.block(0, width)
        hidden = jit_rows(pipeline, width)
        for n, label in enumerate(labels):
            if n >= shards:  # one of the head's packages
                timed(label, f"T={width}", lambda n=n: pipeline.heads[n - shards].predict(
                    {"x": hidden}))
            else:
                hidden = timed(label, f"T={width}", lambda n=n: pipeline.run_shards(
                    hidden, inputs, state, range(n, n + 1)))
    if pipeline.prefill_t:
        state = pipeline.new_state()
        hidden, inputs = pipeline.prefill_inputs(jit_tokens(pipeline, pipeline.prefill_t), 0,
                                                 state)
        for n, label in enumerate(labels[:shards]):
            hidden = timed(label, f"prefill T={pipeline.prefill_t}", lambda n=n: (
                pipeline.run_shards(hidden, inputs, state, range(n, n + 1), prefill=True)))
    run.measurements["first_prediction_s"] = first
    return first


def jit_by_function(first: dict[str, dict[str, float]]) -> dict[str, float]:
    """`first_predictions` summed by function and shape, as the daemon's warm-up reports them:
    {"decode T=4": shards and head, "prefill T=64": shards}."""
    found: dict[str, float] = {}
    for times in first.values():
        for shape, seconds in times.items():
            key = shape if shape.startswith("prefill") else f"decode {shape}"
            found[key] = round(found.get(key, 0.0) + seconds, 2)
    return found


def jit_tokens(pipeline, n: int) -> list[int]:
    """n token ids from 1 up, wrapping inside the vocabulary."""
    vocab = pipeline.config.vocab_size
    return [1 + i % (vocab - 1) for i in range(n)]


def jit_rows(pipeline, width: int):
    """The first prediction's input: token embeddings, never all-zero rows (an fp16 rms_eps of
    1e-5 is subnormal; flushed to zero on the ANE, a zero row normalises to NaN)."""
    return pipeline.to_hidden(pipeline.embeddings.lookup(jit_tokens(pipeline, width)))


@core_ml_check
def check_warm_latency(run: DoctorRun) -> Verdict:
    """Median backend time of a whole pass (shards + head) at T=1 and T=4 on CPU_AND_NE, warm."""
    run.need_build_on_coreml()
    run.need_hardware()
    pipeline = run.pipeline("CPU_AND_NE")
    # T=4 first, the width every earlier check ran: one shape switch per shard, not two.
    figures = {f"t{w}_ms": _median_pass_ms(pipeline, w) for w in (4, 1)}
    run.measurements["CPU_AND_NE"] = figures
    return Verdict("passed", f"CPU_AND_NE: T=1 {figures['t1_ms']:.1f} ms, T=4 "
                   f"{figures['t4_ms']:.1f} ms per pass",
                   figures | {"backend": pipeline.backend.describe()})


# What only a Mac's Neural Engine can say about a prefill function.
PREFILL_MAC_ONLY = ("only a Mac's Neural Engine tells the real c(P)/c(4), prefill tok/s and "
                    "each function's JIT cost, and (the residency check) whether the prefill "
                    "function's ops run on the ANE at all")


@core_ml_check
def check_prefill(run: DoctorRun) -> Verdict:
    """A build with a prefill function: what a P-row pass costs against a decode pass (c(P)/c(4),
    decode/prefill_plan.measure, as --prefill auto decides by), the prompt tokens a second it
    gives, and the first pass (JIT) of each function, from cold-jit on a Mac or timed here on a
    fresh load. On Core ML proper, a full prefill chunk that costs more than the P/4 decode
    passes it replaces fails (the prefill function may be off the ANE); elsewhere (the fp16
    interpreter, or a stand-in for Core ML's native layer) the figures are not the device's and
    the check says so, and what only a Mac can tell."""
    build = run.loaded.manifest.build
    if not build.prefill_t:
        raise Skip("this build has no prefill function (built with --prefill-t 0, or before "
                   "it existed): prompts run at the decode shape")
    from ane_spec.decode.prefill_plan import measure
    from ane_spec.runtime.coreml_backend import hardware_problem

    fresh = ("mil-fp16" if run.coreml_problem else "CPU_AND_NE") not in run.pipelines
    pipeline = run.pipeline()
    first = run.measurements.get("first_prediction_s")
    if first is None and fresh:
        first = first_predictions(run, pipeline)
    jit = None if first is None else jit_by_function(first)
    run.progress(f"timing decode and prefill T={build.prefill_t} passes")
    costs = measure(pipeline)
    figures = costs.to_dict()
    full = costs.pays(costs.prefill_t, last=False)
    decode_tok_s = round(costs.decode_t / costs.decode_seconds, 1) if costs.decode_seconds else 0
    summary = (f"prefill T={costs.prefill_t}: c(P)/c({costs.decode_t}) {costs.ratio:.2f} "
               f"(decode pass {figures['decode_ms']:.1f} ms, prefill pass "
               f"{figures['prefill_ms']:.1f} ms, with the head on one row "
               f"{figures['prefill_head_ms']:.1f} ms); {figures['prefill_tok_s']:.0f} prompt "
               f"tok/s through the prefill function, {decode_tok_s:.0f} at the decode shape; "
               f"a full chunk {'pays' if full else 'does not pay'}; first passes (JIT): "
               + (", ".join(f"{k} {v:.2f}s" for k, v in jit.items()) if jit else
                  "not measured (the build was already loaded and run)"))
    details = figures | {"decode_tok_s": decode_tok_s, "full_chunk_pays": full,
                         "jit_s": jit, "backend": pipeline.backend.describe()}
    elsewhere = (f"the fp16 MIL interpreter ({run.coreml_problem})" if run.coreml_problem
                 else f"{pipeline.backend.describe()}, whose native layer is not the device's "
                 f"({hardware_problem()})" if hardware_problem() else None)
    if elsewhere is not None:
        details["not_the_device"] = elsewhere
        return Verdict("passed", f"{summary} [timed on {elsewhere}: not the device's figures; "
                       f"{PREFILL_MAC_ONLY}]", details)
    if not full:
        return Verdict("failed", f"{summary}: a {costs.prefill_t}-row pass costs more than the "
                       f"{costs.prefill_t // costs.decode_t} decode passes it replaces, so "
                       "--prefill auto never uses it (its ops may run off the ANE: see "
                       "residency; rebuild with --prefill-t 0 or a smaller P)", details)
    return Verdict("passed", summary, details)


@core_ml_check
def check_ane_vs_cpu(run: DoctorRun) -> Verdict:
    """The same passes under CPU_ONLY: the compute plan cannot see runtime choices (such as the
    reshape hint), so the clock is the cross-check that the Neural Engine is really used. Last,
    because a CPU_ONLY copy of the build adds to the process's memory."""
    run.need_build_on_coreml()
    run.need_hardware()
    ane = run.measurements.get("CPU_AND_NE")
    if ane is None:
        raise Skip("no CPU_AND_NE latency to compare with (warm-latency did not run)")
    memory_note = small_mac_warning(_host_memory_bytes())
    if memory_note:
        run.progress(memory_note)
    cpu = {f"t{w}_ms": _median_pass_ms(run.pipeline("CPU_ONLY"), w) for w in (1, 4)}
    run.pipelines.pop("CPU_ONLY")
    run.measurements["CPU_ONLY"] = cpu  # the decode-shape check reads T=1 from here
    speedup = cpu["t4_ms"] / ane["t4_ms"]
    summary = (f"CPU_ONLY: T=1 {cpu['t1_ms']:.1f} ms, T=4 {cpu['t4_ms']:.1f} ms per pass; "
               f"CPU_AND_NE is {speedup:.2f}x faster at T=4"
               + (f" ({memory_note})" if memory_note else "")
               + (f"; {MIXED_SHAPE_NOTE}, so a CPU_AND_NE figure near CPU_ONLY's is what it "
                  "predicts" if run.reshape_frequency == "Frequent" else ""))
    if speedup >= MIN_ANE_SPEEDUP:
        return Verdict("passed", summary, {"CPU_ONLY": cpu, "ane_speedup_t4": speedup})
    return Verdict("failed", summary + f" (< {MIN_ANE_SPEEDUP}x: the Neural Engine may not be in "
                   "use; a tiny test model can also simply be faster on the CPU)",
                   {"CPU_ONLY": cpu, "ane_speedup_t4": speedup})


@core_ml_check
def check_decode_shape_placement(run: DoctorRun) -> Verdict:
    """Where the decode shape's passes run under the reshapeFrequency hint they load with.

    fixed loads with Infrequent, under which Apple's flexible-input guide lets flexible shapes
    run on the ANE (residency planned that shape). mixed loads with Frequent and is expected off
    the ANE (ane_limits.MIXED_SHAPE_SOURCE). MLComputePlan in coremltools 9.0 takes no hints, so
    the plan cannot say; this check measures instead: on a Mac by the clock (T=1 passes of the
    build as loaded, CPU_AND_NE with Frequent against CPU_ONLY, from warm-latency and
    ane-vs-cpu), and where a stand-in replaces Core ML's native layer by the placement the
    stand-in reports for each package loaded with the same hints (Core ML itself never reports
    one). Last: it reads ane-vs-cpu's CPU_ONLY figures."""
    if run.reshape_frequency == "Infrequent":
        return Verdict("passed", f"{run.decode_shape} decode shape: reshapeFrequency "
                       "Infrequent, the hint under which flexible shapes may run on the ANE; "
                       "residency covers its one shape (T=4)", {"reshape_frequency": "Infrequent"})
    run.need_build_on_coreml()
    from ane_spec.runtime.coreml_backend import hardware_problem

    details: dict[str, Any] = {"reshape_frequency": "Frequent", "expected": MIXED_SHAPE_NOTE}
    if hardware_problem():
        reported = _reported_placements(run)
        details["placement"] = reported
        off = {label: where for label, where in reported.items() if "not on the ANE" in where}
        how = "placement reported by the loaded models (a stand-in)"
    else:
        ane = run.measurements.get("CPU_AND_NE", {}).get("t1_ms")
        cpu = run.measurements.get("CPU_ONLY", {}).get("t1_ms")
        if ane is None or cpu is None:
            raise Skip("no T=1 timings to compare (warm-latency or ane-vs-cpu did not run)")
        speedup = cpu / ane
        details |= {"t1_ms": {"CPU_AND_NE": ane, "CPU_ONLY": cpu}, "ane_speedup_t1": speedup}
        off = {"build": f"T=1 CPU_AND_NE {ane:.1f} ms vs CPU_ONLY {cpu:.1f} ms "
                        f"({speedup:.2f}x, < {MIN_ANE_SPEEDUP}x)"} if speedup < MIN_ANE_SPEEDUP else {}
        how = (f"timed: T=1 CPU_AND_NE {ane:.1f} ms vs CPU_ONLY {cpu:.1f} ms, "
               f"{speedup:.2f}x")
    details["off_ane"] = sorted(off)
    if off:
        return Verdict("failed", f"{run.decode_shape} decode shape runs off the ANE under "
                       f"reshapeFrequency Frequent, as expected ({MIXED_SHAPE_SOURCE}); "
                       f"measured: {how}; off: {', '.join(sorted(off))}. On a Mac use "
                       "--decode-shape fixed", details)
    return Verdict("passed", f"{run.decode_shape} decode shape runs on the ANE despite "
                   f"reshapeFrequency Frequent (expected off it: {MIXED_SHAPE_SOURCE}); "
                   f"measured: {how}", details)


def _reported_placements(run: DoctorRun) -> dict[str, str]:
    """Each package loaded as the pipeline loads it (CPU_AND_NE, the decode shape's hints), and
    where its native model says it runs: only a stand-in says (tests/coreml_standin.py's
    Frequent + RangeDim rule); a package whose model says nothing reads "not reported"."""
    import coremltools as ct

    from ane_spec.runtime.coreml_backend import compile_package, optimization_hints

    found = {}
    for label, path, digest in run.packages():
        run.progress(f"loading {label} with reshapeFrequency {run.reshape_frequency}")
        model = ct.models.CompiledMLModel(
            str(compile_package(path, digest)), ct.ComputeUnit.CPU_AND_NE,
            optimization_hints=optimization_hints(run.reshape_frequency))
        found[label] = str(getattr(getattr(model, "_proxy", None), "placement", "not reported"))
        del model
    return found


def small_mac_warning(host_bytes: int | None) -> str | None:
    """ane-vs-cpu loads a second, CPU_ONLY copy of the whole build: on a Mac with 16 GB or less
    a Phi-size build may then swap, which slows both copies and the whole machine."""
    if host_bytes is None or host_bytes > SMALL_MAC_BYTES:
        return None
    return (f"warning: this machine has {host_bytes / 1e9:.0f} GB; ane-vs-cpu loads a second "
            "full copy of the build and may swap")


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _median_pass_ms(pipeline, width: int) -> float:
    state = pipeline.new_state()
    times = []
    for i in range(WARM_REPEATS + 1):  # the first call may still specialise: not counted
        out = pipeline.run([1], i, state, width=width)
        times.append(out.backend_seconds)
    return round(1000 * statistics.median(times[1:]), 3)


# --- model checks: Core ML where it runs, the fp16 interpreter elsewhere --------------------

@core_ml_check
def check_row_invariance(run: DoctorRun) -> Verdict:
    from ane_spec.probes.row_invariance import run_row_invariance

    return _from_gate(run_row_invariance(run.pipeline()))


@core_ml_check
def check_overflow(run: DoctorRun) -> Verdict:
    from ane_spec.probes.overflow import run_overflow

    return _from_gate(run_overflow(run.pipeline()))


@core_ml_check
def check_block(run: DoctorRun) -> Verdict:
    from ane_spec.probes.block import run_block

    return _from_gate(run_block(run.pipeline()))


@core_ml_check
def check_drift(run: DoctorRun) -> Verdict:
    from ane_spec.probes.drift import measure_drift

    return _from_gate(measure_drift(run.pipeline()))


@core_ml_check
def check_parity(run: DoctorRun) -> Verdict:
    import importlib.util

    from ane_spec.probes.gates import gate_parity

    source = Path(run.gguf or run.loaded.manifest.source.path)
    if not source.is_file():
        raise Skip(f"needs the source GGUF ({source} is not there; pass --gguf PATH)")
    if importlib.util.find_spec("torch") is None:
        raise Skip("needs torch for the reference forward pass: pip install 'ane-spec[reference]'")
    return _from_gate(gate_parity(run.loaded, run.pipeline(), run.gguf))


# Hidden states the argmax-head check compares the two heads on: tokens from position 0.
ARGMAX_CHECK_TOKENS = 64


@core_ml_check
def check_argmax_head(run: DoctorRun) -> Verdict:
    """A --head-argmax build's ids against a logits head's argmax on the same hidden states.

    The logits head is built here, into the doctor's scratch folder, from the source GGUF with
    the build's weight format and chunks (the same weights per chunk); both heads run on the
    backend the model checks use (Core ML CPU_AND_NE where it runs, else the fp16
    interpreter), on hidden states from the build's own shards. An id that differs passes only
    at a near-tie: the logits head's value at the argmax head's id within one fp16 step of its
    maximum (two programs may round a tie differently); anything else fails."""
    m = run.loaded.manifest
    if not m.build.head_argmax:
        raise Skip("not a --head-argmax build (its head emits logits)")
    source = Path(run.gguf or m.source.path)
    if not source.is_file():
        raise Skip(f"needs the source GGUF ({source} is not there; pass --gguf PATH)")
    from ane_spec.shards.build import build_logits_head

    pipeline = run.pipeline()
    run.progress("building a logits head beside the argmax head")
    path, chunks = build_logits_head(source, m, run.work / "argmax-check")
    backend = (make_backend("mil", precision="fp16", decode_shape=run.decode_shape)
               if run.coreml_problem else
               make_backend("coreml", compute_units="CPU_AND_NE", decode_shape=run.decode_shape))
    try:
        return _compare_heads(run, pipeline, backend, path, chunks)
    finally:
        close = getattr(backend, "close", None)  # a Core ML worker process: end it
        if close is not None:
            close()


def _compare_heads(run: DoctorRun, pipeline, backend, path: Path, chunks) -> Verdict:
    import numpy as np

    from ane_spec.runtime.backend import start_backend

    m = run.loaded.manifest
    logits_head = backend.load(path)
    start_backend(backend)
    rng = np.random.default_rng(0)
    tokens = [int(t) for t in rng.integers(0, m.model.vocab_size,
                                           min(ARGMAX_CHECK_TOKENS, m.build.max_seq))]
    state = pipeline.new_state()
    ids_argmax, ids_logits, gaps = [], [], []
    for start in range(0, len(tokens), pipeline.max_t):
        block = tokens[start:start + pipeline.max_t]
        width = pipeline.shape.pass_width(len(block))
        padded = [*block, *[block[-1]] * (width - len(block))]
        hidden = pipeline.run_shards(pipeline.to_hidden(pipeline.embeddings.lookup(padded)),
                                     pipeline.host.block(start, len(block), width), state)
        got = pipeline._read_head(pipeline.head.predict({"x": hidden}), len(block)).argmax
        out = logits_head.predict({"x": hidden})
        logits = np.concatenate([pipeline.token_major(out[f"logits_{i}"])[:len(block)]
                                 for i in range(len(chunks))], axis=1).astype(np.float32)
        want = logits.argmax(axis=1)
        ids_argmax += got.tolist()
        ids_logits += want.tolist()
        rows = np.arange(len(block))
        gaps += (logits[rows, want] - logits[rows, got]).tolist()
    agree = sum(a == b for a, b in zip(ids_argmax, ids_logits))
    top = float(np.max(np.abs(gaps))) if gaps else 0.0
    # One fp16 step at the logits' magnitude: how far two roundings of a tie can fall apart.
    step = float(np.spacing(np.float16(max(1.0, top + 1.0))))
    bad = [i for i, g in enumerate(gaps) if g > step]
    details = {"rows": len(tokens), "agree": agree, "chunks": len(chunks),
               "widest_chunk": max(e - s for s, e in chunks), "near_tie_disagreements":
               len(tokens) - agree - len(bad), "disagreements": len(bad),
               "backend": backend.describe()}
    summary = (f"argmax head agrees with a logits head on {agree}/{len(tokens)} rows "
               f"({len(chunks)} chunks, widest {details['widest_chunk']:,}; "
               f"{backend.describe()})")
    if bad:
        return Verdict("failed", summary + f"; {len(bad)} row(s) differ by more than a "
                       "near-tie", details)
    return Verdict("passed", summary, details)


@core_ml_check
def check_peak_memory(run: DoctorRun) -> Verdict:
    """Peak resident memory of the worker process, which by now has loaded and run the build on
    Core ML. Informational only: process RSS is not ANE memory (the ANE's own allocations do
    not show in it), so it never fails; the ~3 GB per-process ANE limit the seed log hit is
    given for scale."""
    run.need_build_on_coreml()
    run.need_hardware()
    if "CPU_AND_NE" not in run.pipelines:
        raise Skip("the build was not loaded on Core ML (an earlier check failed)")
    peak = peak_rss_bytes()
    return Verdict("passed", f"informational: peak RSS {peak / 1e9:.2f} GB (process memory, "
                   f"not ANE memory; the per-process ANE limit was seen at "
                   f"~{ANE_PROCESS_BYTES / 1e9:.0f} GB)",
                   {"peak_rss_gb": round(peak / 1e9, 3), "informational": True})


@core_ml_check
def check_state_reads(run: DoctorRun) -> Verdict:
    """Reading a K/V state leaves nothing behind: one layer's K state of one conversation read
    1,000 times through the slot-capture path (probes/state_reads.py), the Core ML worker's
    current RSS watched. Without the autorelease pool around each read (runtime/autorelease.py)
    what Core ML autoreleases there would pile up in the worker, one object per read."""
    run.need_build_on_coreml()
    from ane_spec.probes.state_reads import measure_state_reads
    from ane_spec.runtime.coreml_backend import hardware_problem

    result = measure_state_reads(run.pipeline())
    details = result.to_dict()
    summary = result.summary()
    if hardware_problem():  # the RSS is real; what Core ML autoreleases is the stand-in's model
        details["standin"] = hardware_problem()
        summary += " (Core ML's native layer is a stand-in)"
    return Verdict("failed" if result.leaks else "passed", summary, details)


@core_ml_check
def check_draft_costs(run: DoctorRun) -> Verdict:
    """What the draft model costs beside the target on this device (issue 34): a target pass
    (c_verify), a draft pass on `--draft-units` (c_draft), and how much of the draft's passes
    hide behind a target pass when both run at once, with the draft in its own process, as
    `serve --draft-model` measures them at warm-up to set its p_min (decode/draft_setup.py
    `measure_draft_costs`). Informational: these figures decide the policy, not a pass/fail."""
    run.need_build_on_coreml()
    if run.draft is None:
        raise Skip("needs --draft-model (a draft of the build's vocabulary)")
    from ane_spec.decode.draft_setup import close_drafter, open_drafter
    from ane_spec.runtime.coreml_backend import hardware_problem

    units = run.draft_units or "ane"
    run.progress(f"measuring the draft model on {units} beside the build")
    drafter = open_drafter(run.pipeline(), run.draft, units=units, mode="model")  # type: ignore[arg-type]
    try:
        costs = drafter.costs.to_dict()
    finally:
        close_drafter(drafter)
    overlap = "not measured" if costs["overlap"] is None else f"{costs['overlap']:.0%}"
    summary = (f"informational: a target pass {costs['verify_ms']:,.1f} ms, a draft pass "
               f"{costs['draft_ms']:,.1f} ms on {units} (c_draft / c_verify "
               f"{costs['ratio']:.3f}); {overlap} of the draft's passes hidden behind a target "
               f"pass")
    if hardware_problem():
        summary += " (Core ML's native layer is a stand-in: not this device's times)"
    return Verdict("passed", summary, costs | {"draft_units": units, "informational": True})


def check_kv_slots(run: DoctorRun) -> Verdict:
    """How many conversations' K/V states `serve` can keep resident: counted against the ~3 GB
    per-process ANE budget the seed log hit, and against host memory."""
    budget = slot_budget(run.loaded.manifest)
    status: Status = "passed" if budget.ane_slots >= 1 else "failed"
    return Verdict(status, budget.summary(), budget.to_dict())


def check_activation_range(run: DoctorRun) -> Verdict:
    """The build's residual scale and the fp16 margins its calibration measured (build time,
    fp32 reference): failed where the calibration prompts already overflow fp16 as the program
    holds them; skipped for builds that recorded no calibration."""
    rs = run.loaded.manifest.residual_scale
    if rs is None or rs.calibration is None:
        raise Skip(describe_residual_scale(rs)[-1].strip())
    problems = margin_problems(rs)
    summary = "; ".join(line.strip() for line in describe_residual_scale(rs))
    return Verdict("failed" if problems else "passed", summary, rs.model_dump())


CHECKS: list[tuple[str, CheckFn]] = [
    ("environment", check_environment),
    ("neural-engine", check_neural_engine),
    ("fp16-only", check_fp16_only),
    ("ane-lint", check_ane_lint),
    ("synthetic-t4 tiny (interpreter fp16)", check_synthetic_tiny),
    ("synthetic-t4 d1024 (Core ML)", synthetic_on_coreml("d1024")),
    ("synthetic-t4 phi (Core ML)", synthetic_on_coreml("phi")),
    ("mask-ops", check_mask_ops),  # which --mask-form: its own small program, not the build's
    ("residency", check_residency),
    ("cold-jit", check_cold_jit),  # the first predictions with the build's shards: keep first
    ("warm-latency", check_warm_latency),
    ("prefill", check_prefill),  # after cold-jit: it reads the first predictions it timed
    ("row-invariance", check_row_invariance),
    ("overflow", check_overflow),
    ("block", check_block),
    ("drift", check_drift),
    ("parity", check_parity),
    ("argmax-head", check_argmax_head),
    ("peak-memory", check_peak_memory),
    ("state-reads", check_state_reads),  # after peak-memory: that peak is the build's alone
    ("draft-costs", check_draft_costs),
    ("kv-slots", check_kv_slots),
    ("activation-range", check_activation_range),
    ("ane-vs-cpu", check_ane_vs_cpu),  # loads a CPU_ONLY copy: after peak-memory
    ("decode-shape", check_decode_shape_placement),  # reads ane-vs-cpu's CPU_ONLY timings
]


def run_doctor(manifest: str | Path | None = None, *, decode_shape: str = "fixed",
               gguf: str | None = None, progress: Callable[[str], None] = lambda msg: None,
               checks: list[tuple[str, CheckFn]] | None = None,
               on_check: Callable[[list[Check]], None] = lambda done: None,
               strict: bool = False, draft: str | None = None,
               draft_units: str | None = None) -> list[Check]:
    """Run the checks in order; after each, `on_check(results so far)`. `strict`: the
    residency check wants every planned op on the ANE (residency.ResidencyReport.passed).
    `draft`, `draft_units`: a draft model's build folder for the draft-costs check."""
    from ane_spec.probes.doctor_worker import CheckWorker, WorkerSpec

    check_decode_shape(decode_shape)
    # A bad build is one clear error, not 10 failures.
    build = None if manifest is None else load_manifest(manifest, verify=True)
    checks = checks or CHECKS
    results: list[Check] = []
    with tempfile.TemporaryDirectory(prefix="ane-spec-doctor-") as work:
        run = DoctorRun(build, Path(work), decode_shape, gguf, progress, strict=strict,
                        draft=draft, draft_units=draft_units)
        worker = CheckWorker(WorkerSpec(None if manifest is None else str(manifest),
                                        decode_shape, gguf, work, strict, draft, draft_units),
                             checks, progress)
        try:
            for index, (name, check) in enumerate(checks):
                progress(f"{name} ...")
                t0 = time.perf_counter()
                if runs_in_child(check) and run.coreml_problem is None:
                    fields = worker.run(index)
                else:
                    fields = vars(run_one(check, run))
                results.append(Check(name, **fields,
                                     seconds=round(time.perf_counter() - t0, 3)))
                on_check(list(results))
        finally:
            worker.close()
    return results


def run_one(check: CheckFn, run: DoctorRun) -> Verdict:
    """One check, its Python exceptions turned into verdicts (a native crash is the worker's)."""
    from ane_spec.runtime.coreml_backend import shape_switches

    switches = shape_switches()
    try:
        verdict = check(run)
    except Skip as why:
        verdict = Verdict("skipped", str(why))
    except BackendUnavailable as exc:
        verdict = Verdict("skipped", str(exc))
    except WorkerDied as exc:  # a pipeline's Core ML worker died under the check
        verdict = Verdict("failed", f"crashed: {exc}", dict(exc.details) | {
            "worker": exc.worker, "during": exc.during})
    except Exception as exc:  # one broken check must not hide the others' results
        verdict = Verdict("failed", f"error: {type(exc).__name__}: {exc}".splitlines()[0])
    caused = shape_switches() - switches
    if caused:  # each may cost a re-specialisation under reshapeFrequency Infrequent
        verdict.details = dict(verdict.details) | {"shape_switches": caused}
    return verdict


# --- helpers ---------------------------------------------------------------------------------

def _packages_or_synthetic(run: DoctorRun) -> list[tuple[str, Path, str]]:
    """The build's packages, or without a build the d1024 synthetic-t4 layer package (the tiny
    one's 16-wide heads are below the ANE's 32-multiple state rule on purpose: it is a numerics
    probe)."""
    if run.build is not None:
        return run.packages()
    path, _, _ = run.synthetic("d1024")
    return [("synthetic-t4 d1024", path, "")]


def _from_gate(report: GateReport) -> Verdict:
    if report.skipped:
        return Verdict("skipped", report.skipped, report.to_dict())
    figures = ", ".join(f"{k} {_fmt(v)}" for k, v in report.figures.items()
                        if not isinstance(v, (list, dict)) and k != "verdict")
    return Verdict("passed" if report.passed else "failed", f"[{report.where}] {figures}",
                 report.to_dict())


def _residency_line(r) -> str:
    if r.not_in_plan:
        return r.not_in_plan
    unplanned = sum(r.unplanned.values())
    share = r.ane_cost_share
    line = (f"{r.compute_total - r.compute_non_ane}/{r.compute_total} planned ops on the ANE, "
            f"convs off the ANE {r.conv_non_ane}/{r.conv_total}, unplanned {unplanned}, "
            + (f"{share:.1%} of the estimated cost on the ANE" if share is not None
               else "no cost estimates")
            + (" (strict: every op)" if r.strict else
               f" (gate: every conv and {r.min_ane_cost_share:.0%} of the cost)"))
    if r.non_ane_ops:  # each op off the ANE, with its cost: what a reader needs to judge it
        def device(name: str) -> str:
            return name.removeprefix("ML").removesuffix("ComputeDevice")

        line += "; off the ANE: " + ", ".join(
            f"{o['op']} '{o['output']}' on {device(o['device'])}"
            f" (cost {'?' if o['cost'] is None else format(o['cost'], '.3g')})"
            for o in r.non_ane_ops)
    return line


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _os_description() -> str:
    if sys.platform == "darwin":
        version = platform.mac_ver()[0]
        return f"macOS {version} ({platform.machine()})"
    return f"{platform.system()} {platform.release()} ({platform.machine()})"


def _chip() -> str:
    try:
        if sys.platform == "darwin":
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or platform.machine()
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or platform.machine()
