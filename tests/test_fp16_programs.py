"""fp16-only programs: the build refuses an fp32 value, the fp16 interpreter rounds the attention
softmax where the program does, the mask cannot make that softmax produce inf or NaN, and the K/V
rows the scatter writes are finite whatever a row computed."""

from __future__ import annotations

import warnings
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from ane_spec.errors import BuildError
from ane_spec.model.rope import make_rope_spec
from ane_spec.runtime.host_inputs import MASK_VALUE, HostInputs
from ane_spec.runtime.mil_interpreter import MILInterpreter
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.layer_graph import GraphVariant, finite_rows, hide_slots, stable_softmax
from ane_spec.shards.programs import save_package
from ane_spec.shards.static_checks import LAYER_OPS, dtype_problems, read_package_facts

S = 64
IOS18 = ct.target.iOS18


def test_a_planted_fp32_softmax_fails_the_build(tiny_gguf: Path, tmp_path: Path) -> None:
    """The island this compiler once shipped (cast to fp32, softmax, cast back), built by the real
    builder and saved by the real save path, is refused, and nothing is left behind."""
    out = tmp_path / "art"
    with pytest.raises(BuildError, match=r"op output\(s\) typed fp32.*Neural Engine"):
        build(tiny_gguf, out, BuildRequest(topology="3", max_seq=S),
              variant=GraphVariant(fp32_softmax=True))
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_dtype_check_names_every_fp32_value(tmp_path: Path) -> None:
    """A program whose only defect is one fp32 value: the dtype check alone catches it."""
    @mb.program(input_specs=[mb.TensorSpec((1, 8, 4), dtype=types.fp16)], opset_version=IOS18)
    def prog(x):
        wide = mb.cast(x=x, dtype="fp32", name="widened")
        return mb.cast(x=mb.mul(x=wide, y=np.float32(2.0), name="in_fp32"), dtype="fp16",
                       name="out")

    path = tmp_path / "p.mlpackage"
    save_package(prog, path)
    facts = read_package_facts(path)
    assert facts.output_dtypes["widened"] == facts.output_dtypes["in_fp32"] == "fp32"
    problems = dtype_problems(facts)
    assert len(problems) == 1 and problems[0].startswith("3 op output(s) typed fp32")

    @mb.program(input_specs=[mb.TensorSpec((1, 8, 4), dtype=types.fp16)], opset_version=IOS18)
    def clean(x):
        return mb.mul(x=x, y=np.float16(2.0), name="out")

    save_package(clean, tmp_path / "clean.mlpackage")
    assert dtype_problems(read_package_facts(tmp_path / "clean.mlpackage")) == []


def _softmax_program(shape: tuple[int, ...]):
    @mb.program(input_specs=[mb.TensorSpec(shape, dtype=types.fp16)], opset_version=IOS18)
    def prog(scores):
        return stable_softmax(scores)

    return prog


def _fp16_each_op(scores: np.ndarray) -> np.ndarray:
    """The softmax an fp16 device computes when each of the five ops rounds its result to fp16
    (each op itself evaluated in float32, as the interpreter does)."""
    f16, f32 = np.float16, np.float32
    peak = scores.max(axis=-1, keepdims=True)
    shifted = (scores.astype(f32) - peak.astype(f32)).astype(f16)
    terms = np.exp(shifted.astype(f32)).astype(f16)
    total = terms.astype(f32).sum(axis=-1, keepdims=True).astype(f16)
    return (terms.astype(f32) / total.astype(f32)).astype(f16)


def test_fp16_interpreter_rounds_after_each_softmax_op(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    scores = (rng.standard_normal((1, 4, 4, S)) * 3).astype(np.float16)
    scores[..., 40:] = np.float16(MASK_VALUE)  # slots beyond the rows' positions
    path = tmp_path / "softmax.mlpackage"
    save_package(_softmax_program(scores.shape), path)
    assert set(read_package_facts(path).ops) - {"const"} == {
        "reduce_max", "sub", "exp", "reduce_sum", "real_div"}

    got = MILInterpreter.from_package(path, precision="fp16").predict({"scores": scores})
    probs = next(iter(got.values()))
    assert probs.dtype == np.float16
    np.testing.assert_array_equal(probs, _fp16_each_op(scores))
    # The test can tell: one rounding at the end (a fused fp32 softmax) gives other bits.
    s64 = scores.astype(np.float64)
    e = np.exp(s64 - s64.max(axis=-1, keepdims=True))
    fused = (e / e.sum(axis=-1, keepdims=True)).astype(np.float16)
    assert (fused != probs).sum() > 50
    # fp32 mode computes the plain math.
    ideal = MILInterpreter.from_package(path, precision="fp32").predict({"scores": scores})
    np.testing.assert_allclose(next(iter(ideal.values())), e / e.sum(-1, keepdims=True),
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_masked_softmax_stays_finite(precision: str) -> None:
    """Scores as large as fp16 allows, plus the mask value, including a row with every slot masked
    (the host never sends one: see the next test). No inf, no NaN; masked slots get exactly 0."""
    f16max = float(np.finfo(np.float16).max)
    rows = np.zeros((4, S), np.float32)
    rows[0] = np.linspace(-30000, 30000, S)            # huge spread, nothing masked
    rows[1, :10] = 50.0                                 # ten visible slots ...
    rows[1, 10:] = MASK_VALUE                           # ... the rest masked
    rows[2] = MASK_VALUE                                # every slot masked
    rows[3, :3] = [f16max / 2, -f16max / 2, 0.0]        # extremes next to the mask
    rows[3, 3:] = MASK_VALUE + 100.0
    scores = rows.astype(np.float16).reshape(1, 1, 4, S)
    assert np.isfinite(scores).all()
    interp = MILInterpreter.from_program(_softmax_program(scores.shape), precision=precision)
    with np.errstate(all="raise"):
        probs = next(iter(interp.predict({"scores": scores}).values())).astype(np.float64)[0, 0]
    assert np.isfinite(probs).all()
    np.testing.assert_allclose(probs.sum(axis=-1), 1.0, atol=2e-3)  # fp16 rounding of S terms
    assert (probs[1, 10:] == 0).all() and (probs[3, 3:] == 0).all()
    assert probs[0, -1] == 1.0 and probs[3, 0] == 1.0
    np.testing.assert_allclose(probs[2], 1 / S, rtol=1e-3)  # uniform, not NaN


@pytest.mark.parametrize("max_seq", [32, 64])
def test_host_masks_never_hide_every_slot_of_a_row(max_seq: int) -> None:
    """Each row, real or padding, sees at least its own position's slot, so no attention row is
    fully masked: the softmax's largest term is a real score, not the mask value."""
    rope = make_rope_spec(rope_dims=12, freq_base=10000.0, attn_factor=1.0,
                          original_context_length=4096, context_window=max_seq,
                          short_factors=np.ones(6), long_factors=np.ones(6))
    host = HostInputs(rope, max_seq)
    for position in range(max_seq):
        for t in range(1, min(4, max_seq - position) + 1):
            for width in range(t, 5):
                mask = host.block(position, t, width)["attn_mask"][0, 0]
                assert (mask == 0).any(axis=-1).all(), (position, t, width)
                assert set(np.unique(mask).tolist()) <= {0.0, float(np.float16(MASK_VALUE))}


ALL_HALVES = np.arange(65536, dtype=np.uint16).view(np.float16)


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_finite_rows_saturates_inf_and_zeroes_nan(tmp_path: Path, precision: str) -> None:
    """Every one of the 65,536 half bit patterns through the saved K/V cleaning ops: finite values
    keep their bits (-0 included), +-inf become +-65504, every NaN (either sign, any payload) 0.
    In fp32 mode a value past fp16's range saturates too, so both precisions write the same."""
    shape = (1, 4, 128, 128)

    @mb.program(input_specs=[mb.TensorSpec(shape, dtype=types.fp16)], opset_version=IOS18)
    def prog(rows):
        return finite_rows(rows, "clean")

    path = tmp_path / "finite.mlpackage"
    save_package(prog, path)
    ops = set(read_package_facts(path).ops)
    assert ops - {"const"} == {"clip", "equal", "select"} and ops <= LAYER_OPS
    rows = ALL_HALVES.reshape(shape)
    if precision == "fp32":
        rows = rows.astype(np.float32)
        rows[0, 0, 0, :4] = [7e4, -7e4, 3e38, -3e38]
    got = MILInterpreter.from_package(path, precision=precision).predict({"rows": rows})["clean"]
    f16max = float(np.finfo(np.float16).max)
    expected = np.where(np.isnan(rows), 0, np.clip(rows, -f16max, f16max)).astype(got.dtype)
    assert np.isfinite(got).all() and got.dtype == (np.float16 if precision == "fp16"
                                                    else np.float32)
    # Bit for bit: the sign of zero too.
    bits = np.uint16 if precision == "fp16" else np.uint32
    assert np.array_equal(got.view(bits), expected.view(bits))


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_hidden_slots_get_zero_weight_whatever_they_score(precision: str) -> None:
    """The layers' mask then softmax, as the program runs them: hidden slots scoring inf, NaN or
    the largest finite value get exactly 0 weight; visible scores as large as 30,000 or as low
    as -32,000 decide alone; and no op overflows fp16 on the way (a hidden score of -65504 made
    `score - max` overflow as soon as a row's maximum passed 16)."""
    f16max = float(np.finfo(np.float16).max)
    scores = np.zeros((4, S), np.float32)
    mask = np.full((4, S), MASK_VALUE, np.float32)
    mask[:, :8] = 0.0                                     # eight visible slots per row
    scores[0, :8] = np.linspace(-30000, 30000, 8)
    scores[1, :8] = np.linspace(-32000, -31990, 8)
    scores[2, :8] = np.arange(8)
    scores[:, 8::3], scores[:, 9::3], scores[:, 10::3] = np.inf, np.nan, f16max  # hidden slots
    scores[3] = -np.inf                                  # a row whose visible scores are -inf too
    scores[3, 8:] = f16max

    @mb.program(input_specs=[mb.TensorSpec((1, 1, 4, S), dtype=types.fp16) for _ in "sm"],
                opset_version=IOS18)
    def prog(s, m):
        return stable_softmax(hide_slots(s, mb.greater_equal(x=m, y=np.float16(0.0))))

    interp = MILInterpreter.from_program(prog, precision=precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the interpreter warns on fp16 overflow
        probs = next(iter(interp.predict({"s": scores.reshape(1, 1, 4, S).astype(np.float16),
                                          "m": mask.reshape(1, 1, 4, S).astype(np.float16)}
                                         ).values()))[0, 0].astype(np.float64)
    assert (probs[:3, 8:] == 0).all()
    assert probs[0, 7] == 1.0 and np.isfinite(probs[:3]).all()
    visible = scores[1:3, :8].astype(np.float16).astype(np.float64)  # what the program gets
    ideal = np.exp(visible - visible.max(-1, keepdims=True))
    np.testing.assert_allclose(probs[1:3, :8], ideal / ideal.sum(-1, keepdims=True), atol=2e-3)
    # The documented limit: a row whose every visible score is below HIDDEN_SCORE + 17 (here
    # -inf, a row whose own arithmetic broke) gives the hidden slots weight; it stays finite.
    assert np.isfinite(probs[3]).all() and (probs[3, :8] == 0).all()


def rms_program(eps: np.float16):
    @mb.program(input_specs=[mb.TensorSpec((1, 64, 2, 1), dtype=types.fp16)],
                opset_version=ct.target.iOS18)
    def prog(x):
        return mb.layer_norm(x=x, axes=[1], epsilon=eps, name="y")
    return prog


def test_subnormal_rms_eps_in_the_fp16_interpreter() -> None:
    """Defect 6: rms_eps 1e-5 is subnormal in fp16. The fp16 interpreter keeps it (1.0014e-5),
    so an all-zero row normalises to 0; flushed to zero, as the ANE may do, the same row is
    NaN. Rows with real content barely notice."""
    eps = np.float16(1e-5)
    assert 0 < eps < np.finfo(np.float16).smallest_normal
    x = np.zeros((1, 64, 2, 1), np.float16)
    x[0, :, 1, 0] = np.random.default_rng(0).standard_normal(64)  # row 1 real, row 0 zero
    kept = MILInterpreter.from_program(rms_program(eps), "fp16").predict({"x": x})["y"]
    flushed = MILInterpreter.from_program(rms_program(np.float16(0)), "fp16").predict({"x": x})["y"]
    assert not kept[0, :, 0].any() and np.isfinite(kept).all()
    assert np.isnan(flushed[0, :, 0]).all()
    # A real row: mean(x^2) ~ 1 dwarfs 1e-5; the two differ by at most an fp16 rounding step.
    np.testing.assert_allclose(kept[0, :, 1], flushed[0, :, 1], rtol=1e-3)


def test_no_probe_feeds_an_all_zero_row(coreml_standin, coreml_build, monkeypatch) -> None:
    """Every row the probes and the doctor's first predictions send to a layer shard has
    content, so a flushed-to-zero eps can never turn one into NaN."""
    from ane_spec.probes.doctor import jit_rows
    from ane_spec.probes.gates import open_pipeline, run_gates

    zero_rows = []
    real = coreml_standin.StandinModel.predict

    def recording(self, data, state=None):
        if "kv_write_mask" in data:  # a layer shard
            norms = np.abs(data["x"]).reshape(data["x"].shape[1], -1).max(axis=0)
            zero_rows.extend(int(i) for i in np.flatnonzero(norms == 0))
        return real(self, data, state)

    monkeypatch.setattr(coreml_standin.StandinModel, "predict", recording)
    out, _ = coreml_build
    _, pipeline = open_pipeline(out, "coreml", "fp32")
    for width in (1, 4):
        pipeline.run_shards(jit_rows(pipeline, width), pipeline.host.block(0, width),
                            pipeline.new_state())
    run_gates(out, ("row-invariance", "overflow", "block", "drift"), backend="coreml", precision="fp32",
              save=False)
    assert zero_rows == []
