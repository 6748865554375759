"""The decode engine on a tiny build with the fp32 interpreter: speculative == greedy, exactly.

`pipeline` runs the default fixed decode shape (every pass 4 rows wide); `mixed` the same build
with T=1 decode passes, where the exactness guard lives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.decode.verify import verify_greedy
from ane_spec.errors import AneSpecError
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.shards.build import BuildRequest, build
from ane_spec.bench.scripted_drafter import ScriptedDrafter

S = 64


@pytest.fixture(scope="module")
def artifacts(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("decode") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S))
    return out


@pytest.fixture(scope="module")
def pipeline(artifacts: Path):
    return open_pipeline(artifacts, "mil", "fp32")[1]


@pytest.fixture(scope="module")
def mixed(artifacts: Path):
    return open_pipeline(artifacts, "mil", "fp32", decode_shape="mixed")[1]


def greedy(pipeline, prompt, **kw):
    session = DecodeSession(pipeline, fill_drafts=True)
    return session.generate(prompt, GenerateOptions(speculative=False, **kw))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 958, int(rng.integers(1, 30))).tolist() for _ in range(n)]


@pytest.mark.parametrize("shape", ["fixed", "mixed"])
def test_speculative_equals_greedy_on_varied_prompts(pipeline, mixed, shape: str) -> None:
    """>= 30 prompts, n-gram drafter, fp32 interpreter: token-for-token equality."""
    pl = pipeline if shape == "fixed" else mixed
    session = DecodeSession(pl)
    distinct, accepted = [], 0
    for prompt in prompts(32):
        base = greedy(pl, prompt, max_tokens=24)
        spec = session.generate(prompt, GenerateOptions(max_tokens=24))
        assert spec.tokens == base.tokens, prompt
        assert spec.text == base.text and spec.finish_reason == base.finish_reason
        distinct.append(len(set(base.tokens)))
        accepted += spec.stats.accepted
    # Guard against the random-fixture trap: outputs vary and the drafter actually gets accepts.
    assert np.median(distinct) >= 6 and accepted > 20


def test_prompts_that_fill_the_context(pipeline) -> None:
    for prompt in ([5] * 50, list(range(100, 160)), [7] * 64):
        base = greedy(pipeline, prompt, max_tokens=100)
        spec = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=100))
        assert spec.tokens == base.tokens and spec.finish_reason == base.finish_reason == "context"
        assert len(spec.tokens) == S - len(prompt) + 1  # the last token is emitted unfed


def test_eos_mid_block(pipeline) -> None:
    prompt = [11, 22, 33, 44, 55]
    full = greedy(pipeline, prompt, max_tokens=30).tokens
    for cut in (2, 5, 6, 9):  # EOS at every offset within a 4-token pass
        eos = full[cut]
        assert eos not in full[:cut]
        for correct in (3, 1):
            session = DecodeSession(pipeline, drafter=ScriptedDrafter(full, correct, 1024),
                                    fill_drafts=True)
            session.eog = frozenset({eos})
            out = session.generate(prompt, GenerateOptions(max_tokens=30))
            assert out.tokens == full[:cut] and out.finish_reason == "stop"


@pytest.mark.parametrize("correct,tokens_per_pass", [(3, 4.0), (1, 2.0), (0, 1.0)])
def test_accept_patterns(pipeline, correct: int, tokens_per_pass: float) -> None:
    """Full accept + bonus (4 per pass), partial accept (2), rejection at row 0 (1)."""
    prompt = [3, 141, 59, 26, 535]
    base = greedy(pipeline, prompt, max_tokens=41)
    session = DecodeSession(pipeline, drafter=ScriptedDrafter(base.tokens, correct, 1024),
                            fill_drafts=True)
    out = session.generate(prompt, GenerateOptions(max_tokens=41))
    assert out.tokens == base.tokens
    assert out.stats.to_dict()["tokens_per_pass"] == pytest.approx(tokens_per_pass)
    assert out.stats.accepted_histogram[correct] == out.stats.passes


def test_stale_slots_are_masked(pipeline) -> None:
    """Rejected drafts left in slots 7, 8 change nothing, exactly: the mask gives them weight 0."""
    prompt = [9, 8, 7, 6, 5]
    clean, dirty = pipeline.new_state(), pipeline.new_state()
    for st in (clean, dirty):
        pipeline.run(prompt[:4], 0, st)
        pipeline.run(prompt[4:], 4, st)
    pipeline.run([100, 200, 300, 400], 5, dirty)        # a pass whose drafts all get rejected
    a = pipeline.run([100, 17], 5, clean).logits
    b = pipeline.run([100, 17], 5, dirty).logits        # overwrites slots 5, 6; 7, 8 stay stale
    assert np.array_equal(a, b)


def test_prefix_reuse_three_turns(pipeline) -> None:
    tok = pipeline.tokenizer
    turns = ["hello there", "and then what", "tell me more"]
    session, history = DecodeSession(pipeline), []
    for n, user in enumerate(turns):
        history.append({"role": "user", "content": user})
        from ane_spec.model.chat import render_chat

        prompt = tok.encode(render_chat(history, template=None), special=True)
        before = list(session.kv_tokens)
        out = session.generate(prompt, GenerateOptions(max_tokens=8))
        fresh = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=8))
        assert out.tokens == fresh.tokens
        # The reply re-tokenized from text may split differently from the generated ids, so
        # reuse covers the common prefix: at least all of the previous turn's prompt.
        shared = next((i for i, (a, b) in enumerate(zip(before, prompt)) if a != b),
                      min(len(before), len(prompt)))
        if n:
            assert shared >= previous_prompt_len
            assert out.stats.reused_prefix_tokens == min(shared, len(prompt) - 1)
            assert out.stats.prefill_tokens == len(prompt) - out.stats.reused_prefix_tokens
        previous_prompt_len = len(prompt)
        history.append({"role": "assistant", "content": out.text})


def test_stop_string_straddling_a_block(pipeline) -> None:
    prompt = [12, 34, 56, 78]
    base = greedy(pipeline, prompt, max_tokens=20)
    tok = pipeline.tokenizer
    pieces = [tok.decode([t]) for t in base.tokens]
    # tokens 3..5 straddle the first full-accept pass (tokens 1-4) and the next one
    stop = "".join(pieces[3:6])
    assert stop and stop not in "".join(pieces[:3]) + pieces[3][:-1]
    streamed: list[str] = []
    session = DecodeSession(pipeline, drafter=ScriptedDrafter(base.tokens, 3, 1024),
                            fill_drafts=True)
    out = session.generate(prompt, GenerateOptions(max_tokens=20, stop=(stop,)),
                           on_text=streamed.append)
    expected = base.text[:base.text.index(stop)]
    assert out.finish_reason == "stop" and out.text == expected == "".join(streamed)


def test_cancel_and_max_tokens(pipeline) -> None:
    prompt = [1, 2, 3]
    calls = []
    out = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=30),
                                           on_text=lambda s: calls.append(s) or len(calls) < 3)
    assert out.finish_reason == "cancelled" and len(calls) == 3
    out = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=5))
    assert out.finish_reason == "length" and len(out.tokens) == 5


def test_bad_requests(pipeline) -> None:
    session = DecodeSession(pipeline)
    with pytest.raises(AneSpecError, match="more than the context window of 64"):
        session.generate(list(range(65)))
    with pytest.raises(AneSpecError, match="empty"):
        session.generate([])
    with pytest.raises(AneSpecError, match="outside the vocabulary"):
        session.generate([1, 99999])


def test_guard_stops_at_a_near_tie() -> None:
    logits = np.zeros((4, 10), np.float32)
    logits[:, 1] = 5.0
    logits[1, 2] = 4.99          # row 1 is a near tie
    out = BlockOutput.of_logits(logits)
    assert verify_greedy([1, 1, 1], out, None).accepted == 3
    v = verify_greedy([1, 1, 1], out, 0.05)
    assert v.accepted == 1 and v.next_token is None and v.guard_row == 1


def test_trace_and_stats(pipeline, tmp_path: Path) -> None:
    import io
    import json

    from ane_spec.decode.metrics import Trace

    buf = io.StringIO()
    out = DecodeSession(pipeline, trace=Trace(buf)).generate([4, 5, 6], GenerateOptions(max_tokens=12))
    records = [json.loads(line) for line in buf.getvalue().splitlines()]
    prefill = [r for r in records if r.get("prefill")]
    lines = [r for r in records if not r.get("prefill")]
    assert len(prefill) == out.stats.prefill_passes == 1  # 3 prompt tokens: one pass
    assert prefill[0]["T"] == 3 and prefill[0]["position"] == 0
    assert len(lines) == out.stats.passes
    assert {"position", "T", "drafts", "accepted", "backend_ms", "host_ms"} <= set(lines[0])
    d = out.stats.to_dict()
    assert d["generated_tokens"] == 12 and d["passes"] >= 3 and d["decode_tok_s"] > 0


def test_guard_never_redoes_a_plain_t1_pass(mixed) -> None:
    """Mixed shape, with a huge drift every T>1 row is a 'near tie'; T=1 passes still must not
    be redone."""
    mixed.manifest.drift[mixed.drift_key] = 1e9
    try:
        plain = DecodeSession(mixed).generate([1, 2, 3], GenerateOptions(max_tokens=10,
                                                                          speculative=False))
        assert plain.stats.guard_interventions == 0 and plain.stats.passes == 9
        spec = DecodeSession(mixed).generate([1, 2, 3], GenerateOptions(max_tokens=10))
        assert spec.tokens == plain.tokens  # every row redone at T=1: plain decoding, exactly
        assert spec.stats.guard_interventions > 0
        assert spec.stats.to_dict()["tokens_per_pass"] >= 0.5
    finally:
        del mixed.manifest.drift[mixed.drift_key]


def test_the_fixed_shape_never_consults_the_guard(pipeline) -> None:
    """Even a drift that makes every row a near tie changes nothing in the fixed shape."""
    pipeline.manifest.drift[pipeline.drift_key] = 1e9
    try:
        session = DecodeSession(pipeline)
        assert session.guard_margin is None and session.fill_drafts
        out = session.generate([1, 2, 3], GenerateOptions(max_tokens=10))
        assert out.stats.guard_interventions == 0 and out.stats.decode_shape == "fixed"
    finally:
        del pipeline.manifest.drift[pipeline.drift_key]
