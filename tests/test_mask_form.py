"""`--mask-form additive` (issue 28 item 6): a layer graph of clip and an added mask only. It must
hold none of select/equal/greater_equal, agree bitwise with the select form wherever rows and
scores are finite and in range, and lose exactly what layer_graph's docstring says it loses,
which the overflow probe reports as its known exposure instead of failing."""

from __future__ import annotations

import warnings
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import types

from ane_spec.cli import main
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.manifests.inspect_build import describe_build, format_build
from ane_spec.manifests.store import load_manifest
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.runtime.host_inputs import MASK_VALUE
from ane_spec.runtime.mil_interpreter import MILInterpreter
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.layer_graph import HIDDEN_SCORE, GraphVariant, hide_slots, stable_softmax
from ane_spec.shards.static_checks import read_package_facts

S = 64
PEER_UNPROVEN = {"select", "equal", "greater_equal"}


@pytest.fixture(scope="module")
def builds(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mask-form")
    build(tiny_gguf, root / "select", BuildRequest(topology="2,1", max_seq=S))
    # The additive build through the command line: --mask-form reaches the request.
    assert main(["build", str(tiny_gguf), "--out", str(root / "additive"), "--topology", "2,1",
                 "--max-seq", str(S), "--mask-form", "additive"]) == 0
    return {"select": root / "select", "additive": root / "additive"}


def test_the_host_feeds_the_value_the_additive_form_adds() -> None:
    """One feed for both forms: the additive form's margin argument is made for HIDDEN_SCORE."""
    assert np.float16(MASK_VALUE) == HIDDEN_SCORE == MASK_VALUE


def test_additive_programs_hold_no_select_equal_or_greater_equal(builds: dict) -> None:
    for form, folder in builds.items():
        loaded = load_manifest(folder)
        assert loaded.manifest.build.mask_form == form
        assert f"mask form {form}" in format_build(describe_build(folder))  # `inspect FOLDER`
        for shard in loaded.manifest.shards:
            ops = read_package_facts(loaded.path(shard.file)).ops
            layers = shard.layers[1] - shard.layers[0]
            assert ops["clip"] == 2 * layers  # K and V rows, in both forms
            if form == "additive":
                assert not PEER_UNPROVEN & set(ops), ops
            else:  # equal + select per K/V write, a select per layer, one greater_equal
                assert ops["equal"] == 2 * layers and ops["select"] == 3 * layers
                assert ops["greater_equal"] == 1


def test_a_variant_may_not_contradict_the_request(tiny_gguf: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="contradicts"):
        build(tiny_gguf, tmp_path / "x", BuildRequest(topology="3", max_seq=S),
              variant=GraphVariant(mask_form="additive"))


def _prompts(n: int, vocab: int, seed: int = 5, longest: int = S - 4) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(3, longest))).tolist() for _ in range(n)]


def _assert_prefills_agree(pipes: dict, prompt: list[int]) -> int:
    """Prefill `prompt` 4 rows a pass in both forms: every row's logits finite and the same
    bits. Returns the rows compared."""
    states = {form: p.new_state() for form, p in pipes.items()}
    rows = 0
    for start in range(0, len(prompt), 4):
        chunk = prompt[start:start + 4]
        out = {form: p.run(chunk, start, states[form]) for form, p in pipes.items()}
        for r in range(len(chunk)):
            a, b = out["select"].row_native(r), out["additive"].row_native(r)
            assert np.isfinite(a).all() and np.array_equal(a, b), (prompt, start, r)
            rows += 1
    return rows


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_the_forms_agree_bitwise_on_ordinary_prompts(builds: dict, precision: str) -> None:
    """Every row's logits of every prefill pass, the same bits in both forms; then greedy and
    speculative decoding give the same tokens. No score of these prompts is near 16368."""
    pipes = {form: open_pipeline(folder, "mil", precision)[1] for form, folder in builds.items()}
    rows = sum(_assert_prefills_agree(pipes, prompt)
               for prompt in _prompts(6, pipes["select"].config.vocab_size))
    assert rows > 60
    distinct = []
    for prompt in _prompts(4, pipes["select"].config.vocab_size, seed=9, longest=10):
        for speculative in (False, True):
            options = GenerateOptions(max_tokens=32, speculative=speculative)
            tokens = {form: DecodeSession(p).generate(prompt, options).tokens
                      for form, p in pipes.items()}
            assert tokens["select"] == tokens["additive"], (prompt, speculative)
            distinct.append(len(set(tokens["select"])))
    assert max(distinct) >= 6  # varied output, not one repeated token


def test_the_overflow_probe_reports_the_additive_exposure(builds: dict) -> None:
    """Both losses show: overflowing rows poison the cache (padding, filler, rejected draft) and
    hidden slots holding FP16_MAX K win. They are the form's known exposure, named in the verdict,
    not failures; in fp32 the 7e4 rows are ordinary and must still change nothing."""
    for precision in ("fp16", "fp32"):
        _, pipeline = open_pipeline(builds["additive"], "mil", precision)
        report = run_overflow(pipeline)
        assert report.passed, report.details["failures"][:3]
        f = report.figures
        assert f["mask_form"] == "additive" and f["cases_outside_known_exposure"] == 0
        assert f["verdict"].startswith("additive mask form on MIL interpreter")
        assert "KNOWN EXPOSURE" in f["verdict"]
        leaked = {c["case"] for c in report.details["cases"]
                  if not (c["identical"] and c["finite"])}
        assert leaked == {"padding", "filler", "rejected-draft", "hidden-slot",
                          "prefill-padding"}, precision
        assert f["exposed_cases"] >= 20 and "--mask-form select" in f["verdict"]
        for c in report.details["cases"]:
            if c["poison"] == "7e4" and precision == "fp32":
                assert not c["known_exposure"] and c["identical"] and c["finite"], c
        # The same probe holds the select build to every case.
        _, exact = open_pipeline(builds["select"], "mil", precision)
        strict = run_overflow(exact)
        assert strict.passed and strict.figures["exposed_cases"] == 0
        assert strict.figures["verdict"].startswith("finite-safe")


def _mask_then_softmax(additive: bool, precision: str, scores: np.ndarray,
                       mask: np.ndarray) -> np.ndarray:
    @mb.program(input_specs=[mb.TensorSpec((1, 1, 4, S), dtype=types.fp16) for _ in "sm"],
                opset_version=ct.target.iOS18)
    def prog(s, m):
        if additive:
            return stable_softmax(mb.add(x=s, y=m))
        return stable_softmax(hide_slots(s, mb.greater_equal(x=m, y=np.float16(0.0))))

    interp = MILInterpreter.from_program(prog, precision=precision)
    feed = {"s": scores.reshape(1, 1, 4, S).astype(np.float16),
            "m": mask.reshape(1, 1, 4, S).astype(np.float16)}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # any fp16 overflow fails the test
        return next(iter(interp.predict(feed).values()))[0, 0]


def test_the_margin_of_the_added_mask_in_fp16() -> None:
    """The docstring's arithmetic: with |score| < 16368 everywhere (here +-16000, the extremes
    of that range in both visible and hidden slots) the added mask gives exactly the select
    form's bits, with no fp16 overflow on the way; a hidden score ~32750 above the row's
    visible maximum (32800) gets weight in the additive form only."""
    rng = np.random.default_rng(3)
    scores = rng.uniform(-20, 20, (4, S)).astype(np.float32)
    mask = np.zeros((4, S), np.float32)
    mask[:, 10:] = MASK_VALUE
    scores[0, :10] = np.linspace(-16000, -15990, 10)   # visible at the low end...
    scores[0, 10:] = 16000                              # ...hidden at the high end
    scores[1, :10], scores[1, 10:] = 16000, -16000      # and the other way round
    for precision in ("fp16", "fp32"):
        sel = _mask_then_softmax(False, precision, scores, mask)
        add = _mask_then_softmax(True, precision, scores, mask)
        assert np.array_equal(sel, add) and (add[:, 10:] == 0).all(), precision
    beaten = scores.copy()
    beaten[2, :10], beaten[2, 12] = -16000, 16800  # 32800 above the row's visible maximum
    add = _mask_then_softmax(True, "fp16", beaten, mask)
    assert add[2, 12] > 0.5 and _mask_then_softmax(False, "fp16", beaten, mask)[2, 12] == 0


def test_a_gemma3_ring_build_agrees_bitwise_in_both_forms(tmp_path: Path) -> None:
    """The sliding-window layers' own mask and ring inputs take the form too: an additive gemma3
    build (local rings of 32 slots, window 8) holds no select/equal/greater_equal and gives the
    select build's bits on prompts that wrap the ring."""
    from ane_spec.model.synthetic import preset, write_synthetic_gguf

    gguf = write_synthetic_gguf(tmp_path / "g.gguf", preset("gemma3-tiny", embed_std=0.25,
                                                            branch_scale=1.0, seed=3))
    pipes = {}
    for form in ("select", "additive"):
        # A 24-row prefill function keeps the rings at W + 24 = 32 slots (the default 64 would
        # make them 96, longer than the context: no ring).
        build(gguf, tmp_path / form, BuildRequest(topology="2,2", max_seq=S, mask_form=form,
                                                  prefill_t=24))
        loaded = load_manifest(tmp_path / form)
        assert loaded.manifest.build.swa_ring > 0
        for shard in loaded.manifest.shards:
            ops = set(read_package_facts(loaded.path(shard.file)).ops)
            assert (PEER_UNPROVEN & ops) == (set() if form == "additive" else PEER_UNPROVEN)
        pipes[form] = open_pipeline(tmp_path / form, "mil", "fp16")[1]
    rng = np.random.default_rng(7)
    for prompt in (rng.integers(0, pipes["select"].config.vocab_size, n).tolist()
                   for n in (45, S - 4)):  # past the 32-slot ring: it wraps
        _assert_prefills_agree(pipes, prompt)
