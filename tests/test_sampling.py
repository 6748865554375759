"""Speculative sampling gives exactly the plain sampler's distribution (chi-square tests).

Level alpha = 0.001 for each test: with fixed seeds the tests are deterministic; a correct
sampler fails one with probability 0.1%, while the classic bugs (accepting drafts greedily,
resampling from p instead of the residual, reading rows after a rejection) move the
distribution by far more than these sample sizes resolve.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from ane_spec.decode.sampling import SamplingParams, target_distribution
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.decode.verify import verify_sampled
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build
from tests.test_decode import ScriptedDrafter

ALPHA = 1e-3


def _pooled(observed: Counter, expected: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    """Categories with expected count >= 5, the rest pooled into one bin."""
    big = [k for k, e in expected.items() if e >= 5]
    obs = [observed.get(k, 0) for k in big]
    exp = [expected[k] for k in big]
    rest_o = sum(v for k, v in observed.items() if k not in big)
    rest_e = sum(e for k, e in expected.items() if k not in big)
    if rest_e > 0:
        obs.append(rest_o)
        exp.append(rest_e)
    return np.array(obs, float), np.array(exp, float)


def test_verify_sampled_matches_target_rows() -> None:
    rng = np.random.default_rng(0)
    vocab, n = 12, 40000
    logits = rng.normal(0, 1.5, (4, vocab))
    params = SamplingParams(temperature=1.0, top_p=0.9)
    p = [target_distribution(row, params) for row in logits]
    drafts = [int(np.argsort(-p[0])[1]), int(p[1].argmax()), 3]  # a 2nd-best, a best, a random
    first, second_given_first = Counter(), Counter()
    draw = np.random.default_rng(1)
    out = BlockOutput.of_logits(logits)
    p = [target_distribution(out.row_logits(i), params) for i in range(4)]  # what verify sees
    for _ in range(n):
        v = verify_sampled(drafts, out, params, draw)
        emitted = drafts[:v.accepted] + [v.next_token]
        first[emitted[0]] += 1
        if emitted[0] == drafts[0] and len(emitted) > 1:
            second_given_first[emitted[1]] += 1
    obs, exp = _pooled(first, {k: n * float(p[0][k]) for k in range(vocab)})
    assert stats.chisquare(obs, exp).pvalue > ALPHA
    m = sum(second_given_first.values())
    obs, exp = _pooled(second_given_first, {k: m * float(p[1][k]) for k in range(vocab)})
    assert stats.chisquare(obs, exp).pvalue > ALPHA
    # top_p really truncates: tokens outside the nucleus never appear
    assert all(p[0][k] > 0 for k in first)


@pytest.fixture(scope="module")
def pipeline(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("sampling") / "art"
    build(tiny_gguf, out, BuildRequest(topology="3", max_seq=32))
    return open_pipeline(out, "mil", "fp32")[1]


def test_speculative_and_plain_samplers_agree_end_to_end(pipeline) -> None:
    """Distribution of the 2nd and of the 3rd generated token over 400 seeds, two-sample tests.
    Temperature 0.2 keeps most mass on a few tokens of this random model (at 0.6 it spreads
    over ~700, too thin for 400 draws).
    The 2nd token goes through speculative acceptance of draft 1 (or its residual), the 3rd
    through draft 2 or the token after a rejection."""
    prompt = [21, 400, 77, 5]
    greedy = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=4,
                                                                      speculative=False))
    counts = {(s, i): Counter() for s in ("plain", "spec") for i in (1, 2)}
    for seed in range(400):
        params = SamplingParams(temperature=0.2, top_p=0.95, seed=seed)
        plain = DecodeSession(pipeline, fill_drafts=True).generate(
            prompt, GenerateOptions(max_tokens=3, sampling=params, speculative=False))
        spec = DecodeSession(pipeline, drafter=ScriptedDrafter(greedy.tokens, 3, 1024),
                             fill_drafts=True).generate(
            prompt, GenerateOptions(max_tokens=3, sampling=params))
        for i in (1, 2):  # -1: generation ended (a sampled end-of-generation token) before i
            counts[("plain", i)][plain.tokens[i] if len(plain.tokens) > i else -1] += 1
            counts[("spec", i)][spec.tokens[i] if len(spec.tokens) > i else -1] += 1
    for i in (1, 2):
        a, b = counts[("plain", i)], counts[("spec", i)]
        keys = sorted(set(a) | set(b))
        table = np.array([[a[k] for k in keys], [b[k] for k in keys]], float)
        big = table.sum(0) >= 10  # pool sparse columns so every expected cell is >= 5
        pooled = np.column_stack([table[:, big], table[:, ~big].sum(1)])
        assert pooled.shape[1] >= 3, "the temperature should spread the samples"
        assert stats.chi2_contingency(pooled).pvalue > ALPHA
