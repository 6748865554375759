"""The Core ML stand-in (tests/coreml_standin.py): each rule of coremltools' native layer it
enforces, reached through coremltools' own Python API and through `CoreMLBackend`, and the proof
that it catches the class of bug it was written for (a float16 `write_state`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.runtime.backend import make_backend
from ane_spec.runtime.coreml_backend import CoreMLProgram
from ane_spec.runtime.mil_backend import MILBackend


@pytest.fixture(scope="module")
def shard(coreml_build) -> tuple[Path, str]:
    out, m = coreml_build
    return out / m.shards[0].file.path, m.shards[0].file.digest


def feed(t: int = 4, pos: int = 0, seed: int = 0, s: int = 64, d: int = 192
         ) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    angles = rng.uniform(-np.pi, np.pi, size=(t, 12))
    mask = np.full((1, 1, t, s), -1e4, dtype=np.float16)
    write = np.zeros((1, 1, s, t), dtype=np.float16)
    for i in range(t):
        mask[0, 0, i, : pos + i + 1] = 0
        write[0, 0, pos + i, i] = 1
    return {"x": rng.standard_normal((1, d, t, 1)).astype(np.float16),
            "rope_cos": np.cos(angles).astype(np.float16),
            "rope_sin": np.sin(angles).astype(np.float16), "attn_mask": mask,
            "kv_write_mask": write}


def compiled_model(package: Path, **kwargs):
    import coremltools as ct
    from coremltools.models.utils import compile_model

    path = compile_model(str(package))
    return ct.models.CompiledMLModel(path, ct.ComputeUnit.CPU_AND_NE, **kwargs)


def test_results_equal_the_fp16_interpreter_bitwise(coreml_standin, shard) -> None:
    """Through the real CoreMLBackend (compile, cache, CompiledMLModel, MLState): outputs and
    states come back float32 and equal the fp16 interpreter's values exactly."""
    path, sha = shard
    coreml = make_backend("coreml").load(path, digest=sha)
    mil = MILBackend("fp16").load(path)
    states = [coreml.make_state(), mil.make_state()]
    for pos, t in [(0, 4), (4, 4), (8, 4)]:
        inputs = feed(t, pos, seed=pos)
        got = coreml.predict(inputs, states[0])["hidden"]
        want = mil.predict(inputs, states[1])["hidden"]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want.astype(np.float32))
    for name in coreml.state_names:
        k = coreml.read_state(states[0], name)
        assert k.dtype == np.float32
        np.testing.assert_array_equal(k, mil.read_state(states[1], name))


def test_compiled_once_into_the_cache(coreml_standin, shard, monkeypatch) -> None:
    path, sha = shard
    compiled = []
    real = coreml_standin.StandinModel.compileModel

    def counting(spec_path: str) -> str:
        compiled.append(spec_path)
        return real(spec_path)

    monkeypatch.setattr(coreml_standin.StandinModel, "compileModel", staticmethod(counting))
    # The in-process backend: the one the Core ML worker process runs.
    from ane_spec.runtime.coreml_backend import CoreMLBackend

    backend = CoreMLBackend()
    backend.load(path, digest=sha)
    backend.load(path, digest=sha)
    CoreMLBackend(reshape_frequency="Frequent").load(path)  # hashes the package: same key
    assert compiled == [str(path)]


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.int16, np.bool_, np.complex64])
def test_write_state_accepts_only_int32_float32_float64(coreml_standin, shard, dtype) -> None:
    """MLState.write_state passes the value through untouched (models/model.py) and the bridge
    converts only int32/float32/float64 (CoreMLPythonArray.mm dataTypeOf)."""
    model = compiled_model(shard[0])
    state = model.make_state()
    k = state.read_state("layer_0_k")
    assert k.dtype == np.float32
    kept = []  # the bridge's lifetime rule: what it was given must outlive Core ML's hold
    for ok in (np.float32, np.float64, np.int32):
        kept.append(k.astype(ok))
        state.write_state("layer_0_k", kept[-1])
    with pytest.raises(RuntimeError, match="value type not convertible"):
        state.write_state("layer_0_k", k.astype(dtype))


def test_write_state_needs_a_known_name_the_whole_shape_and_a_writable_array(
        coreml_standin, shard) -> None:
    model = compiled_model(shard[0])
    state = model.make_state()
    k = np.ones((1, 2, 64, 32), np.float32)
    state.write_state("layer_0_k", k)
    np.testing.assert_array_equal(state.read_state("layer_0_k"), k)
    with pytest.raises(RuntimeError, match="No state named"):
        state.write_state("layer_9_k", k)
    with pytest.raises(RuntimeError, match="No state named"):
        state.read_state("k")
    with pytest.raises(RuntimeError, match="does not match the destination shape"):
        state.write_state("layer_0_k", k[:, :, :8])
    readonly = k.copy()
    readonly.flags.writeable = False
    with pytest.raises(RuntimeError, match="value type not convertible"):
        state.write_state("layer_0_k", readonly)
    with pytest.raises(RuntimeError, match="negative stride"):
        state.write_state("layer_0_k", k[:, :, ::-1])
    # A strided (non-contiguous) view is a legal MLMultiArray: the bridge passes the strides.
    state.write_state("layer_0_k", np.ones((1, 2, 64, 64), np.float32)[..., ::2])


def test_predict_upcasts_fp16_in_python_and_checks_features(coreml_standin, shard) -> None:
    """CompiledMLModel.predict upcasts float16 inputs (MLModel._update_float16_multiarray_input_
    to_float32); Core ML then checks names, ranks and the RangeDim bounds."""
    model = compiled_model(shard[0])
    state = model.make_state()
    kept = {k: v.astype(np.float32) for k, v in feed().items()}
    out = model.predict(kept, state)
    assert out["hidden"].dtype == np.float32 and out["hidden"].shape == (1, 192, 4, 1)
    bad_dtype = {k: v.astype(np.int64) if k == "x" else v for k, v in feed().items()}
    with pytest.raises(RuntimeError, match="value type not convertible"):
        model.predict(bad_dtype, state)
    with pytest.raises(RuntimeError, match="required but not specified"):
        model.predict({k: v for k, v in feed().items() if k != "attn_mask"}, state)
    with pytest.raises(RuntimeError, match="not an input"):
        model.predict(feed() | {"extra": np.zeros(1, np.float32)}, state)
    with pytest.raises(RuntimeError, match="does not match the shape"):  # T=5 > RangeDim 4
        model.predict(feed(t=5), state)
    with pytest.raises(RuntimeError, match="does not match the shape"):  # rank
        model.predict(feed() | {"x": np.zeros((192, 4, 1), np.float32)}, state)
    # coremltools #2519's text: Core ML's own error, through Utils::handleError.
    with pytest.raises(RuntimeError, match=r'^\{\n    NSLocalizedDescription = "The input '
                       r'feature for layer_0_\w must be an MLState, but it was not\.";\n\}$'):
        model.predict(kept)
    assert coreml_standin.lifetime_violations == []
    # fp16 inputs: coremltools swaps them for float32 temporaries that die when predict
    # returns, while Core ML still holds them (coremltools PR #2827): the next call fails.
    model.predict(feed(), state)
    assert coreml_standin.lifetime_violations
    with pytest.raises(RuntimeError, match="freed .* after the call returned.*#2827"):
        model.predict(kept, state)


def test_coremltools_python_checks_still_run(coreml_standin, shard) -> None:
    """The stand-in sits below coremltools' Python: its argument checks are the real ones."""
    import coremltools as ct
    from coremltools.models.utils import compile_model

    path = compile_model(str(shard[0]))
    assert path.endswith(".mlmodelc")
    with pytest.raises(TypeError, match="compute_units"):
        ct.models.CompiledMLModel(path, "CPU_AND_NE")
    with pytest.raises(TypeError, match="reshapeFrequency"):
        ct.models.CompiledMLModel(path, ct.ComputeUnit.ALL,
                                  optimization_hints={"reshapeFrequency": "Frequent"})
    with pytest.raises(Exception, match="mlmodelc"):
        compile_model(str(shard[0]), destination_path=str(shard[0].parent / "wrong"))


def test_macos_gates(monkeypatch, tmp_path, shard) -> None:
    """On macOS 14.6, coremltools' Python refuses hints, and the bridge refuses states."""
    import coremltools as ct
    from coremltools.models.utils import compile_model

    from tests import coreml_standin

    coreml_standin.install(monkeypatch, macos=(14, 6))
    path = compile_model(str(shard[0]), destination_path=str(tmp_path / "m.mlmodelc"))
    with pytest.raises(ValueError, match="macOS >= 15"):
        ct.models.CompiledMLModel(path, ct.ComputeUnit.CPU_AND_NE,
                                  optimization_hints={"reshapeFrequency":
                                                      ct.ReshapeFrequency.Frequent})
    model = ct.models.CompiledMLModel(path, ct.ComputeUnit.CPU_AND_NE)
    with pytest.raises(RuntimeError, match="macOS >= 15"):
        model.make_state()
    coreml_standin.install(monkeypatch, macos=(12, 7))
    with pytest.raises(RuntimeError, match="macOS >= 13"):
        ct.models.CompiledMLModel(path, ct.ComputeUnit.CPU_AND_NE)


def test_compute_plan_reports_structure_only(coreml_standin, shard) -> None:
    import coremltools as ct
    from coremltools.models.compute_plan import MLComputePlan
    from coremltools.models.utils import compile_model

    from ane_spec.probes.residency import residency_report
    from ane_spec.shards.static_checks import read_package_facts

    path = compile_model(str(shard[0]))
    plan = MLComputePlan.load_from_path(path, compute_units=ct.ComputeUnit.CPU_AND_NE)
    ops = plan.model_structure.program.functions["main"].block.operations
    facts = read_package_facts(shard[0])
    assert sum(1 for op in ops if op.operator_name == "conv") == facts.ops["conv"] > 0
    assert all(plan.get_compute_device_usage_for_mlprogram_operation(op) is None for op in ops)
    report = residency_report(shard[0], digest=shard[1])
    assert report.compute_total == 0 and report.unplanned["conv"] == facts.ops["conv"]
    assert not report.passed and report.undetermined.startswith("needs Apple hardware")


def float16_write_state(self, state, name, value) -> None:
    """The write_state this project shipped before issue 18: float16 into the bridge."""
    state.write_state(name, np.ascontiguousarray(value, dtype=np.float16))


def test_a_float16_write_state_fails_through_the_standin(coreml_standin, coreml_build,
                                                        monkeypatch) -> None:
    """The defect the audit found: row invariance copies states with write_state. With the fixed
    code the gate runs; with the float16 write_state reinstated it cannot."""
    from ane_spec.probes.gates import open_pipeline
    from ane_spec.probes.row_invariance import run_row_invariance

    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime.coreml_backend import CoreMLBackend
    from ane_spec.runtime.pipeline import ShardPipeline

    out, _ = coreml_build
    # In this process, so the old write_state can be put back (the worker runs the same code).
    pipeline = ShardPipeline(load_manifest(out), CoreMLBackend())
    assert run_row_invariance(pipeline, prefix_lengths=(5,), end_of_context=False).passed
    monkeypatch.setattr(CoreMLProgram, "write_state", float16_write_state)
    with pytest.raises(RuntimeError, match="value type not convertible"):
        run_row_invariance(pipeline, prefix_lengths=(5,), end_of_context=False)


def test_inputs_default_to_the_shape_that_runs(coreml_build) -> None:
    """Defect 2: MLComputePlan plans the RangeDim default, and the fixed decode shape runs T=4,
    so every input defaults to T=4 and the manifest says which shape residency covers."""
    import coremltools as ct

    out, m = coreml_build
    assert m.build.default_t == 4
    for entry in (*m.shards, *m.heads):
        spec = ct.models.MLModel(str(out / entry.file.path), skip_model_load=True).get_spec()
        for feature in spec.description.input:
            arr = feature.type.multiArrayType
            t_axes = [i for i, r in enumerate(arr.shapeRange.sizeRanges)
                      if (r.lowerBound, r.upperBound) == (1, 4)]
            assert t_axes and all(arr.shape[i] == 4 for i in t_axes), feature.name


def test_old_manifests_read_as_planned_at_t1() -> None:
    from ane_spec.manifests.schema import BuildOptions

    old = dict(topology=[2], max_seq=64, layout="BCT1", weights="int8-channel", head_chunks=1,
               head_argmax=False, min_weight_cosine=0.99)
    assert BuildOptions(**old).default_t == 1
    with pytest.raises(ValueError, match="outside t_range"):
        BuildOptions(**old, default_t=4, t_range=(1, 2))


def test_probes_group_passes_by_width(coreml_standin, coreml_build, tmp_path) -> None:
    """Defect 4: under reshapeFrequency Infrequent each input-shape switch may cost Core ML a
    re-optimisation (minutes at Phi size). probe synthetic-t4 switches once (T=4 work, then
    T=1), and the block gate once per shard; the doctor reports the counts per check."""
    from ane_spec.probes.block import run_block
    from ane_spec.probes.gates import open_pipeline
    from ane_spec.probes.synthetic import build_synthetic_t4, probe_block
    from ane_spec.runtime.coreml_backend import shape_switches

    path, config, max_seq = build_synthetic_t4("tiny", tmp_path)
    before = shape_switches()
    report = probe_block(path, config, max_seq, "BCT1", make_backend("coreml"), "synthetic-t4")
    assert report.passed and shape_switches() - before == 1
    _, pipeline = open_pipeline(coreml_build[0], "coreml", "fp32")
    before = shape_switches()
    assert run_block(pipeline).passed
    assert shape_switches() - before == len(pipeline.shards)
    mixed = open_pipeline(coreml_build[0], "coreml", "fp32", decode_shape="mixed")[1]
    before = shape_switches()
    run_block(mixed)  # Frequent: Core ML expects the shape to change; nothing to count
    assert shape_switches() == before


def test_every_value_crossing_into_core_ml_is_one_the_bridge_accepts(coreml_standin,
                                                                    shard) -> None:
    """The audit of issue 18: whatever the pipeline hands CoreMLProgram (float16 or float64,
    read-only, reversed, broadcast views), what reaches the bridge is a writable float16 array
    for predict (coremltools then upcasts it to float32) and a fresh float32 C-contiguous
    whole-state copy for write_state; an unknown state name is our error, not Core ML's."""
    from ane_spec.errors import AneSpecError

    from ane_spec.runtime.coreml_backend import CoreMLBackend

    path, sha = shard
    program = CoreMLBackend().load(path, digest=sha)  # what runs in the worker process
    state = program.make_state()
    hostile = {}
    for name, value in feed().items():
        v = np.flip(value.astype(np.float64), axis=-1).copy()  # float64, then a reversed view
        v = np.flip(v, axis=-1)
        v.flags.writeable = False
        hostile[name] = v
    assert any(s < 0 for s in hostile["attn_mask"].strides)
    with pytest.raises(RuntimeError):  # straight to the bridge, this is refused
        program.model.predict(dict(hostile), state)
    np.testing.assert_array_equal(program.predict(hostile, state)["hidden"],
                                  CoreMLBackend().load(path, digest=sha).predict(
                                      feed(), program.make_state())["hidden"])
    # Every write lands (read back, value for value): the state held K/V from the passes above,
    # so a write_state that did nothing would leave them there and fail here.
    assert np.any(program.read_state(state, "layer_0_k") != 0)
    zeros = np.broadcast_to(np.float16(0), (1, 2, 64, 32))  # read-only, zero strides
    program.write_state(state, "layer_0_k", zeros)
    np.testing.assert_array_equal(program.read_state(state, "layer_0_k"), 0)
    v = program.read_state(state, "layer_0_v")
    assert not np.array_equal(np.flip(v, 2), v)
    program.write_state(state, "layer_0_v", np.flip(v, 2))
    np.testing.assert_array_equal(program.read_state(state, "layer_0_v"), np.flip(v, 2))
    with pytest.raises(AneSpecError, match="no state 'layer_7_k'"):
        program.write_state(state, "layer_7_k", zeros)
    assert coreml_standin.lifetime_violations == []  # every array it gave stayed alive


# --- multifunction packages (issue 33) ----------------------------------------------------------

def test_function_name_picks_the_function_and_an_unknown_one_fails_the_load(
        coreml_standin, shard, coreml_build, monkeypatch) -> None:
    """A layer package holds `main` (T 1..4) and `prefill` (T = 64): CompiledMLModel's
    function_name picks one (none: the default, main); a name the package lacks fails the load
    with a RuntimeError, as coremltools 9.0's own test expects of Core ML (test_load.py,
    test_multi_functions_backward_compatibility); a one-function package answers only to main;
    before macOS 15 the bridge refuses the property itself."""
    out, m = coreml_build
    default, main, prefill = (compiled_model(shard[0], **kw) for kw in (
        {}, {"function_name": "main"}, {"function_name": "prefill"}))
    assert m.build.prefill_t == 64
    kept = []  # what Core ML was given outlives its hold (the lifetime rule)
    for model, good, bad in ((default, 4, 64), (main, 4, 64), (prefill, 64, 4)):
        state = model.make_state()
        kept += [{k: v.astype(np.float32) for k, v in feed(t).items()} for t in (good, bad)]
        assert model.predict(kept[-2], state)["hidden"].shape == (1, 192, good, 1)
        with pytest.raises(RuntimeError, match="does not match the shape"):
            model.predict(kept[-1], state)
    with pytest.raises(RuntimeError, match=r"no function named 'decode' \(the model has main, "
                       "prefill\\)"):
        compiled_model(shard[0], function_name="decode")
    head = out / m.heads[0].file.path
    kept.append(np.ones((1, 192, 4, 1), np.float32))
    assert "logits_0" in compiled_model(head, function_name="main").predict({"x": kept[-1]})
    with pytest.raises(RuntimeError, match="no function named 'prefill' \\(the model has main\\)"):
        compiled_model(head, function_name="prefill")
    coreml_standin.install(monkeypatch, macos=(14, 6))
    with pytest.raises(RuntimeError, match="'functionName' property can only be set on macOS "
                       ">= 15.0"):
        compiled_model(shard[0], function_name="prefill")


def test_one_state_serves_both_functions_of_a_package(coreml_standin, shard) -> None:
    """A state made by either function's model is accepted by the other's predict (the two
    declare the same states), and the values are the fp16 interpreter's, on the same shared
    state, pass for pass: a prompt chunk through `prefill`, then a decode pass through `main`,
    and the other way round."""
    path, sha = shard
    from ane_spec.runtime.coreml_backend import CoreMLBackend

    backend, mil = CoreMLBackend(), MILBackend("fp16")
    coreml = {f: backend.load(path, digest=sha, function=f) for f in ("main", "prefill")}
    interp = {f: mil.load(path, function=f) for f in ("main", "prefill")}
    for maker, steps in (("main", [("prefill", 64, 0), ("main", 4, 3)]),
                         ("prefill", [("main", 4, 0), ("prefill", 64, 0), ("main", 4, 8)])):
        states = coreml[maker].make_state(), interp[maker].make_state()
        for function, t, pos in steps:
            inputs = feed(t, pos, seed=t + pos)
            got = coreml[function].predict(inputs, states[0])["hidden"]
            want = interp[function].predict(inputs, states[1])["hidden"]
            np.testing.assert_array_equal(got, want.astype(np.float32))
        for name in coreml["main"].state_names:
            np.testing.assert_array_equal(coreml["prefill"].read_state(states[0], name),
                                          interp["main"].read_state(states[1], name))
    assert coreml_standin.lifetime_violations == []


def state_package(path: Path, *, name: str = "cache", rows: int = 8,
                  state_type: str | None = None) -> Path:
    """A one-op stateful program (x + the state, written back); `state_type` rewrites the type
    its description declares for the state (coremltools only builds fp16 states)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types
    from coremltools.proto import FeatureTypes_pb2, Model_pb2

    shape = (1, 2, rows, 32)
    specs = {"x": mb.TensorSpec(shape, dtype=types.fp16),
             name: mb.StateTensorSpec(shape, dtype=types.fp16)}

    @mb.program(input_specs=list(specs.values()), opset_version=ct.target.iOS18)
    def prog(x, state):
        y = mb.add(x=mb.read_state(input=state), y=x)
        mb.coreml_update_state(state=state, value=y)
        return mb.mul(x=y, y=np.float16(1), name="out")

    prog.functions["main"].inputs[name] = prog.functions["main"].inputs.pop("state")
    prog.functions["main"].inputs[name].name = name
    ct.convert(prog, minimum_deployment_target=ct.target.iOS18, convert_to="mlprogram",
               compute_precision=ct.precision.FLOAT32, skip_model_load=True).save(str(path))
    if state_type is not None:
        model_file = path / "Data" / "com.apple.CoreML" / "model.mlmodel"
        spec = Model_pb2.Model.FromString(model_file.read_bytes())
        spec.description.state[0].type.stateType.arrayType.dataType = (
            FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Value(state_type))
        model_file.write_bytes(spec.SerializeToString())
    return path


def test_a_state_is_refused_by_a_model_whose_states_differ(coreml_standin, tmp_path) -> None:
    """Another package's state is used where both declare the same states (Anemll's unified
    state across its chunks); a different name, shape or element type is refused."""
    base = compiled_model(state_package(tmp_path / "a.mlpackage"))
    twin = compiled_model(state_package(tmp_path / "b.mlpackage"))
    x = np.ones((1, 2, 8, 32), np.float32)
    kept = [x]  # what Core ML was given outlives its hold (the lifetime rule)
    state = base.make_state()
    base.predict({"x": x}, state)
    np.testing.assert_array_equal(twin.predict({"x": x}, state)["out"], 2 * x)  # shared
    for other, what in ((dict(name="kv"), "kv: \\[1, 2, 8, 32\\] FLOAT16"),
                        (dict(rows=16), "cache: \\[1, 2, 16, 32\\] FLOAT16"),
                        (dict(state_type="FLOAT32"), "cache: \\[1, 2, 8, 32\\] FLOAT32")):
        stranger = compiled_model(state_package(tmp_path / f"{len(what)}.mlpackage", **other))
        feed_other = {"x": np.ones((1, 2, other.get("rows", 8), 32), np.float32)}
        kept.append(feed_other)
        with pytest.raises(RuntimeError, match=f"do not match this model's \\{{{what}\\}}"):
            stranger.predict(feed_other, state)
        with pytest.raises(RuntimeError, match="do not match"):
            base.predict({"x": x}, stranger.make_state())
        stranger.predict(feed_other, stranger.make_state())  # its own state is fine
    assert coreml_standin.lifetime_violations == [] and kept
