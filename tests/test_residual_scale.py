"""Residual-stream scaling (issue 30 item 4): the fp16 program of a model whose residual stream
overflows fp16 follows the fp32 reference once the stream is scaled by a power of two folded into
the weights; on a model that does not overflow, the fold changes no bit of the logits."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from ane_spec.cli import main
from ane_spec.errors import BuildError
from ane_spec.manifests.residual_report import describe as describe_residual_scale
from ane_spec.manifests.schema import MANIFEST_NAME
from ane_spec.manifests.store import load_manifest
from ane_spec.model.activation_range import FP16_MAX, ActivationRanges, LayerRange
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.parity import cosine_rows, stored_weights
from ane_spec.runtime.fp16_argmax import NonFiniteLogits
from ane_spec.runtime.mil_backend import MILBackend
from ane_spec.runtime.pipeline import ShardPipeline, prefill_logits
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.residual_scale import scale_conv_weight, scale_fp16
from ane_spec.shards.scale_decision import SAFETY, choose_log2, parse_residual_scale
from ane_spec.shards.weights import convert_matrix
from tests.gguf_edit import rewrite_gguf

S = 64
TOKENS = [int(t) for t in np.random.default_rng(0).integers(0, 1024, 32)]


@pytest.fixture(scope="module")
def overflowing_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 tiny layers whose attn_output/ffn_down weights are 3e4 x the usual scale: the fp32
    residual stream peaks near 2e5, three times fp16's maximum, while the FFN intermediates stay
    near 10 (the fold does not scale those)."""
    spec = preset("tiny", num_layers=2, embed_std=1.0, branch_scale=3e4, seed=3)
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "overflow.gguf", spec)


def _fp16_logits(out: Path) -> np.ndarray:
    return prefill_logits(ShardPipeline(load_manifest(out), MILBackend("fp16")),
                          TOKENS).astype(np.float64)


def test_scaled_stream_follows_the_fp32_reference_where_unscaled_overflows(
        overflowing_gguf: Path, tmp_path: Path) -> None:
    unscaled = build(overflowing_gguf, tmp_path / "off",
                     BuildRequest(topology="2", max_seq=S, residual_scale="off")).manifest_path
    with warnings.catch_warnings(), pytest.raises(NonFiniteLogits):
        warnings.simplefilter("ignore", RuntimeWarning)  # the interpreter's fp16 overflow
        _fp16_logits(unscaled.parent)

    scaled = build(overflowing_gguf, tmp_path / "auto", BuildRequest(topology="2", max_seq=S))
    rs = load_manifest(scaled.manifest_path.parent).manifest.residual_scale
    cal = rs.calibration
    peak = max(x.residual for x in cal.layers)
    assert peak > 2 * FP16_MAX  # the fixture does overflow, by the fp32 reference's measure
    # auto takes the smallest k that leaves SAFETY x headroom: 2e5 * 8 / 65504 -> 2^-5.
    assert rs.log2_factor == -5 and cal.residual_margin == pytest.approx(
        FP16_MAX / (peak * 2.0 ** -5))
    assert SAFETY <= cal.residual_margin < 2 * SAFETY
    assert cal.ffn_margin > 1000  # not scaled by the fold, and not near fp16's limit here
    assert rs.stream_eps == pytest.approx(1e-5 * 2.0 ** -10)

    got = _fp16_logits(scaled.manifest_path.parent)
    # The reference holds the values the build stores (int8 per row, fp16 norms), so what is
    # left is fp16 activation rounding: cos measured ~0.999995; 0.9999 leaves 20x of room and
    # is still far from what an overflow (NaN, or a saturated stream) gives.
    ref = ReferenceModel(open_gguf(overflowing_gguf), context_window=S,
                         weight_transform=stored_weights("auto")).logits(TOKENS).astype(np.float64)
    cos = cosine_rows(got, ref)
    assert np.isfinite(got).all() and cos.min() > 0.9999, cos.min()
    # Argmax at every position where the reference's top-2 gap is over twice the row's error
    # (the parity gate's "decisive" rule), and nearly everywhere overall.
    top2 = np.sort(ref, axis=-1)[:, -2:]
    decisive = (top2[:, 1] - top2[:, 0]) > 2 * np.abs(got - ref).max(axis=-1)
    agree = got.argmax(-1) == ref.argmax(-1)
    assert decisive.sum() >= len(TOKENS) * 3 // 4 and agree[decisive].all()
    assert agree.mean() >= 0.9


@pytest.mark.parametrize("name,overrides", [
    ("tiny", {"embed_std": 1.0, "branch_scale": 1.0}),   # phi3: pre-norms, o_proj/down scaled
    ("gemma3-tiny", {"embed_std": 0.25}),                # post-norms carry the factor
])
def test_fold_changes_no_bit_of_the_fp16_logits(tmp_path: Path, name: str,
                                                overrides: dict) -> None:
    """Powers of two change no mantissa bit: with eps large enough that eps * s^2 stays a normal
    fp16 number (1e-2 here), builds at 2^-3, 2^0 and 2^2 give identical fp16 logits. A fold
    that missed one stream writer, the embedding or one norm's eps breaks the equality."""
    spec = preset(name, seed=7, rms_eps=1e-2, **overrides)
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", spec)
    logits = {}
    for setting in ("off", "2^-3", "2^2"):
        out = tmp_path / setting.replace("^", "")
        build(gguf, out, BuildRequest(topology=None if "gemma" in name else "2,1", max_seq=S,
                                      head_chunks=6 if "gemma" in name else 4,
                                      residual_scale=setting))
        m = load_manifest(out).manifest
        assert m.residual_scale.setting == setting
        assert (m.residual_scale.calibration is None) == (setting == "off")
        logits[setting] = prefill_logits(ShardPipeline(load_manifest(out), MILBackend("fp16")),
                                         [t % spec.vocab_size for t in TOKENS[:12]])
    assert np.array_equal(logits["off"], logits["2^-3"])
    assert np.array_equal(logits["off"], logits["2^2"])
    # The embeddings really are stored scaled: same int8 data, scales x2^-3.
    off = np.load(tmp_path / "off" / "embeddings" / "embed_scales.npy")
    down = np.load(tmp_path / "2-3" / "embeddings" / "embed_scales.npy")
    assert np.array_equal(off.astype(np.float32) / 8, down.astype(np.float32))


@pytest.mark.parametrize("fmt", ["int8-channel", "lut8", "q8-block", "fp16"])
def test_scaling_a_conv_weight_scales_its_stored_values_exactly(tiny_gguf: Path,
                                                                fmt: str) -> None:
    t = open_gguf(tiny_gguf).tensor("blk.0.ffn_down.weight")
    w = convert_matrix(t, fmt)
    scaled, count = scale_conv_weight(w, -3, t.name)
    assert np.array_equal(scaled.data, w.data) or fmt == "fp16"  # int data untouched
    assert count.values > 0 and count.inexact == 0
    assert np.array_equal(_dense(scaled), _dense(w) / 8)


def _inexact(values: np.ndarray, log2: int) -> int:
    """How many fp16 `values` x 2^log2 (log2 < 0) fp16 cannot hold, by the format's rule and
    not by rounding anything: a result that stays normal (>= 2^-14) keeps its 11 significant
    bits; a subnormal one must be a whole multiple of 2^-24."""
    x = np.abs(values.astype(np.float64)) * 2.0 ** log2  # exact in float64
    return int(np.count_nonzero((x < 2.0 ** -14) & (np.mod(x * 2.0 ** 24, 1.0) != 0)))


@pytest.mark.parametrize("log2", [-1, -3, -12])
def test_the_fold_counts_the_values_that_go_subnormal_and_lose_bits(log2: int) -> None:
    """Every finite fp16 value, folded by 2^log2: the count of inexact ones is the format's
    (subnormals whose low bits fall off, small normals that become such subnormals), and the
    exact ones are exactly value x 2^log2."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    every = every[np.isfinite(every)]
    out, count = scale_fp16(every, log2, "every fp16 value")
    want = _inexact(every, log2)
    assert count.values == every.size and count.inexact == want
    assert want > 1000  # 2^-1: the odd subnormals alone are 1022
    exact = out.astype(np.float64) == every.astype(np.float64) * 2.0 ** log2
    assert np.count_nonzero(~exact) == want
    # Values far from fp16's subnormals fold exactly, counted as such.
    assert scale_fp16(np.float16([1.0, -3.5, 0.0, 1e-3, 6e4]), -3, "w")[1].inexact == 0


def test_a_build_records_the_inexact_values_of_each_package(tiny_gguf: Path,
                                                             tmp_path: Path) -> None:
    """Rows of blk.0.ffn_down shrunk by 1e-4 have int8-channel scales near fp16's subnormal
    range, so a 2^-3 fold cannot scale them exactly: the manifest counts them, per package, as
    many as the format's rule finds in the stored scales; the untouched layers count none."""
    def shrink(name: str, data: np.ndarray, qtype: GGMLQuantizationType):  # noqa: ANN202
        if name != "blk.0.ffn_down.weight":
            return None
        values = gguf_quants.dequantize(data, qtype)
        values[::3] *= 1e-4
        return gguf_quants.quantize(values, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0

    gguf = rewrite_gguf(tiny_gguf, tmp_path / "small-rows.gguf", tensor_override=shrink)
    out = tmp_path / "art"
    build(gguf, out, BuildRequest(topology="1,2", max_seq=S, residual_scale="2^-3",
                                  weights="int8-channel"))
    recorded = load_manifest(out).manifest.residual_scale.inexact_values
    model = open_gguf(gguf)
    want = {}
    for rel, layers in (("shards/layers_00_01.mlpackage", [0]),
                        ("shards/layers_01_03.mlpackage", [1, 2])):
        want[rel] = sum(_inexact(convert_matrix(model.tensor(f"blk.{i}.{name}.weight"),
                                                "int8-channel").scale, -3)
                        for i in layers for name in ("attn_output", "ffn_down"))
    assert want["shards/layers_00_01.mlpackage"] > 20  # of the 64 shrunk rows' scales
    assert want["shards/layers_01_03.mlpackage"] == 0
    assert {k: v for k, v in recorded.items() if k.startswith("shards/")} == want
    assert "stored value(s) not scaled exactly (fp16 subnormals)" in "\n".join(
        describe_residual_scale(load_manifest(out).manifest.residual_scale))


def _dense(w) -> np.ndarray:
    if w.lut is not None:
        g = w.lut.shape[0]
        rows = w.data.reshape(g, -1)
        return np.take_along_axis(w.lut.reshape(g, -1).astype(np.float32),
                                  rows.astype(np.intp), axis=1).reshape(w.data.shape[:2])
    data = w.data[:, :, 0, 0].astype(np.float32)
    if w.scale is None:
        return data
    scale = w.scale[:, :, 0, 0].astype(np.float32)
    return data * np.repeat(scale, data.shape[1] // scale.shape[1], axis=1)


def test_scaling_up_past_fp16_is_refused(tiny_gguf: Path) -> None:
    w = convert_matrix(open_gguf(tiny_gguf).tensor("blk.0.ffn_down.weight"), "fp16")
    with pytest.raises(BuildError, match=r"beyond fp16's range"):
        scale_conv_weight(w, 20, "blk.0.ffn_down.weight")


def test_choose_and_parse() -> None:
    def ranges(peak: float) -> ActivationRanges:
        return ActivationRanges([LayerRange(residual=peak)], prompts=1, tokens=1, seconds=0.0)

    assert choose_log2(ranges(FP16_MAX / SAFETY)) == 0        # exactly the headroom: unscaled
    assert choose_log2(ranges(FP16_MAX / SAFETY * 1.01)) == -1
    assert choose_log2(ranges(2.6e4)) == -2                   # SmolLM2-135M's measured peak
    assert choose_log2(ranges(1.0)) == 0                      # never scaled up
    assert parse_residual_scale("2^(-3)") == "2^-3" and parse_residual_scale("off") == "off"
    for bad in ("2^-13", "0.5", "2^1.5", "on"):
        with pytest.raises(BuildError, match="--residual-scale"):
            parse_residual_scale(bad)


def test_reports_and_older_manifests(tiny_gguf: Path, tmp_path: Path, capsys) -> None:
    """`build` and `inspect` say the factor and margins; a manifest from before residual scaling
    (no record) still loads, and inspect says it was not measured."""
    out = tmp_path / "art"
    assert main(["build", str(tiny_gguf), "--out", str(out), "--topology", "3", "--max-seq",
                 str(S), "--residual-scale", "2^-1"]) == 0
    printed = capsys.readouterr().out
    assert "residual scale: 2^-1 (2^-1)" in printed and "FFN intermediate peak" in printed
    assert main(["inspect", str(out)]) == 0
    assert "residual scale: 2^-1" in capsys.readouterr().out

    path = out / MANIFEST_NAME
    data = json.loads(path.read_text())
    del data["residual_scale"]
    path.write_text(json.dumps(data))
    assert load_manifest(out, verify=False).manifest.residual_scale is None
    assert main(["inspect", str(out)]) == 0
    assert "residual scale: not recorded" in capsys.readouterr().out
    with pytest.raises(BuildError, match="--residual-scale"):
        build(tiny_gguf, tmp_path / "bad", BuildRequest(topology="3", max_seq=S,
                                                        residual_scale="2^x"))


def test_margins_under_one_are_reported_as_problems() -> None:
    """What doctor fails on: the stream overflowing even scaled, or an FFN intermediate
    overflowing (which the fold cannot help)."""
    from ane_spec.manifests.residual_report import describe, margin_problems
    from ane_spec.manifests.schema import (
        ActivationCalibration,
        LayerActivations,
        ResidualScale,
    )

    def record(residual: float, ffn: float) -> ResidualScale:
        cal = ActivationCalibration(
            prompts=1, tokens=8, seconds=0.1, embedding=1.0,
            layers=[LayerActivations(residual=residual, ffn_up=ffn, ffn_down_in=1.0)],
            residual_margin=FP16_MAX / residual, ffn_margin=FP16_MAX / ffn)
        return ResidualScale(setting="2^0", log2_factor=0, stream_eps=1e-6, calibration=cal)

    assert margin_problems(record(100.0, 10.0)) == []
    stream, ffn = margin_problems(record(1e5, 7e4))
    assert "residual stream overflows" in stream and "FFN intermediates overflow" in ffn
    assert any("warning: FFN" in line for line in describe(record(10.0, 7e4)))


def test_layer_major_calibration_sees_what_forward_sees(tiny_gguf: Path) -> None:
    """The calibration runs all prompts one layer at a time (one layer's weights held); its
    maxima are those of the ordinary prompt-by-prompt forward pass."""
    from ane_spec.model.activation_range import calibration_tokens, measure_activations

    model = open_gguf(tiny_gguf)
    ranges = measure_activations(model)
    seen: dict[tuple[str, int], float] = {}

    def observe(what: str, layer: int, x) -> None:
        seen[what, layer] = max(seen.get((what, layer), 0.0), float(x.abs().max()))

    ref = ReferenceModel(model, context_window=S, observer=observe)
    sequences = calibration_tokens(model)
    for tokens in sequences:
        ref.forward(tokens, ref.new_cache())
    assert ranges.prompts == len(sequences) >= 4 and ranges.embedding == seen["embedding", -1]
    for i, r in enumerate(ranges.layers):
        assert (r.residual, r.ffn_up, r.ffn_down_in) == pytest.approx(
            (seen["residual", i], seen["ffn_up", i], seen["ffn_down_in", i]), rel=1e-6)


def test_a_calibration_in_two_parts_sees_what_one_run_sees(tiny_gguf: Path) -> None:
    """The early-stopping calibration runs the first HEAD_TOKENS of every prompt, then (if the
    decision is open) the rest from the first part's caches: every token once, at its own
    position. Its maxima are those of the one-part run; it stops early only when told."""
    from ane_spec.model.activation_range import HEAD_TOKENS, measure_activations

    model = open_gguf(tiny_gguf)
    whole = measure_activations(model)
    asked: list[int] = []
    parts = measure_activations(model, settled=lambda first: asked.append(first.tokens) or False)
    assert asked == [5 * HEAD_TOKENS] and parts.tokens == whole.tokens > asked[0]
    assert parts.embedding == whole.embedding
    for a, b in zip(parts.layers, whole.layers):
        assert (a.residual, a.ffn_up, a.ffn_down_in) == pytest.approx(
            (b.residual, b.ffn_up, b.ffn_down_in), rel=1e-6)
    first = measure_activations(model, settled=lambda first: True)
    assert first.tokens == asked[0] and all(
        f.residual <= w.residual * (1 + 1e-6) for f, w in zip(first.layers, whole.layers))


def test_a_decision_open_for_good_ends_the_first_part_at_that_layer(
        tiny_gguf: Path) -> None:
    """Once the first part's maxima refuse the stop whatever comes (`open_for_good`), it ends
    after that layer and every token runs from the start in one pass: the one-part run's
    record, to the bit, for one more pass over the first layers only."""
    from ane_spec.model.activation_range import measure_activations

    model = open_gguf(tiny_gguf)
    whole = measure_activations(model)
    for at_layer in (0, 1):
        said: list[str] = []
        asked: list[int] = []

        def hopeless(part, at_layer=at_layer) -> bool:
            asked.append(part.tokens)
            return part.layers[at_layer].residual > 0

        early = measure_activations(model, progress=said.append, settled=lambda f: False,
                                    open_for_good=hopeless)
        assert any(f"leave the decision open by layer {at_layer + 1};" in m for m in said)
        assert early.tokens == whole.tokens and early.embedding == whole.embedding
        assert [vars(r) for r in early.layers] == [vars(r) for r in whole.layers]
        assert set(asked) == {5 * 8}   # asked only of the first part


def test_the_build_calibration_stops_its_first_part_where_the_stop_is_refused(
        tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scale_decision.calibrate hands `measure_activations` the stop's own rule, negated: a
    bound no peak can meet ends the first part at the first layer."""
    from ane_spec.model.activation_range import measure_activations
    from ane_spec.shards import scale_decision

    model = open_gguf(tiny_gguf)
    monkeypatch.setattr(scale_decision, "SETTLED_HEADROOM", 1e12)
    said: list[str] = []
    ranges = scale_decision.calibrate(model, "auto", said.append)
    assert any("leave the decision open by layer 1;" in m for m in said)
    assert [vars(r) for r in ranges.layers] == [vars(r) for r in measure_activations(model).layers]


def test_the_calibration_stops_early_only_far_from_the_bound() -> None:
    from ane_spec.model.activation_range import ActivationRanges, LayerRange
    from ane_spec.shards.scale_decision import SAFETY, SETTLED_HEADROOM, settled

    def ranges(residual: float, ffn: float) -> ActivationRanges:
        return ActivationRanges([LayerRange(residual, ffn, 1.0)], prompts=5, tokens=40,
                                seconds=1.0)

    edge = FP16_MAX / (SAFETY * SETTLED_HEADROOM)
    assert settled("auto", ranges(edge * 0.99, 1.0)) and settled("off", ranges(1.0, 1.0))
    assert not settled("auto", ranges(edge * 1.01, 1.0))          # the stream, near the bound
    assert not settled("auto", ranges(1.0, edge * 1.01))          # the FFN, near the bound
    assert not settled("auto", ranges(1e5, 1.0))                  # k < 0: measure everything
    assert settled("2^-2", ranges(edge * 3, 1.0))                 # the margin as scaled
    assert not settled("2^2", ranges(edge * 0.5, 1.0))
