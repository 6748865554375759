"""The model drafter: a small model of the same family drafts, the target verifies at T=4.

A synthetic pair (a 3-layer target and a 1-layer draft with one vocabulary) keeps the mechanism
tested where no real pair fits in CI time; the target drafting for itself is the pair whose
drafts are (nearly) always right, so acceptance shows the draft follows every committed token.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from ane_spec.bench.model_drafting import (
    InlineLookahead, ReferenceDraftModel, TeacherForcedDraftModel, replay_sources,
    teacher_forced_table,
)
from ane_spec.bench.streams import Stream
from ane_spec.decode.draft_policy import (
    BothDrafters, DraftCosts, evidence_bucket, p_min,
)
from ane_spec.decode.draft_process import DraftProcess
from ane_spec.decode.draft_setup import check_pair, draft_spec, open_drafter
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.model_drafter import ModelDrafter, PipelineDraftModel
from ane_spec.decode.sampling import SamplingParams, accept_draft_q, target_distribution
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.decode.verify import verify_sampled
from ane_spec.errors import AneSpecError
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.model.vocab import build_synthetic_vocab
from ane_spec.model.vocab_compat import VocabMismatch, check_draft_vocab, first_difference
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.shards.build import BuildRequest, build
from tests.decode_checks import assert_same_distribution

ALPHA = 1e-3
PROMPTS = ([21, 400, 77, 5, 9, 300, 12], [5, 6, 7, 8, 900, 1000, 3, 3, 3, 44, 45, 46])


@pytest.fixture(scope="module")
def pair(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(target build, draft build, draft GGUF): the tiny target (3 layers) and a 1-layer,
    128-wide draft of the same vocabulary, both with a 64-token context."""
    root = tmp_path_factory.mktemp("pair")
    draft_gguf = write_synthetic_gguf(root / "draft.gguf", preset(
        "tiny", num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_size=256,
        rope_dims=16, seed=11))
    build(tiny_gguf, root / "target", BuildRequest(topology="3", max_seq=64, residual_scale="off"))
    build(draft_gguf, root / "draft", BuildRequest(topology="1", max_seq=64, residual_scale="off"))
    return root / "target", root / "draft", draft_gguf


def _target(path: Path, precision: str = "fp16"):
    return open_pipeline(path, "mil", precision, verify=False)[1]


# --- the vocabulary check ---------------------------------------------------------------------

def test_the_vocabulary_check_names_the_first_difference() -> None:
    base = build_synthetic_vocab(1024, family="phi4")
    assert first_difference(base, base) is None
    check_draft_vocab(base, base)
    tokens = list(base.tokens)
    tokens[700] = "<not the same>"
    cases = [
        (base.model_copy(update={"model": "llama"}), "tokenizer type"),
        (base.model_copy(update={"add_bos_token": not base.add_bos_token}), "add-BOS flag"),
        (base.model_copy(update={"bos_token_id": 3}), "BOS id"),
        (base.model_copy(update={"eos_token_id": 4}), "EOS id"),
        (base.model_copy(update={"tokens": tokens}), "token 700"),
        (base.model_copy(update={"tokens": base.tokens[:1024 - 129]}), "vocabulary size"),
    ]
    for draft, what in cases:
        with pytest.raises(VocabMismatch, match=what):
            check_draft_vocab(base, draft, target_name="T", draft_name="D")
    # llama.cpp's allowance: up to 128 ids more or fewer, and the first 5 ids are not compared
    check_draft_vocab(base, base.model_copy(update={"tokens": base.tokens[:1024 - 128]}))
    early = list(base.tokens)
    early[2] = "<different control>"
    check_draft_vocab(base, base.model_copy(update={"tokens": early}))


def test_a_draft_of_another_vocabulary_is_refused_before_it_runs(pair, tmp_path: Path) -> None:
    other = write_synthetic_gguf(tmp_path / "o.gguf", preset("tiny", num_layers=1,
                                                             vocab_size=2048))
    build(other, tmp_path / "o", BuildRequest(topology="1", max_seq=64, residual_scale="off"))
    target = _target(pair[0])
    check_pair(target, pair[1])
    with pytest.raises(VocabMismatch, match="their vocabularies differ \\(BOS id"):
        check_pair(target, tmp_path / "o")
    with pytest.raises(AneSpecError, match="--draft-units picks Core ML"):
        draft_spec(target, pair[1], units="gpu")


# --- the drafter follows the committed tokens --------------------------------------------------

def test_the_draft_follows_committed_tokens_without_re_prefilling(pair) -> None:
    """After a partial acceptance the draft's next proposal is what a fresh draft that prefilled
    the whole history proposes (its rejected drafts were overwritten, never trusted), and it
    costs one pass per draft, not a prefill."""
    _, draft_path, _ = pair
    pipe = open_pipeline(draft_path, "mil", "fp32", verify=False, decode_shape="mixed")[1]
    model = PipelineDraftModel(pipe)
    drafter = ModelDrafter(model, limit_vocab=1024)
    prompt = PROMPTS[1]
    drafter.reset(prompt)
    first = drafter.propose(3)
    assert len(first.tokens) == 3
    # The target accepts draft 1, then commits another token than draft 2 (and a bonus).
    committed = [first.tokens[0], (first.tokens[1] + 1) % 1024]
    drafter.append(committed)
    second = drafter.propose(3)
    assert second.passes == 3  # one pass over the new token, one per further draft
    fresh = ModelDrafter(PipelineDraftModel(pipe), limit_vocab=1024)
    fresh.reset(prompt + committed)
    assert fresh.propose(3).tokens == second.tokens
    # All accepted: the last draft and the bonus go in one pass, then two more
    drafter.append([*second.tokens, 17])
    third = drafter.propose(3)
    assert third.passes == 3
    fresh.reset(prompt + committed + second.tokens + [17])
    assert fresh.propose(3).tokens == third.tokens


def test_the_draft_prefills_its_prompt_through_the_prefill_function(pair) -> None:
    """The draft's prompt goes through its build's prefill function (issue 33's T=P passes, the
    same chunk plan as the target's), not token by token: one prefill pass here, then one T=1
    pass per further draft, and the drafts are those of a prompt run in decode-shape passes."""
    _, draft_path, _ = pair
    pipe = open_pipeline(draft_path, "mil", "fp32", verify=False, decode_shape="mixed")[1]
    assert pipe.prefill_t >= 24
    calls: list[int] = []
    real = pipe.run_prefill

    def counted(tokens, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(len(tokens))
        return real(tokens, *args, **kwargs)

    pipe.run_prefill = counted
    prompt = [int(t) for t in np.random.default_rng(4).integers(5, 1000, 24)]
    drafter = ModelDrafter(PipelineDraftModel(pipe, prefill="on"), limit_vocab=1024)
    drafter.reset(prompt)
    first = drafter.propose(3)
    assert calls == [len(prompt)] and first.passes == 3
    plain = ModelDrafter(PipelineDraftModel(pipe, prefill="off"), limit_vocab=1024)
    plain.reset(prompt)
    second = plain.propose(3)
    assert calls == [len(prompt)] and second.passes == 2 + -(-len(prompt) // pipe.max_t)
    assert second.tokens == first.tokens


def test_a_gemma3_draft_follows_through_its_kv_rings(tmp_path: Path) -> None:
    """Gemma 3's sliding-window layers keep K/V in rings (model/swa_ring.py): a draft that
    rolls back rejected proposals must still propose what a fresh draft of the whole history
    proposes, long after the ring has wrapped (window 8, ring 96, 120 positions)."""
    gguf = write_synthetic_gguf(tmp_path / "g.gguf", preset("gemma3-tiny", num_layers=2,
                                                            seed=11, embed_std=0.02))
    build(gguf, tmp_path / "g", BuildRequest(topology="2", max_seq=128, residual_scale="off"))
    pipe = open_pipeline(tmp_path / "g", "mil", "fp32", verify=False, decode_shape="mixed")[1]
    assert pipe.host.ring
    drafter = ModelDrafter(PipelineDraftModel(pipe))
    rng = np.random.default_rng(2)
    history = [int(t) for t in rng.integers(5, 1000, 20)]
    drafter.reset(history)
    while len(history) < 120:
        drafts = drafter.propose(3).tokens
        keep = int(rng.integers(0, 4))  # accept some, then a token of the target's own
        step = drafts[:keep] + [int(rng.integers(5, 1000))]
        drafter.append(step)
        history += step
    fresh = ModelDrafter(PipelineDraftModel(pipe))
    fresh.reset(history)
    assert drafter.propose(3).tokens == fresh.propose(3).tokens


def test_p_min_stops_drafting_between_passes(pair) -> None:
    _, draft_path, _ = pair
    pipe = open_pipeline(draft_path, "mil", "fp32", verify=False, decode_shape="mixed")[1]
    drafter = ModelDrafter(PipelineDraftModel(pipe), limit_vocab=1024)
    drafter.reset(PROMPTS[0])
    one = drafter.propose(3, p_min=1.0)  # nothing is certain: the paid pass's token only
    assert len(one.tokens) == 1 and one.passes == 1
    drafter.reset(PROMPTS[0])
    assert len(drafter.propose(3, p_min=0.0).tokens) == 3


def test_p_min_follows_the_measured_costs() -> None:
    assert p_min(0.0, 1.5, 0.8) == 0.0  # hidden: every slot filled
    assert p_min(0.43, 1.4, 0.8) == pytest.approx(0.7525)
    assert p_min(0.07, 1.4, 0.8) == pytest.approx(0.1225)
    assert p_min(5.0, 1.4, 0.8) == 0.95
    assert [evidence_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 40)] == [0, 1, 2, 3, 4, 4, 5, 5]


# --- exactness ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["model", "both"])
def test_speculative_equals_greedy_in_fp16_with_a_draft_model(pair, mode: str) -> None:
    """Greedy verification decides every token and the target's passes keep T=4, so the output
    is plain greedy's bit for bit whatever the draft proposes: with a draft of its own kind
    (few drafts accepted) and with the target drafting for itself (most accepted)."""
    target_path, draft_path, _ = pair
    target = _target(target_path)
    for draft in (draft_path, target_path):
        drafter = open_drafter(target, draft, mode=mode, process=False, measure=False)
        for prompt in PROMPTS:
            options = GenerateOptions(max_tokens=40)
            greedy = DecodeSession(target).generate(prompt, options.model_copy(
                update={"speculative": False}))
            spec = DecodeSession(target, drafter=drafter).generate(prompt, options)
            assert spec.tokens == greedy.tokens
            sources = spec.stats.to_dict()["draft_sources"]
            if draft == target_path and mode == "model":
                assert spec.stats.to_dict()["acceptance"] > 0.9, sources
                assert sources["model"]["passes"] == spec.stats.passes
            assert spec.stats.draft_model_passes > 0


def test_drafts_past_the_targets_vocabulary_are_never_proposed(pair) -> None:
    _, draft_path, _ = pair
    pipe = open_pipeline(draft_path, "mil", "fp32", verify=False, decode_shape="mixed")[1]
    drafter = ModelDrafter(PipelineDraftModel(pipe), limit_vocab=1)  # only id 0 is the target's
    drafter.reset(PROMPTS[0])
    assert all(t < 1 for t in drafter.propose(3).tokens)
    drafter.reset(PROMPTS[0])
    drafter.append([5000])  # a committed id past the draft's vocabulary: it falls silent
    assert drafter.propose(3).tokens == []


# --- sampling with the draft's own q -----------------------------------------------------------

def test_accept_draft_q_gives_the_target_distribution() -> None:
    rng = np.random.default_rng(3)
    vocab, n = 10, 20000
    p = rng.dirichlet(np.ones(vocab))
    q = rng.dirichlet(np.ones(vocab) * 0.5)
    draw = np.random.default_rng(4)
    seen = Counter()
    for _ in range(n):
        x = int(draw.choice(vocab, p=q))
        ok, y = accept_draft_q(p, q, x, draw)
        seen[x if ok else y] += 1
    obs = np.array([seen[k] for k in range(vocab)], float)
    assert stats.chisquare(obs, n * p).pvalue > ALPHA
    # q equal to p accepts every draft
    assert all(accept_draft_q(p, p, k, draw)[0] for k in range(vocab))


def test_verify_sampled_with_q_matches_the_target_rows() -> None:
    rng = np.random.default_rng(0)
    vocab, n = 12, 12000
    logits = rng.normal(0, 1.5, (4, vocab))
    params = SamplingParams(temperature=1.0)
    out = BlockOutput.of_logits(logits)
    p = [target_distribution(out.row_logits(i), params) for i in range(4)]
    q0 = rng.dirichlet(np.ones(vocab))
    q1 = rng.dirichlet(np.ones(vocab))
    draw = np.random.default_rng(1)
    first, second = Counter(), Counter()
    for _ in range(n):
        d0 = int(draw.choice(vocab, p=q0))
        d1 = int(draw.choice(vocab, p=q1))
        v = verify_sampled([d0, d1], out, params, draw, q=[q0, q1])
        emitted = [d0, d1][:v.accepted] + [v.next_token]
        first[emitted[0]] += 1
        if v.accepted >= 1:  # the second token, given the first draft was accepted
            second[(emitted[0], emitted[1])] += 1
    obs = np.array([first[k] for k in range(vocab)], float)
    assert stats.chisquare(obs, n * p[0]).pvalue > ALPHA
    # Row 1 is computed after draft 0 whatever it was (logits are fixed here): given any
    # accepted first token, the second follows p[1].
    given = Counter()
    for (a, b), c in second.items():
        given[b] += c
    m = sum(given.values())
    obs = np.array([given[k] for k in range(vocab)], float)
    assert stats.chisquare(obs, m * p[1]).pvalue > ALPHA


def test_sampling_with_a_draft_model_matches_plain_sampling(pair) -> None:
    """The 2nd and 3rd generated tokens over 200 seeds, plain vs speculative with the draft
    drawing its drafts from q (the target drafting for itself: most drafts are accepted, so the
    p/q acceptance and the residual both run). Two-sample chi-square."""
    target_path = pair[0]
    target = _target(target_path, "fp32")
    drafter = open_drafter(target, target_path, mode="model", process=False, measure=False)
    prompt = PROMPTS[0]
    counts = {(s, i): Counter() for s in ("plain", "spec") for i in (1, 2)}
    accepted = 0
    for seed in range(200):
        params = SamplingParams(temperature=0.3, seed=seed)
        plain = DecodeSession(target).generate(
            prompt, GenerateOptions(max_tokens=3, sampling=params, speculative=False))
        spec = DecodeSession(target, drafter=drafter).generate(
            prompt, GenerateOptions(max_tokens=3, sampling=params))
        accepted += spec.stats.accepted
        for i in (1, 2):
            counts[("plain", i)][plain.tokens[i] if len(plain.tokens) > i else -1] += 1
            counts[("spec", i)][spec.tokens[i] if len(spec.tokens) > i else -1] += 1
    assert accepted > 70  # the q path ran
    for i in (1, 2):
        assert_same_distribution(counts[("plain", i)], counts[("spec", i)], ALPHA)


# --- the policy ----------------------------------------------------------------------------------

def test_both_drafters_take_the_ngram_where_the_output_copies_the_prompt(tiny_gguf) -> None:
    """Replayed on two constructed streams with a random draft model: an output that copies its
    prompt (editing given code) goes to the n-gram drafter, never below the n-gram alone; an
    output the draft model predicts (the target drafting for itself) goes to the model."""
    g = open_gguf(tiny_gguf)
    ref = ReferenceModel(g, context_window=256)
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(10, 1000, 60)]
    copy = Stream("edit", tuple(doc + [3]), tuple(doc[:50]))
    prompt = [int(t) for t in rng.integers(10, 1000, 12)]
    fresh = Stream("fresh", tuple(prompt), tuple(ref.generate(prompt, 40)))
    other = write_synthetic_gguf(Path(os.path.dirname(tiny_gguf)) / "other.gguf",
                                 preset("tiny", num_layers=1, seed=99))

    def drafter(mode: str, gguf: Path, costs: DraftCosts | None) -> BothDrafters:
        model = ModelDrafter(ReferenceDraftModel(ReferenceModel(open_gguf(gguf),
                                                                context_window=256)))
        return BothDrafters(NgramDrafter(), model, mode=mode, costs=costs)

    serial = DraftCosts(1.0, 0.2)
    ngram = replay_sources(drafter("ngram", other, serial), copy)
    both = replay_sources(drafter("both", other, serial), copy)
    assert both["passes"] <= ngram["passes"]
    assert both["sources"]["ngram"][0] > 0.8 * both["passes"]
    own = replay_sources(drafter("both", tiny_gguf, None), fresh)
    assert own["sources"]["model"][0] > 0.7 * own["passes"]
    assert own["generated"] / own["passes"] > 3


def test_the_look_ahead_hands_out_drafts_without_a_pass(tiny_gguf) -> None:
    """With overlap, the draft looks past each block while the target verifies it: when the
    target accepts everything and its bonus is the draft's guess, the next drafts are ready."""
    g = open_gguf(tiny_gguf)
    ref = ReferenceModel(g, context_window=256)
    prompt = [21, 400, 77, 5, 9]
    s = Stream("own", tuple(prompt), tuple(ref.generate(prompt, 40)))
    model = InlineLookahead(ModelDrafter(ReferenceDraftModel(ReferenceModel(g,
                                                                            context_window=256))))
    d = BothDrafters(NgramDrafter(), model, mode="model", overlap=True)
    r = replay_sources(d, s)
    assert r["critical_draft_passes"] < r["passes"] / 2  # most steps' drafts were ready
    assert r["hidden_draft_passes"] >= 3 * r["passes"] - 4


def test_the_teacher_forced_replay_counts_what_a_running_draft_counts(tiny_gguf) -> None:
    """The README's real-pair table reads greedy drafts from one teacher-forced pass per stream:
    the tokens per pass, each source's drafted/accepted counts and the draft passes must equal a
    replay that runs the draft pass by pass, for the model alone and for both drafters."""
    g = open_gguf(tiny_gguf)
    target = ReferenceModel(g, context_window=256)
    rng = np.random.default_rng(8)
    streams = []
    for n in (9, 14, 20):
        prompt = [int(t) for t in rng.integers(10, 1000, n)]
        streams.append(Stream("s", tuple(prompt), tuple(target.generate(prompt, 40))))
    doc = [int(t) for t in rng.integers(10, 1000, 40)]
    streams.append(Stream("edit", tuple(doc + [3]), tuple(doc[:30])))
    other = write_synthetic_gguf(Path(os.path.dirname(tiny_gguf)) / "tf-draft.gguf",
                                 preset("tiny", num_layers=2, seed=3))
    accepted = 0
    for draft in (other, tiny_gguf):  # a draft that is mostly wrong, one that is mostly right
        ref = ReferenceModel(open_gguf(draft), context_window=256)
        table = teacher_forced_table(ref, streams)
        vocab = ref.config.vocab_size
        for mode in ("model", "both"):
            run = ModelDrafter(ReferenceDraftModel(ref))
            forced = ModelDrafter(TeacherForcedDraftModel(table, vocab))
            for s in streams:
                a = replay_sources(BothDrafters(NgramDrafter(), run, mode=mode), s)
                b = replay_sources(BothDrafters(NgramDrafter(), forced, mode=mode), s)
                assert (a["passes"], a["sources"]) == (b["passes"], b["sources"])
                assert a["critical_draft_passes"] == b["critical_draft_passes"]
                accepted += a["sources"].get("model", [0, 0, 0])[2]
    assert accepted > 100  # the comparison covered accepted model drafts, not only rejections


# --- the draft in its own process -------------------------------------------------------------

def test_a_draft_process_overlaps_and_its_death_never_fails_a_request(pair) -> None:
    target_path, draft_path, _ = pair
    target = _target(target_path)
    drafter = open_drafter(target, target_path, mode="model")
    try:
        assert isinstance(drafter.model, DraftProcess) and drafter.overlap
        assert drafter.costs is not None and drafter.costs.overlap is not None
        prompt = PROMPTS[1]
        options = GenerateOptions(max_tokens=40)
        greedy = DecodeSession(target).generate(prompt, options.model_copy(
            update={"speculative": False}))
        spec = DecodeSession(target, drafter=drafter).generate(prompt, options)
        assert spec.tokens == greedy.tokens
        assert spec.stats.to_dict()["acceptance"] > 0.9
        killed = []

        def kill_once(piece: str) -> None:
            if not killed:
                killed.append(drafter.model.worker.pid)
                os.kill(drafter.model.worker.pid, signal.SIGKILL)

        spec = DecodeSession(target, drafter=drafter).generate(prompt, options, kill_once)
        assert spec.tokens == greedy.tokens
        assert drafter.model.failures == 1 and "died" in drafter.model.last_failure
        again = DecodeSession(target, drafter=drafter).generate(prompt, options)  # restarted
        assert again.tokens == greedy.tokens and again.stats.to_dict()["acceptance"] > 0.9
        assert drafter.model.worker.restarts == 1
    finally:
        drafter.model.close()
