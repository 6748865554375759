"""The static ANE lint on real packages (the project's own builds and hand-built MIL programs),
and the residency report, which only macOS can produce."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types
from coremltools.proto import MIL_pb2

from ane_spec.errors import AneSpecError
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.residency import (
    ResidencyReport,
    ane_lint,
    op_kind,
    plan_residency,
    residency_report,
)
from ane_spec.runtime.coreml_backend import compile_package
from ane_spec.runtime.backend import BackendUnavailable
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.static_checks import read_package_facts

OPSET = ct.target.iOS18
ON_MAC = sys.platform == "darwin"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny2.gguf",
                                preset("tiny", num_layers=2))


@pytest.fixture(scope="module")
def builds(gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    """weights format -> [layer shard, head] of a 2-layer S=64 build."""
    root = tmp_path_factory.mktemp("builds")
    out = {}
    for weights in ("int8-channel", "q8-block", "fp16"):
        build(gguf, root / weights, BuildRequest(topology="2", max_seq=64, weights=weights))
        out[weights] = [root / weights / "shards" / "layers_00_02.mlpackage",
                        root / weights / "head.mlpackage"]
    return out


def codes(package: Path, **kw) -> list[str]:
    return [w.code for w in ane_lint(package, **kw)]


def save(prog, path: Path, inputs: list) -> Path:
    ct.convert(prog, inputs=inputs, minimum_deployment_target=OPSET, convert_to="mlprogram",
               compute_precision=ct.precision.FLOAT32, skip_model_load=True).save(str(path))
    return path


def fp16_input(name: str, shape) -> ct.TensorType:
    return ct.TensorType(name=name, shape=shape, dtype=np.float16)


def test_int8_channel_build_is_clean(builds) -> None:
    for package in builds["int8-channel"]:
        assert ane_lint(package) == []


def test_q8_block_warns_on_every_conv_package(builds) -> None:
    for package in builds["q8-block"]:
        warnings = ane_lint(package)
        assert [w.code for w in warnings] == ["per-block-scales"]
        assert "#2510" in warnings[0].message and warnings[0].package == str(package)


def test_oversize_against_the_given_budget(builds) -> None:
    shard, head = builds["fp16"]
    assert 1.0 < sum(p.stat().st_size for p in shard.rglob("*") if p.is_file()) / 2**20 < 2.0
    assert codes(shard, max_shard_mb=1) == ["oversize"]
    assert codes(shard, max_shard_mb=2) == [] and codes(shard) == []
    assert codes(head, max_shard_mb=1) == []  # the head is under 1 MiB


def test_state_dimension_not_multiple_of_32(tmp_path: Path) -> None:
    def program(width: int):
        @mb.program(input_specs=[mb.TensorSpec((1, 4, 1, width), dtype=types.fp16),
                                 mb.StateTensorSpec((1, 4, 64, width), dtype=types.fp16)],
                    opset_version=OPSET)
        def prog(x, cache):
            y = mb.add(x=mb.read_state(input=cache), y=x)
            mb.coreml_update_state(state=cache, value=y)
            return mb.identity(x=y, name="out")
        return prog

    bad = save(program(48), tmp_path / "s48.mlpackage", [fp16_input("x", (1, 4, 1, 48))])
    good = save(program(64), tmp_path / "s64.mlpackage", [fp16_input("x", (1, 4, 1, 64))])
    assert codes(bad) == ["state-dim-not-32"]
    assert "[1, 4, 64, 48]" in ane_lint(bad)[0].message
    assert codes(good) == []  # 4 heads on an outer axis are fine


def _stateful_program(extra_input: bool):
    """x [1, 32, T] plus, with `extra_input`, a fixed-shape b [1, 32, 1]; one [1, 32, 32] state."""
    t = get_new_symbol()
    x_spec = mb.TensorSpec((1, 32, t), dtype=types.fp16)
    b_spec = mb.TensorSpec((1, 32, 1), dtype=types.fp16)
    state_spec = mb.StateTensorSpec((1, 32, 32), dtype=types.fp16)

    def body(x, b, cache):
        y = mb.read_state(input=cache) if b is None else mb.add(x=mb.read_state(input=cache), y=b)
        mb.coreml_update_state(state=cache, value=y)
        return mb.add(x=mb.reduce_sum(x=y, axes=[2], keep_dims=True),
                      y=mb.reduce_sum(x=x, axes=[2], keep_dims=True), name="out")

    if extra_input:
        @mb.program(input_specs=[x_spec, b_spec, state_spec], opset_version=OPSET)
        def prog(x, b, cache):
            return body(x, b, cache)
    else:
        @mb.program(input_specs=[x_spec, state_spec], opset_version=OPSET)
        def prog(x, cache):
            return body(x, None, cache)
    return prog


def test_mixed_fixed_and_range_inputs_in_a_stateful_program(tmp_path: Path) -> None:
    t = ct.RangeDim(1, 4, default=1)
    mixed = save(_stateful_program(True), tmp_path / "mixed.mlpackage",
                 [fp16_input("x", (1, 32, t)), fp16_input("b", (1, 32, 1))])
    assert codes(mixed) == ["mixed-fixed-range"]
    only_range = save(_stateful_program(False), tmp_path / "range.mlpackage",
                      [fp16_input("x", (1, 32, t))])
    assert codes(only_range) == []


def test_enumerated_shapes_in_a_stateful_program(tmp_path: Path) -> None:
    shapes = ct.EnumeratedShapes(shapes=[(1, 32, 1), (1, 32, 4)], default=(1, 32, 1))
    package = save(_stateful_program(False), tmp_path / "enum.mlpackage",
                   [fp16_input("x", shapes)])
    assert read_package_facts(package).enumerated_inputs == ["x"]
    assert codes(package) == ["enumerated-shapes-state"]


def test_topk(tmp_path: Path) -> None:
    @mb.program(input_specs=[mb.TensorSpec((1, 64), dtype=types.fp16)], opset_version=OPSET)
    def prog(x):
        values, _ = mb.topk(x=x, k=4, axis=-1)
        return values

    assert codes(save(prog, tmp_path / "topk.mlpackage", [fp16_input("x", (1, 64))])) == ["topk"]


def test_int64_tensor(tmp_path: Path) -> None:
    """coremltools narrows int64 to int32 on conversion, so write one into the spec by hand."""
    @mb.program(input_specs=[mb.TensorSpec((1, 64), dtype=types.fp16)], opset_version=OPSET)
    def prog(x):
        return mb.reshape(x=x, shape=np.array([64, 1], dtype=np.int32), name="out")

    model = ct.convert(prog, inputs=[fp16_input("x", (1, 64))], convert_to="mlprogram",
                       minimum_deployment_target=OPSET, skip_model_load=True)
    clean = tmp_path / "i32.mlpackage"
    model.save(str(clean))
    assert codes(clean) == []

    spec = model.get_spec()
    func = spec.mlProgram.functions["main"]
    const = next(op for op in func.block_specializations[func.opset].operations
                 if op.type == "const")
    const.outputs[0].type.tensorType.dataType = MIL_pb2.INT64
    val = const.attributes["val"]
    val.type.tensorType.dataType = MIL_pb2.INT64
    val.immediateValue.tensor.longInts.values.extend([64, 1])
    val.immediateValue.tensor.ClearField("ints")
    package = tmp_path / "i64.mlpackage"
    ct.models.MLModel(spec, weights_dir=model.weights_dir, skip_model_load=True).save(str(package))
    warnings = ane_lint(package)
    assert [w.code for w in warnings] == ["int64"]
    assert const.outputs[0].name in warnings[0].message


def test_residency_report_needs_macos(builds) -> None:
    if ON_MAC:
        pytest.skip("off-macOS behaviour")
    with pytest.raises(BackendUnavailable, match=r"^unavailable: needs macOS 15 \(this is \w+\): the residency report needs"):
        residency_report(builds["int8-channel"][0])
    with pytest.raises(AneSpecError, match="CPU_AND_NE"):
        residency_report(builds["int8-channel"][0], compute_units="NPU")


def test_report_passes_only_with_everything_on_the_ane() -> None:
    report = ResidencyReport("p", "CPU_AND_NE", conv_total=8, compute_total=100,
                             unplanned={"read_state": 4})
    assert report.passed and report.to_dict()["passed"] is True
    report.compute_non_ane, report.non_ane_ops = 1, [{"op": "ios18.topk", "output": "v",
                                                      "device": "MLCPUComputeDevice", "cost": 0.1}]
    assert not report.passed and report.to_dict()["non_ane_ops"][0]["op"] == "ios18.topk"
    assert not ResidencyReport("p", "CPU_AND_NE").passed  # an empty plan proves nothing


# --- the gate on compute plans built from coremltools' own classes ----------------------------
#
# Only macOS can produce an MLComputePlan. These tests build one from coremltools' dataclasses
# (models/compute_plan.py), shaped like the plan of a real package: the operations are those of
# a saved layer shard, in order, with their real output names. MLComputePlan delegates every
# question to a native proxy (libcoremlpython's _MLComputePlanProxy); `PlanProxy` stands in for
# that one object, answering from a table, the way coremltools' _MLComputePlanRemoteProxy does.


def device(cls):
    """A compute device of class `cls`. Its __init__ insists on a native proxy object
    (models/compute_device.py); on macOS take the real device, elsewhere make the instance
    without one (the gate only asks which class it is)."""
    if ON_MAC:
        from coremltools.models.compute_device import MLComputeDevice

        found = [d for d in MLComputeDevice.get_all_compute_devices() if isinstance(d, cls)]
        if found:
            return found[0]
    return cls.__new__(cls)


def structure_of(package: Path, opset_prefix: set[str] = frozenset()):
    """The MLModelStructure of a saved package's main function, op for op."""
    import coremltools.models.compute_plan as cp

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    func = spec.mlProgram.functions["main"]
    ops = []
    for op in func.block_specializations[func.opset].operations:
        inputs = {name: cp.MLModelStructureProgramArgument(bindings=[
            cp.MLModelStructureProgramBinding(name=b.name or None, value=None)
            for b in arg.arguments]) for name, arg in op.inputs.items()}
        ops.append(cp.MLModelStructureProgramOperation(
            inputs=inputs, blocks=[], __proxy__=None,
            operator_name=f"ios18.{op.type}" if op.type in opset_prefix else op.type,
            outputs=[cp.MLModelStructureProgramNamedValueType(
                name=o.name, type=cp.MLModelStructureProgramValueType()) for o in op.outputs]))
    named = [cp.MLModelStructureProgramNamedValueType(
        name=i.name, type=cp.MLModelStructureProgramValueType()) for i in func.inputs]
    block = cp.MLModelStructureProgramBlock(inputs=named, operations=ops,
                                            output_names=list(func.block_specializations[
                                                func.opset].outputs))
    program = cp.MLModelStructureProgram(
        functions={"main": cp.MLModelStructureProgramFunction(inputs=named, block=block)})
    return cp.MLModelStructure(neuralnetwork=None, program=program, pipeline=None)


class PlanProxy:
    """Answers MLComputePlan's three questions: device usage per op from `where` (op type ->
    device class, or None for "no usage"), a cost for every planned op."""

    def __init__(self, structure, where: dict[str, type | None]) -> None:
        import coremltools.models.compute_plan as cp

        self.cp, self.model_structure, self.where = cp, structure, where
        self.asked: list[str] = []

    def get_compute_device_usage_for_mlprogram_operation(self, op):
        kind = op.operator_name.rsplit(".", 1)[-1]
        self.asked.append(kind)
        cls = self.where.get(kind, self.where.get("*"))
        if cls is None:
            return None
        return self.cp.MLComputePlanDeviceUsage(preferred_compute_device=device(cls),
                                                supported_compute_devices=[device(cls)])

    def get_estimated_cost_for_mlprogram_operation(self, op):
        if self.get_compute_device_usage_for_mlprogram_operation(op) is None:
            return None
        return self.cp.MLComputePlanCost(weight=0.01)


def compute_plan(structure, where: dict[str, type | None]):
    """A real MLComputePlan object over `PlanProxy` (its __init__ wants the native proxy)."""
    from coremltools.models.compute_plan import MLComputePlan

    plan = MLComputePlan.__new__(MLComputePlan)
    plan.__proxy__ = PlanProxy(structure, where)
    return plan


@pytest.fixture(scope="module")
def shard_structure(builds):
    package = builds["int8-channel"][0]
    return package, read_package_facts(package), structure_of(package, {"conv", "read_state"})


def test_unplanned_state_reads_are_reported_not_failed(shard_structure) -> None:
    """The plan Apple documents for such a program: state reads get no device usage (None), every
    other non-const op prefers the ANE. That passes, with the reads listed as unplanned."""
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    package, facts, structure = shard_structure
    plan = compute_plan(structure, {"read_state": None, "*": MLNeuralEngineComputeDevice})
    report = plan_residency(plan, str(package), "CPU_AND_NE")
    assert report.passed, report.non_ane_ops
    assert report.unplanned == {"read_state": facts.ops["read_state"]} and facts.ops["read_state"]
    assert report.conv_total == facts.ops["conv"] == 8 and report.conv_non_ane == 0
    weights = facts.ops["const"] + facts.ops["constexpr_blockwise_shift_scale"]
    assert report.compute_total == sum(facts.ops.values()) - weights - facts.ops["read_state"]
    assert "const" not in plan.__proxy__.asked  # weights are never asked about

    # Casts, identities and state writes left undispatched too: still a pass.
    more = {"read_state": None, "write_state": None, "reshape": None,
            "*": MLNeuralEngineComputeDevice}
    again = plan_residency(compute_plan(structure, more), str(package), "CPU_AND_NE")
    assert again.passed and set(again.unplanned) == {"read_state", "write_state", "reshape"}


def test_an_op_on_the_cpu_fails_and_is_named(shard_structure) -> None:
    from coremltools.models.compute_device import (
        MLCPUComputeDevice,
        MLGPUComputeDevice,
        MLNeuralEngineComputeDevice,
    )

    package, facts, structure = shard_structure
    where = {"read_state": None, "exp": MLCPUComputeDevice, "conv": MLGPUComputeDevice,
             "*": MLNeuralEngineComputeDevice}
    report = plan_residency(compute_plan(structure, where), str(package), "CPU_AND_NE")
    assert not report.passed
    assert report.conv_non_ane == facts.ops["conv"]
    assert report.compute_non_ane == facts.ops["exp"] + facts.ops["conv"]
    devices = Counter((op["op"], op["device"]) for op in report.non_ane_ops)
    assert devices == {("exp", "MLCPUComputeDevice"): facts.ops["exp"],
                       ("ios18.conv", "MLGPUComputeDevice"): facts.ops["conv"]}
    assert all(op["cost"] == 0.01 for op in report.non_ane_ops)


def test_an_unplanned_conv_fails_and_an_empty_plan_never_passes(shard_structure) -> None:
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    package, facts, structure = shard_structure
    report = plan_residency(compute_plan(structure, {"conv": None,
                                                     "*": MLNeuralEngineComputeDevice}),
                            str(package), "CPU_AND_NE")
    assert not report.passed and report.conv_non_ane == facts.ops["conv"]
    assert report.compute_non_ane == 0 and report.unplanned == {"conv": facts.ops["conv"]}
    assert {op["device"] for op in report.non_ane_ops} == {"unplanned"}
    nothing = plan_residency(compute_plan(structure, {"*": None}), str(package), "CPU_AND_NE")
    assert not nothing.passed and nothing.compute_total == 0


def test_residency_report_asks_core_ml_for_the_cached_compile(shard_structure, tmp_path: Path,
                                                             monkeypatch) -> None:
    """The entry point: compile (keyed by the given hash), load the plan with the requested
    compute units, walk it. Compiling and planning need macOS, so those two calls are replaced."""
    import coremltools.models.compute_plan as cp
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    from ane_spec.probes import residency

    package, _, structure = shard_structure
    seen = {}

    def load_from_path(path: str, compute_units: ct.ComputeUnit):
        seen.update(path=path, units=compute_units)
        return compute_plan(structure, {"read_state": None, "*": MLNeuralEngineComputeDevice})

    def compile_package(p: Path, digest: str | None) -> Path:
        seen.update(package=p, digest=digest)
        return tmp_path / f"{digest}.mlmodelc"

    monkeypatch.setattr(residency, "require_macos", lambda what, advice="": None)
    monkeypatch.setattr(residency, "compile_package", compile_package)
    monkeypatch.setattr(cp.MLComputePlan, "load_from_path", load_from_path)
    report = residency_report(package, "CPU_ONLY", digest="ab" * 32)
    assert seen == {"package": package, "digest": "ab" * 32, "units": ct.ComputeUnit.CPU_ONLY,
                    "path": str(tmp_path / f"{'ab' * 32}.mlmodelc")}
    assert report.passed and report.compute_units == "CPU_ONLY"


@pytest.mark.skipif(not ON_MAC, reason="MLComputePlan needs macOS (Core ML); Linux cannot "
                    "compile a package or plan its ops")
def test_compiled_plan_has_the_saved_programs_op_types(builds) -> None:
    """Compiling may fuse ops, so the plan may hold fewer ops than the saved program, never
    more, and no op type the program does not have."""
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan

    for package in builds["int8-channel"]:
        facts = read_package_facts(package)
        plan = MLComputePlan.load_from_path(str(compile_package(package)),
                                            compute_units=ct.ComputeUnit.CPU_AND_NE)
        kinds = Counter(op_kind(op.operator_name)
                        for op in plan.model_structure.program.functions["main"].block.operations)
        work = {k: n for k, n in kinds.items() if k != "const" and not k.startswith("constexpr_")}
        saved = {k: n for k, n in facts.ops.items()
                 if k != "const" and not k.startswith("constexpr_")}
        assert set(work) <= set(saved), sorted(set(work) - set(saved))
        assert sum(work.values()) <= sum(saved.values())
        report = residency_report(package)
        assert report.conv_total == kinds["conv"] > 0
        assert len(report.non_ane_ops) == report.compute_non_ane + report.unplanned.get("conv", 0)
        # The tiny d=192 model may be placed on the CPU by the cost model (ane-book saw that at
        # d=64), so whether it passes is not asserted: only that the report is consistent.
        assert report.passed == (report.compute_non_ane == 0 and report.conv_non_ane == 0
                                 and report.compute_total > 0)


# --- ANE limits with their sources (ane_spec/ane_limits.py, issue 18 defect 5) ----------------

def test_max_seq_above_the_ane_spatial_limit_is_linted_and_warned(tmp_path: Path) -> None:
    from ane_spec.ane_limits import ANE_MAX_SPATIAL, build_warnings

    def program(seq: int):
        @mb.program(input_specs=[mb.TensorSpec((1, 1, seq, 32), dtype=types.fp16),
                                 mb.StateTensorSpec((1, 1, seq, 32), dtype=types.fp16)],
                    opset_version=OPSET)
        def prog(x, cache):
            y = mb.add(x=mb.read_state(input=cache), y=x)
            mb.coreml_update_state(state=cache, value=y)
            return mb.mul(x=y, y=np.float16(1), name="out")
        return prog

    seq = ANE_MAX_SPATIAL + 32
    long = save(program(seq), tmp_path / "long.mlpackage", [fp16_input("x", (1, 1, seq, 32))])
    ok = save(program(ANE_MAX_SPATIAL), tmp_path / "ok.mlpackage",
              [fp16_input("x", (1, 1, ANE_MAX_SPATIAL, 32))])
    warning = next(w for w in ane_lint(long) if w.code == "max-seq")
    assert "16,384" in warning.message and "ANEMLL" in warning.message
    assert "max-seq" not in codes(ok)
    assert any("ANEMLL" in w for w in build_warnings(seq, "int8-channel", False))
    assert build_warnings(ANE_MAX_SPATIAL, "int8-channel", False) == []


def test_q8_block_and_argmax_say_their_sources(builds, gguf: Path, tmp_path: Path) -> None:
    from ane_spec.ane_limits import build_warnings

    message = ane_lint(builds["q8-block"][0])[0].message
    assert "wrong output" in message and "0.37" in message
    lines = []
    result = build(gguf, tmp_path / "argmax", BuildRequest(topology="2", max_seq=64,
                                                          head_argmax=True),
                   progress=lines.append)
    assert any("reduce_argmax" in w for w in result.warnings)
    assert any(line.startswith("warning: --head-argmax") for line in lines)
    head = ane_lint(tmp_path / "argmax" / "head.mlpackage")
    assert [w.code for w in head] == ["argmax"] and "CPU" in head[0].message
    assert any("wrong output" in w for w in build_warnings(64, "q8-block", False))


def test_q8_block_is_refused_on_the_neural_engine_unless_forced(
        builds, coreml_standin, monkeypatch) -> None:
    from ane_spec.ane_limits import FORCE_Q8_BLOCK_ENV
    from ane_spec.probes.gates import open_pipeline

    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime.backend import make_backend
    from ane_spec.runtime.pipeline import ShardPipeline

    q8 = builds["q8-block"][0].parents[1]
    loaded = load_manifest(q8)
    monkeypatch.delenv(FORCE_Q8_BLOCK_ENV, raising=False)
    for units in ("CPU_AND_NE", "ALL"):
        with pytest.raises(AneSpecError, match="q8-block.*wrong output.*" + FORCE_Q8_BLOCK_ENV):
            ShardPipeline(loaded, make_backend("coreml", compute_units=units))
    ShardPipeline(loaded, make_backend("coreml", compute_units="CPU_ONLY"))
    monkeypatch.setenv(FORCE_Q8_BLOCK_ENV, "1")
    open_pipeline(q8, "coreml", "fp32")
    open_pipeline(q8, "mil", "fp32")  # the interpreter is not the ANE: never refused


# --- both functions of a layer package (issue 33) -------------------------------------------

def test_a_function_missing_from_the_plan_never_passes(shard_structure) -> None:
    """A plan whose structure holds `main` only says nothing of `prefill`: that function's
    report names why and fails, whatever main's does."""
    from coremltools.models.compute_device import MLNeuralEngineComputeDevice

    package, _, structure = shard_structure
    plan = compute_plan(structure, {"read_state": None, "*": MLNeuralEngineComputeDevice})
    assert plan_residency(plan, str(package), "CPU_AND_NE").passed
    missing = plan_residency(plan, str(package), "CPU_AND_NE", "prefill")
    assert not missing.passed and missing.function == "prefill"
    assert missing.not_in_plan == ("the compute plan has no function 'prefill' (it has main): "
                                   "its placement is unknown")
    assert missing.to_dict()["passed"] is False


@pytest.fixture
def as_if_planned(coreml_standin, monkeypatch):
    """The stand-in's plan table taken for a real plan: residency's verdicts are computed (the
    stand-in otherwise marks every report 'placement unknown')."""
    from ane_spec.probes import residency

    monkeypatch.setattr(residency, "hardware_problem", lambda: None)
    return coreml_standin


def test_residency_judges_each_function_of_a_layer_package(as_if_planned, builds,
                                                           tmp_path: Path) -> None:
    """One compute plan per package, walked per function: with the prefill function's selects on
    the CPU and everything else on the ANE, `main` passes and `prefill` fails, and the gate,
    `probe residency` and the doctor each say which function."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.probes.doctor import DoctorRun, check_residency, run_one
    from ane_spec.probes.gates import gate_residency, residency_or_lint
    from ane_spec.probes.residency import residency_reports

    shard, head = builds["int8-channel"]
    facts = read_package_facts(shard, "prefill")
    as_if_planned.set_rules(plan_devices={"default": "NeuralEngine"})
    both = residency_reports(shard)
    assert [(r.function, r.passed) for r in both] == [("main", True), ("prefill", True)]
    assert both[1].conv_total == facts.ops["conv"] > 0
    assert [r.function for r in residency_reports(head)] == ["main"]

    as_if_planned.set_rules(plan_devices={"default": "NeuralEngine", "functions": {
        "prefill": {"ops": {"select": "CPU"}}}})
    main, prefill = residency_reports(shard)
    assert main.passed and not prefill.passed
    assert prefill.compute_non_ane == facts.ops["select"] > 0
    assert {(o["op"], o["device"]) for o in prefill.non_ane_ops} == {
        ("select", "MLCPUComputeDevice")}

    report = residency_or_lint(shard)
    assert not report.passed and report.skipped is None
    assert report.figures["compute_non_ane"] == report.figures["prefill_compute_non_ane"] == (
        facts.ops["select"])
    assert [p["function"] for p in report.details["packages"]] == ["main", "prefill"]

    loaded = load_manifest(shard.parents[1])
    gate = gate_residency(loaded)
    assert not gate.passed and gate.figures["prefill_compute_non_ane"] == facts.ops["select"]
    assert gate.figures["planned_t"] == 4 and gate.figures["planned_prefill_t"] == 64
    assert f"prefill_compute_non_ane {facts.ops['select']}," in gate.summary()

    verdict = run_one(check_residency, DoctorRun(loaded, tmp_path))
    assert verdict.status == "failed", verdict.summary
    assert "the prefill function at its fixed T=64" in verdict.summary
    assert verdict.details["shard 0-1"]["passed"] and not verdict.details[
        "shard 0-1 prefill"]["passed"]
    assert verdict.details["planned_prefill_t"] == 64


def two_function_package(path: Path, channels: int, prefill_t: int) -> Path:
    """`main` (T 1..4) and `prefill` (T = prefill_t) of one program whose reshape puts
    channels x T / 32 rows on a spatial axis: only the prefill function's is wide."""
    from ane_spec.shards.programs import with_prefill, save_package

    def program(t):  # noqa: ANN001
        @mb.program(input_specs=[mb.TensorSpec((1, channels, t, 1), dtype=types.fp16)],
                    opset_version=OPSET)
        def prog(x):
            rows = mb.reshape(x=x, shape=[1, 1, -1, 32], name="rows")
            return mb.mul(x=rows, y=np.float16(2), name="out")
        return prog

    save_package(with_prefill(program(get_new_symbol()), program(prefill_t)), path)
    return path


def test_the_lint_reads_each_function_at_its_own_shape(tmp_path: Path) -> None:
    """A limit that depends on T is checked in each function at its T: 2,048 channels as rows of
    32 are 256 rows at T=4 and 32,768 at T=512, above the ANE's 16,384 (ANEMLL's figure); only
    the prefill function is flagged, saying so, with the source."""
    package = two_function_package(tmp_path / "wide.mlpackage", 2048, 512)
    [warning] = ane_lint(package)
    assert (warning.code, warning.function) == ("width", "prefill")
    assert warning.message.startswith("function 'prefill': ")
    assert "'rows', reshape [1, 1, 32768, 32]" in warning.message and "ANEMLL" in warning.message
    assert ane_lint(two_function_package(tmp_path / "ok.mlpackage", 2048, 256)) == []


def test_reduction_depth_and_argmax_width_are_linted_with_their_sources(tmp_path: Path) -> None:
    """A conv summing 20,000 products (larql#312's limit is 16,384) and an argmax over 20,000
    values (Anemll keeps them to 16,384) are flagged; the same at 16,384 are not. (A matmul's
    summed axis is its input's last, a spatial one: past 16,384 it is flagged as a width too.)"""
    def package(n: int) -> Path:
        @mb.program(input_specs=[mb.TensorSpec((1, n, 1, 1), dtype=types.fp16)],
                    opset_version=OPSET)
        def prog(x):
            dot = mb.conv(x=x, weight=np.ones((2, n, 1, 1), np.float16), name="dot")
            best = mb.reduce_argmax(x=x, axis=1, keep_dims=True, name="best")
            return dot, best
        return save(prog, tmp_path / f"{n}.mlpackage", [fp16_input("x", (1, n, 1, 1))])

    warnings = {w.code: w.message for w in ane_lint(package(20000))}
    assert sorted(warnings) == ["argmax", "argmax-width", "reduction-depth"]
    assert "'dot', conv over 20,000" in warnings["reduction-depth"]
    assert "larql#312" in warnings["reduction-depth"]
    assert "'best', 20,000" in warnings["argmax-width"] and "Anemll" in warnings["argmax-width"]
    assert codes(package(16384)) == ["argmax"]


def test_a_real_build_lints_both_functions_clean(builds) -> None:
    """The project's own layer package at P = 64: both functions read, nothing flagged; its
    prefill function's facts are those of T = 64 (the scatter sums over the chunk's rows)."""
    shard = builds["int8-channel"][0]
    assert ane_lint(shard) == []
    prefill = read_package_facts(shard, "prefill")
    assert ("matmul", 64) in {(op, depth) for _, op, depth in prefill.reductions}
    widest = max(max(shape[-2:]) for _, shape in prefill.output_shapes.values())
    assert widest == 3 * 64  # the scores' G x P rows (3 query heads per K/V head)


# --- the gate's policy, through the stand-in's compute plan (issue 35 items 4 and 5) ----------

def _standin_report(coreml_standin, coreml_build, table, strict=False, **rules):  # noqa: ANN001
    from ane_spec.manifests.store import load_manifest

    coreml_standin.set_rules(plan_devices=table, **rules)
    loaded = load_manifest(coreml_build[0])
    entry = loaded.manifest.shards[0].file
    return residency_report(loaded.path(entry), "CPU_AND_NE", digest=entry.digest,
                            strict=strict)


# Relative costs: a conv or matmul is the work; a reshape or a state read next to nothing.
COSTS = {"conv": 100.0, "matmul": 50.0, "default": 0.5}


def test_a_reshape_on_the_cpu_passes_the_gate_listed_with_its_cost_and_fails_strict(
        coreml_standin, coreml_build) -> None:
    table = {"default": "NeuralEngine", "ops": {"reshape": "CPU"}, "costs": COSTS}
    report = _standin_report(coreml_standin, coreml_build, table)
    assert report.conv_non_ane == 0 and report.compute_non_ane == 16  # the 16 reshapes
    assert report.ane_cost_share > 0.95 and report.passed
    listed = {(o["op"], o["device"]) for o in report.non_ane_ops}
    assert listed == {("reshape", "MLCPUComputeDevice")}
    assert all(0 < o["cost"] < 0.01 for o in report.non_ane_ops)
    strict = _standin_report(coreml_standin, coreml_build, table, strict=True)
    assert not strict.passed and strict.compute_non_ane == 16


def test_a_conv_off_the_ane_or_a_costly_share_off_it_fails_the_gate(coreml_standin,
                                                                     coreml_build) -> None:
    conv = _standin_report(coreml_standin, coreml_build,
                           {"default": "NeuralEngine", "ops": {"conv": "GPU"}, "costs": COSTS})
    assert conv.conv_non_ane == 8 and not conv.passed
    matmul = _standin_report(coreml_standin, coreml_build,
                             {"default": "NeuralEngine", "ops": {"matmul": "CPU"},
                              "costs": COSTS})
    assert matmul.conv_non_ane == 0 and matmul.ane_cost_share < 0.95 and not matmul.passed
    # Off the ANE with no cost given: the share cannot be shown, so it does not pass.
    uncosted = _standin_report(coreml_standin, coreml_build,
                               {"default": "NeuralEngine", "ops": {"reshape": "CPU"}})
    assert uncosted.ane_cost_share is None and not uncosted.passed


def test_a_small_program_is_planned_on_the_cpu_whatever_its_ops(coreml_standin,
                                                                 coreml_build) -> None:
    table = {"default": "NeuralEngine", "costs": COSTS}
    assert _standin_report(coreml_standin, coreml_build, table).passed
    small = _standin_report(coreml_standin, coreml_build, table,
                            small_program_elements=10_000_000)
    assert small.compute_non_ane == small.compute_total > 0 and not small.passed


def test_a_non_default_rangedim_shape_under_infrequent_runs_off_the_ane(coreml_standin,
                                                                         coreml_build) -> None:
    """coremltools #2370: with Infrequent, a RangeDim model runs on the ANE only at its default
    shape (T=4 in these builds); a T=1 pass runs off it."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime.coreml_backend import CoreMLBackend

    loaded = load_manifest(coreml_build[0])
    entry = loaded.manifest.shards[0]
    program = CoreMLBackend("CPU_AND_NE", "Infrequent").load(loaded.path(entry.file))
    state = program.make_state()

    def inputs(t: int) -> dict:
        return {s.name: np.zeros([t if d == "T" else d for d in s.shape], np.float16)
                for s in entry.inputs}

    keep = []  # inputs outlive Core ML's hold on them (the lifetime rule)
    keep.append(inputs(4))
    program.predict(keep[-1], state)
    assert program.model._proxy.placement == "as planned"
    keep.append(inputs(1))
    program.predict(keep[-1], state)
    assert "#2370" in program.model._proxy.placement
