"""The fixed decode shape: every pass 4 rows wide, so speculative == greedy bitwise, fp16 included.

Builds use the varied tiny fixture (embed std 0.05, branches x4), whose greedy continuations vary,
so equality is not the trivial equality of a model that repeats one token.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.chat import render_chat
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.runtime.mil_backend import MILBackend
from ane_spec.runtime.pipeline import ShardPipeline
from ane_spec.shards.build import BuildRequest, build
from ane_spec.bench.scripted_drafter import ScriptedDrafter
from ane_spec.shards.layer_graph import GraphVariant

S = 64
BUILDS = {
    "BCT1-int8-channel": dict(layout="BCT1", weights="int8-channel", topology="2,1"),
    "BC1T-q8-block": dict(layout="BC1T", weights="q8-block", topology="1,2"),
    "BCT1-fp16": dict(layout="BCT1", weights="fp16", topology="3"),
    "BC1T-int8-channel-head-argmax": dict(layout="BC1T", weights="int8-channel", topology="2,1",
                                          head_argmax=True),
}


@pytest.fixture(scope="module")
def builds(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fixed-shape")
    out = {}
    for name, options in BUILDS.items():
        build(tiny_gguf, root / name, BuildRequest(max_seq=S, **options))
        out[name] = root / name
    return out


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 958, int(rng.integers(3, 40))).tolist() for _ in range(n)]


@pytest.mark.parametrize("name", list(BUILDS))
def test_row_invariance_on_every_build(builds: dict, name: str) -> None:
    for precision in ("fp32", "fp16"):
        _, pipeline = open_pipeline(builds[name], "mil", precision)
        report = run_row_invariance(pipeline)
        assert report.passed, report.figures["verdict"]
        assert report.figures["max_logit_diff"] == 0.0 and report.figures["max_state_diff"] == 0.0
        assert report.figures["cases"] == 3 and report.figures["deterministic"]
        # The builds' prefill function (P = S = 64): invariant at that shape, and across shapes.
        assert report.figures["prefill_t"] == S and report.figures["cross_shape_identical"]


@pytest.mark.parametrize("name", list(BUILDS))
def test_overflowing_rows_change_no_other_slot_on_every_build(builds: dict, name: str) -> None:
    """Padding, filler and rejected-draft rows whose activations are inf, NaN or 7e4, and hidden
    slots holding +-65504: every other row and slot bit-identical, every state value finite."""
    for precision in ("fp32", "fp16"):
        _, pipeline = open_pipeline(builds[name], "mil", precision)
        report = run_overflow(pipeline)
        assert report.passed, report.details["failures"][:3]
        assert report.figures["cases"] == 46 and report.figures["verdict"].startswith(
            "finite-safe on MIL interpreter")
        cases = {c["case"] for c in report.details["cases"]}
        assert cases == {"padding", "filler", "rejected-draft", "hidden-slot", "prefill-padding"}


OLD_GRAPHS = {
    # What each defect lets through: a scatter of uncleaned rows spreads NaN from any row into
    # every slot; an additive mask loses to a hidden slot holding large K.
    "uncleaned K/V write": (GraphVariant(unclean_kv_write=True),
                            {"padding", "filler", "rejected-draft", "prefill-padding"}),
    "additive mask": (GraphVariant(additive_mask=True), {"hidden-slot"}),
}


@pytest.mark.parametrize("defect", list(OLD_GRAPHS))
def test_the_overflow_probe_fails_the_old_write_and_mask(tiny_gguf: Path, tmp_path: Path,
                                                         defect: str) -> None:
    variant, leaking = OLD_GRAPHS[defect]
    build(tiny_gguf, tmp_path / "old", BuildRequest(topology="3", max_seq=32), variant=variant)
    for precision in ("fp32", "fp16"):
        _, pipeline = open_pipeline(tmp_path / "old", "mil", precision)
        report = run_overflow(pipeline)
        assert not report.passed
        assert report.figures["verdict"].startswith("OVERFLOW LEAKS on MIL interpreter")
        failing = {c["case"] for c in report.details["cases"]
                   if not (c["identical"] and c["finite"])}
        assert failing == leaking, (precision, failing)


@pytest.mark.parametrize("name", list(BUILDS))
def test_fp16_speculative_equals_greedy_on_every_build(builds: dict, name: str) -> None:
    """fp16 emulation rounds every op like an fp16 device; the fixed shape still agrees exactly,
    with the n-gram drafter and with drafts forced right (every token at rows 1..3 of full
    verify passes) or right only at row 1."""
    _, pipeline = open_pipeline(builds[name], "mil", "fp16")
    distinct, forced = [], 0
    for prompt in prompts(8, seed=len(name)):
        base = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=24,
                                                                        speculative=False))
        spec = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=24))
        assert spec.tokens == base.tokens, prompt
        assert spec.stats.guard_interventions == 0
        for correct in (3, 1):
            drafter = ScriptedDrafter(base.tokens, correct, pipeline.config.vocab_size)
            out = DecodeSession(pipeline, drafter=drafter).generate(
                prompt, GenerateOptions(max_tokens=24))
            assert out.tokens == base.tokens, (prompt, correct)
            forced += out.stats.accepted
        distinct.append(len(set(base.tokens)))
    assert np.median(distinct) >= 6 and forced > 8 * 20  # varied output, many accepted rows


def _blas_rounds_rows_alike() -> bool:
    """Whether this CPU's BLAS gives a row the same bits at every index of a 12-row product (the
    grouped-attention shape). OpenBLAS's Haswell/Zen kernels do not: rows 8..11 come from an edge
    kernel that rounds differently."""
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((16, 64)).astype(np.float32)
    row = rng.standard_normal(16).astype(np.float32)
    results = []
    for r in range(12):
        block = rng.standard_normal((12, 16)).astype(np.float32)
        block[r] = row
        results.append((block @ keys)[r])
    return all(np.array_equal(x, results[0]) for x in results)


@pytest.mark.skipif(_blas_rounds_rows_alike(), reason="this CPU's BLAS rounds every row of a "
                    "block alike, so the batched kernels are row-invariant here")
def test_a_backend_that_is_not_row_invariant_fails_the_probe(builds: dict) -> None:
    """The interpreter's one-BLAS-call-per-block kernels: OpenBLAS rounds some rows of a
    12-row attention matmul differently. A real backend, not a mock, and the probe says so."""
    loaded = load_manifest(builds["BCT1-int8-channel"])
    report = run_row_invariance(ShardPipeline(loaded, MILBackend("fp32", kernels="batched")))
    assert not report.passed and report.figures["deterministic"]
    assert report.figures["verdict"].startswith("ROW INVARIANCE BROKEN on MIL interpreter")
    assert report.figures["differing_plans"] > 0 and report.figures["max_logit_diff"] > 0


def test_probe_cli_json_ends_with_the_verdict(builds: dict, capsys) -> None:
    path = builds["BC1T-q8-block"]
    assert main(["probe", "row-invariance", "--manifest", str(path), "--backend", "mil",
                 "--precision", "fp16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gate"] == "row-invariance" and list(report.items())[-1] == ("passed", True)
    assert load_manifest(path).manifest.gates["row-invariance:mil-fp16"].passed


def test_padded_rows_write_nothing(builds: dict) -> None:
    """A padded row repeats the last real row's position. If its write-mask column were not zero
    it would write that slot a second time (the scatter sums: 2k, and keep = -1), and the next
    token, which reads the slot, would see a corrupted cache."""
    _, pipeline = open_pipeline(builds["BCT1-int8-channel"], "mil", "fp32")
    prompt, follow = [5, 6, 7, 8, 9], 77

    def next_logits(leaky: bool) -> np.ndarray:
        state = pipeline.new_state()
        pipeline.run(prompt[:4], 0, state)
        inputs = pipeline.host.block(4, 1, width=4)     # token 9 at slot 4, three padding rows
        if leaky:
            inputs["kv_write_mask"][0, 0, 4, 1:] = 1.0  # the padding writes slot 4 as well
        hidden = pipeline.to_hidden(pipeline.embeddings.lookup([prompt[4]] * 4))
        pipeline.run_shards(hidden, inputs, state)
        return pipeline.run([follow], len(prompt), state).logits[0]

    state = pipeline.new_state()
    pipeline.run(prompt[:4], 0, state)
    pipeline.run(prompt[4:], 4, state)                   # what ShardPipeline.run pads itself
    expected = pipeline.run([follow], len(prompt), state).logits[0]
    assert np.array_equal(next_logits(leaky=False), expected)
    assert not np.allclose(next_logits(leaky=True), expected, atol=1e-3)


def test_the_end_of_the_context(builds: dict) -> None:
    _, pipeline = open_pipeline(builds["BCT1-int8-channel"], "mil", "fp16")
    host = pipeline.host
    for t in (1, 2, 3):  # the last real rows at S-t..S-1; padding must stay in range
        inputs = host.block(S - t, t, width=4)
        last = S - 1
        assert np.array_equal(inputs["rope_cos"][t:], np.repeat(host.cos[last:last + 1], 4 - t, 0))
        write = inputs["kv_write_mask"][0, 0]
        assert write[:, t:].sum() == 0 and write[S - t:, :t].trace() == t
        assert (inputs["attn_mask"][0, 0, t:] == inputs["attn_mask"][0, 0, t - 1]).all()
    with pytest.raises(AneSpecError, match="do not fit the context window"):
        host.block(S - 1, 2, width=4)
    # Decoding into the last slots: positions S-3..S-1 run in padded passes, exactly.
    for prompt in ([3] * (S - 6), list(range(200, 200 + S - 3)), prompts(1)[0] * 30):
        prompt = prompt[:S - 2]
        base = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=50,
                                                                        speculative=False))
        spec = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=50))
        assert spec.tokens == base.tokens and spec.finish_reason == base.finish_reason == "context"


def test_prefix_reuse_across_chat_turns_is_exact_in_fp16(builds: dict) -> None:
    """Turn n's prompt extends turn n-1's: one session prefills only the new tokens, in chunks
    aligned differently from a fresh session's. Both must give the same reply."""
    _, pipeline = open_pipeline(builds["BC1T-q8-block"], "mil", "fp16")
    tok = pipeline.tokenizer
    session, history = DecodeSession(pipeline), []
    for user in ("def f(x):", "and then?", "more please"):
        history.append({"role": "user", "content": user})
        prompt = tok.encode(render_chat(history, template=None), special=True)
        out = session.generate(prompt, GenerateOptions(max_tokens=6))
        fresh = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=6))
        greedy = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=6,
                                                                          speculative=False))
        assert out.tokens == fresh.tokens == greedy.tokens
        if len(history) > 1:
            assert out.stats.reused_prefix_tokens > 0
        history.append({"role": "assistant", "content": out.text})


def test_drift_in_the_fixed_shape_is_exactly_zero(builds: dict) -> None:
    _, pipeline = open_pipeline(builds["BCT1-fp16"], "mil", "fp16")
    assert measure_drift(pipeline).figures["drift"] == 0.0
    _, mixed = open_pipeline(builds["BCT1-fp16"], "mil", "fp16", decode_shape="mixed")
    assert mixed.drift_key == "mil-fp16-mixed"
