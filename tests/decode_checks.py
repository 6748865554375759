"""Checks several test modules make on a built pipeline."""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy import stats

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.runtime.pipeline import ShardPipeline


def assert_speculative_equals_greedy(pipeline: ShardPipeline, *, token_limit: int,
                                     longest: int, label: str) -> None:
    """Eight random prompts (ids below `token_limit`, 2..`longest` tokens): speculative output is
    greedy's token for token; the output varies (median >= 5 distinct tokens per 20, so a model
    repeating one token cannot pass) and some drafts are accepted (so verification ran)."""
    session = DecodeSession(pipeline)
    rng = np.random.default_rng(5)
    distinct, accepted = [], 0
    for _ in range(8):
        prompt = rng.integers(0, token_limit, int(rng.integers(2, longest))).tolist()
        base = DecodeSession(pipeline).generate(
            prompt, GenerateOptions(max_tokens=20, speculative=False))
        spec_out = session.generate(prompt, GenerateOptions(max_tokens=20))
        assert spec_out.tokens == base.tokens, prompt
        distinct.append(len(set(base.tokens)))
        accepted += spec_out.stats.accepted
    print(label, "distinct per 20:", distinct, "accepted", accepted)
    assert np.median(distinct) >= 5 and accepted > 0


def assert_same_distribution(a: Counter, b: Counter, alpha: float = 1e-3) -> None:
    """Two samples of tokens from one distribution: a two-sample chi-square (contingency) test,
    columns with fewer than 10 draws pooled so every expected cell is >= 5."""
    keys = sorted(set(a) | set(b))
    table = np.array([[a[k] for k in keys], [b[k] for k in keys]], float)
    big = table.sum(0) >= 10
    pooled = np.column_stack([table[:, big], table[:, ~big].sum(1)])
    assert pooled.shape[1] >= 3, "the temperature should spread the samples"
    assert stats.chi2_contingency(pooled).pvalue > alpha
