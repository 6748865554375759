"""Block verification: which drafts a pass accepts and which token comes next.

A pass feeds [pending, d1, .., dk] at slots p..p+k. Row i predicts slot p+i+1, so row i checks
draft d(i+1) and the last row offers a bonus token. Only rows 0..m are clean, where m is the number
of accepted drafts: row m+1 and later attended to a rejected draft, and are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ane_spec.decode.sampling import SamplingParams, accept_draft, sample, target_distribution, top2_margin
from ane_spec.runtime.pipeline import BlockOutput


@dataclass(frozen=True)
class Verdict:
    accepted: int              # m: drafts accepted
    next_token: int | None     # the correction or bonus; None when the guard wants a T=1 redo
    guard_row: int | None = None  # the row whose margin was within the backend's drift


def verify_greedy(drafts: list[int], out: BlockOutput, guard_margin: float | None) -> Verdict:
    """Longest prefix of drafts equal to the rows' argmax, plus the token of row m. Rows past
    the first mismatch are never read.

    `guard_margin` (mixed decode shape): when set and logits are known, stop at the first used
    row whose top-1/top-2 margin is within it: T=1 decoding could pick a different token there,
    so the caller recomputes that row with a T=1 pass instead of trusting the block's argmax.
    """
    m = 0
    while m < len(drafts):
        if _near_tie(out, m, guard_margin):
            return Verdict(m, None, guard_row=m)
        if out.row_argmax(m) != drafts[m]:
            break
        m += 1
    if _near_tie(out, m, guard_margin):
        return Verdict(m, None, guard_row=m)
    return Verdict(m, out.row_argmax(m))


def _near_tie(out: BlockOutput, row: int, guard_margin: float | None) -> bool:
    return (guard_margin is not None and out.has_logits
            and top2_margin(out.row_logits(row)) <= guard_margin)


def verify_sampled(drafts: list[int], out: BlockOutput, params: SamplingParams,
                   rng: np.random.Generator) -> Verdict:
    """Speculative sampling row by row; the first rejection draws the replacement and stops."""
    for i, draft in enumerate(drafts):
        accepted, replacement = accept_draft(target_distribution(out.row_logits(i), params),
                                             draft, rng)
        if not accepted:
            return Verdict(i, replacement)
    return Verdict(len(drafts), sample(target_distribution(out.row_logits(len(drafts)), params),
                                       rng))
