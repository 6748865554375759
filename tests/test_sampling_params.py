"""llama.cpp's sampling parameters as logit processors: the arithmetic llama.cpp documents, and
exactness under speculation (greedy token-identical, sampling distribution-exact).

Chi-square tests at alpha = 0.001 with fixed seeds, as tests/test_sampling.py: deterministic, and
a processor applied to the wrong row (without the drafts before it, or to rows after a
rejection) moves the distributions by far more than these sample sizes resolve.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from ane_spec.decode.grammar import Grammar, lark_grammar
from ane_spec.decode.sampling import LogitProcessor, SamplingParams, target_distribution
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.decode.verify import RowChooser, verify_sampled
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.shards.build import BuildRequest, build
from ane_spec.bench.scripted_drafter import ScriptedDrafter
from tests.decode_checks import assert_same_distribution
from tests.test_sampling import ALPHA, _pooled


def test_penalties_follow_llama_cpp() -> None:
    """llama_sampler_penalties: logit / r if positive else * r, then - count * freq - presence,
    over the last repeat_last_n tokens only; logit_bias adds; ignore_eos removes every EOG."""
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], np.float32)
    p = SamplingParams(repeat_penalty=2.0, repeat_last_n=4, frequency_penalty=0.25,
                       presence_penalty=0.5, logit_bias=((4, -1.5),), ignore_eos=True)
    z = LogitProcessor(p, eog_ids=[3]).apply(logits, [2, 0, 0, 1, 0, 2])  # window: 0, 1, 0, 2
    expected = [2.0 / 2 - 2 * 0.25 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2 - 0.25 - 0.5,
                -np.inf, 1.0 - 1.5]
    np.testing.assert_allclose(z, expected)
    assert logits[0] == 2.0  # the row itself is never modified


def test_truncations() -> None:
    logits = np.log(np.array([0.5, 0.2, 0.15, 0.1, 0.05]))
    p = target_distribution(logits, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(p, [0.5 / 0.7, 0.2 / 0.7, 0, 0, 0])
    # min_p 0.25: keep tokens at least a quarter as likely as the best (0.125)
    p = target_distribution(logits, SamplingParams(temperature=1.0, min_p=0.25))
    np.testing.assert_allclose(p, np.array([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    p = target_distribution(logits, SamplingParams(temperature=1.0, top_k=1))
    assert p.argmax() == 0 and p[0] == 1.0


def test_speculative_sampling_is_exact_with_processors_and_a_grammar() -> None:
    """Rows see the drafts before them: row 1's penalties count draft 0, and row 1's grammar
    state has consumed it. The emitted first and second tokens have exactly the processed
    plain-sampling distributions."""
    tok = Tokenizer(build_synthetic_vocab(512))
    letters = [tok.encode(c)[0] for c in "abcdef"]
    # Any two letters, the second different from 'a' when the first is 'a'.
    grammar = Grammar(tok, lark_grammar('start: ("a" /[b-f]/) | (/[b-f]/ /[a-f]/)'))
    rng = np.random.default_rng(3)
    logits = np.full((4, tok.vocab_size), -5.0, np.float32)
    logits[:, letters] = rng.normal(0, 1.0, (4, len(letters)))
    params = SamplingParams(temperature=1.0, top_k=5, repeat_penalty=1.5, presence_penalty=0.4,
                            logit_bias=((letters[2], 0.7),))
    history = [letters[1], letters[3]]
    out = BlockOutput.of_logits(logits)
    drafts = [letters[0], letters[0], letters[1]]

    def chooser() -> RowChooser:
        return RowChooser(params, eog_ids=tok.eog_ids, history=history, grammar=grammar.start())

    first_ref = chooser()
    p0 = first_ref.distribution(out, 0)
    first_ref.advance(drafts[0])
    p1 = first_ref.distribution(out, 1)  # after draft 0, as plain decoding would see it
    assert p1[letters[0]] == 0.0  # the grammar forbids 'aa': draft 1 must always be rejected
    n = 10000
    draw = np.random.default_rng(11)
    first, second = Counter(), Counter()
    for _ in range(n):
        v = verify_sampled(drafts, out, params, draw, chooser())
        emitted = drafts[:v.accepted] + [v.next_token]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0]:
            assert len(emitted) == 2 and emitted[1] != letters[0]
            second[emitted[1]] += 1
    for counts, p in ((first, p0), (second, p1)):
        total = sum(counts.values())
        obs, exp = _pooled(counts, {k: total * float(p[k]) for k in np.flatnonzero(p)})
        assert len(exp) >= 3 and stats.chisquare(obs, exp).pvalue > ALPHA


@pytest.fixture(scope="module")
def pipeline(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sampling-params") / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=64))
    return open_pipeline(out, "mil", "fp32")[1]


PROMPT = [21, 400, 77, 5, 21, 400]


@pytest.mark.parametrize("params", [
    SamplingParams(repeat_penalty=1.6),
    SamplingParams(repeat_penalty=1.3, repeat_last_n=8),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=1.0),
    SamplingParams(logit_bias=((400, 4.0), (77, -100.0))),
], ids=["repeat", "repeat-last-8", "presence", "frequency", "logit-bias"])
def test_greedy_with_each_processor_is_identical_with_and_without_speculation(
        pipeline, params) -> None:
    vocab = pipeline.config.vocab_size
    base = DecodeSession(pipeline).generate(
        PROMPT, GenerateOptions(max_tokens=24, speculative=False))
    plain = DecodeSession(pipeline).generate(
        PROMPT, GenerateOptions(max_tokens=24, speculative=False, sampling=params))
    assert plain.tokens != base.tokens  # the parameter does something here
    ngram = DecodeSession(pipeline).generate(PROMPT, GenerateOptions(max_tokens=24,
                                                                     sampling=params))
    assert ngram.tokens == plain.tokens
    for correct in (3, 1, 0):
        spec = DecodeSession(pipeline, drafter=ScriptedDrafter(plain.tokens, correct, vocab)
                             ).generate(PROMPT, GenerateOptions(max_tokens=24, sampling=params))
        assert spec.tokens == plain.tokens, correct


def test_ignore_eos(pipeline) -> None:
    eos = pipeline.tokenizer.eos_token_id
    stop_now = SamplingParams(logit_bias=((eos, 100.0),))
    out = DecodeSession(pipeline).generate(PROMPT, GenerateOptions(max_tokens=8,
                                                                   sampling=stop_now))
    assert out.tokens == [] and out.finish_reason == "stop"
    ignore = SamplingParams(logit_bias=((eos, 100.0),), ignore_eos=True)
    out = DecodeSession(pipeline).generate(PROMPT, GenerateOptions(max_tokens=8,
                                                                   sampling=ignore))
    assert len(out.tokens) == 8 and out.finish_reason == "length"
    assert not set(out.tokens) & pipeline.tokenizer.eog_ids


def test_sampling_with_processors_end_to_end(pipeline) -> None:
    """The 2nd generated token over 200 seeds, plain vs speculative with scripted drafts, with
    top_k, min_p and penalties on: a two-sample test."""
    params = dict(temperature=0.3, top_k=8, min_p=0.02, repeat_penalty=1.4,
                  frequency_penalty=0.3)
    greedy = DecodeSession(pipeline).generate(PROMPT, GenerateOptions(
        max_tokens=3, speculative=False, sampling=SamplingParams(repeat_penalty=1.4,
                                                                 frequency_penalty=0.3)))
    counts = {"plain": Counter(), "spec": Counter()}
    vocab = pipeline.config.vocab_size
    for seed in range(200):
        sp = SamplingParams(seed=seed, **params)
        plain = DecodeSession(pipeline).generate(
            PROMPT, GenerateOptions(max_tokens=2, sampling=sp, speculative=False))
        spec = DecodeSession(pipeline, drafter=ScriptedDrafter(greedy.tokens, 3, vocab)
                             ).generate(PROMPT, GenerateOptions(max_tokens=2, sampling=sp))
        for name, r in (("plain", plain), ("spec", spec)):
            counts[name][r.tokens[1] if len(r.tokens) > 1 else -1] += 1
    assert_same_distribution(counts["plain"], counts["spec"], ALPHA)
