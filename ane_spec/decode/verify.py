"""Block verification: which drafts a pass accepts and which token comes next.

A pass feeds [pending, d1, .., dk] at slots p..p+k. Row i predicts slot p+i+1, so row i checks
draft d(i+1) and the last row offers a bonus token. Only rows 0..m are clean, where m is the number
of accepted drafts: row m+1 and later attended to a rejected draft, and are never read.

A `RowChooser` turns a row into a token the same way for every row: the logit processors and the
grammar see the committed tokens plus the drafts before that row, which is what plain decoding
would have committed at that point. Verification walks the rows in order and `advance`s the
chooser with each token it commits, so row i+1 is judged after draft i exactly as plain decoding
would judge the token after it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ane_spec.decode.grammar import GrammarState
from ane_spec.decode.sampling import (
    LogitProcessor, NoTokenLeft, SamplingParams, accept_draft, accept_draft_q, sample,
    target_distribution, top2_margin,
)
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.runtime.row_keys import EXCLUDED, excluded_argmax


@dataclass(frozen=True)
class Verdict:
    accepted: int              # m: drafts accepted
    next_token: int | None     # the correction or bonus; None when the guard wants a T=1 redo
    guard_row: int | None = None  # the row whose margin was within the backend's drift


class RowChooser:
    """One generation's way from a row of logits to a token, and the tokens it depends on.

    With no processor and no grammar it is stateless and reads only each row's argmax (a
    --head-argmax build has nothing else)."""

    def __init__(self, params: SamplingParams = SamplingParams(), *,
                 eog_ids: Sequence[int] = (), history: Sequence[int] = (),
                 grammar: GrammarState | None = None):
        self.params = params
        self.eog = frozenset(eog_ids)
        self.processor = LogitProcessor(params, eog_ids) if params.edits_logits else None
        self.grammar = grammar
        window = self.processor.window if self.processor else 0
        self.recent: deque[int] | None = (deque(history[-window:], maxlen=window)
                                          if window else None)

    @property
    def plain(self) -> bool:
        return self.processor is None and self.grammar is None

    def logits(self, out: BlockOutput, i: int) -> np.ndarray:
        """Row i after the processors and the grammar mask (a new float32 array)."""
        row = out.row_logits(i)
        z = (self.processor.apply(row, self.recent or ()) if self.processor is not None
             else np.array(row, dtype=np.float32))
        if self.grammar is not None:
            self.grammar.apply(z)
        return z

    def argmax(self, out: BlockOutput, i: int) -> int:
        """`int(self.logits(out, i).argmax())`, first index on ties, computed without that
        float32 row (see `_processed_argmax`)."""
        best = out.row_argmax(i)  # the raw winner (and the row's NaN check)
        if self.plain:
            return best
        allowed = self.grammar is None or self.grammar.allows(best)
        if self.processor is None:
            # Grammar only: a masked argmax keeps the first maximum, as np.argmax does, so an
            # allowed raw winner is the answer: one bit test instead of a [V] mask.
            return best if allowed else self._processed_argmax(out, i, *_NO_EDITS)
        if allowed and self.processor.only_lowers and not self.processor.touches(
                best, self.recent or ()):
            # Every edit lowers a logit or leaves it: an edited id before the raw winner was
            # already below it, one after it at most ties and loses the tie.
            return best
        ids, values = self.processor.edits(lambda at: out.row_values(i, at), self.recent or ())
        if self.grammar is not None:
            keep = self.grammar.allows_ids(ids)
            ids, values = ids[keep], values[keep]
        if allowed and best not in ids:
            # The raw winner is untouched and allowed: it is the first maximum of every token
            # the processors leave alone, so only the edited ids can beat it.
            return _winner(best, out.row_values(i, np.array([best]))[0], ids, values)
        return self._processed_argmax(out, i, ids, values)

    def _processed_argmax(self, out: BlockOutput, i: int, ids: np.ndarray,
                          values: np.ndarray) -> int:
        """The processed row's argmax in two parts: the tokens no processor touches keep their
        logits, so their best is the first maximum of the head's row with the edited (`ids`) and
        forbidden tokens excluded (`row_keys.excluded_argmax`, on integers; or, where the grammar
        allows few tokens, among those tokens' logits alone); the edited tokens the grammar
        allows are compared by their new `values`."""
        few = None if self.grammar is None else self.grammar.allowed_ids()
        if few is not None:
            # Few tokens allowed: their logits, in id order, minus the edited ones.
            left = few[~np.isin(few, ids, assume_unique=True)]
            if not len(left):
                return _winner(-1, np.float32(-np.inf), ids, values)
            scores = out.row_values(i, left)
            j = int(scores.argmax())  # the first maximum: ids increase
            return _winner(int(left[j]), scores[j], ids, values)

        def exclude(keys: np.ndarray) -> None:
            keys[ids] = EXCLUDED
            if self.grammar is not None:
                self.grammar.exclude(keys)

        best = excluded_argmax(out.row_native(i), exclude)
        if best is None:
            return _winner(-1, np.float32(-np.inf), ids, values)
        return _winner(best, out.row_values(i, np.array([best]))[0], ids, values)

    def distribution(self, out: BlockOutput, i: int) -> np.ndarray:
        row = out.row_logits(i) if self.plain else self.logits(out, i)
        return target_distribution(row, self.params)

    def advance(self, token: int) -> None:
        """Commit `token` (an accepted draft or the pass's next token)."""
        if self.recent is not None:
            self.recent.append(token)
        if self.grammar is not None and token not in self.eog:
            self.grammar.advance(token)


_NO_EDITS = (np.empty(0, dtype=np.int64), np.empty(0, dtype=np.float32))


def _winner(best: int, value: np.float32, ids: np.ndarray, values: np.ndarray) -> int:
    """The larger of the untouched tokens' best (`best`, `value`) and the edited ones, the lower
    id on a tie, as np.argmax of the whole processed row; NoTokenLeft when that is -inf."""
    if len(values):
        j = int(values.argmax())
        if values[j] > value or (values[j] == value and ids[j] < best):
            best, value = int(ids[j]), values[j]
    if value == -np.inf:  # every token is banned or forbidden
        raise NoTokenLeft()
    return best


def verify_greedy(drafts: list[int], out: BlockOutput, guard_margin: float | None,
                  chooser: RowChooser | None = None) -> Verdict:
    """Longest prefix of drafts equal to the rows' (processed) argmax, plus the token of row m.
    Rows past the first mismatch are never read. The chooser is advanced with every token the
    verdict commits (accepted drafts, then the next token).

    `guard_margin` (mixed decode shape): when set and logits are known, stop at the first used
    row whose top-1/top-2 margin is within it: T=1 decoding could pick a different token there,
    so the caller recomputes that row with a T=1 pass instead of trusting the block's argmax
    (the chooser then holds the accepted drafts, not the redone token).
    """
    choose = chooser or RowChooser()
    m = 0
    while m < len(drafts):
        if _near_tie(out, m, guard_margin):
            return Verdict(m, None, guard_row=m)
        if choose.argmax(out, m) != drafts[m]:
            break
        choose.advance(drafts[m])
        m += 1
    if _near_tie(out, m, guard_margin):
        return Verdict(m, None, guard_row=m)
    token = choose.argmax(out, m)
    choose.advance(token)
    return Verdict(m, token)


def _near_tie(out: BlockOutput, row: int, guard_margin: float | None) -> bool:
    return (guard_margin is not None and out.has_logits
            and top2_margin(out.row_logits(row)) <= guard_margin)


def verify_sampled(drafts: list[int], out: BlockOutput, params: SamplingParams,
                   rng: np.random.Generator, chooser: RowChooser | None = None,
                   q: Sequence[np.ndarray] | None = None) -> Verdict:
    """Speculative sampling row by row; the first rejection draws the replacement and stops.
    `q[i]`: the distribution a draft model drew drafts[i] from; without it a draft is a
    deterministic guess (a point mass)."""
    choose = chooser or RowChooser(params)
    for i, draft in enumerate(drafts):
        p = choose.distribution(out, i)
        accepted, replacement = (accept_draft(p, draft, rng) if q is None
                                 else accept_draft_q(p, q[i], draft, rng))
        if not accepted:
            choose.advance(replacement)
            return Verdict(i, replacement)
        choose.advance(draft)
    token = sample(choose.distribution(out, len(drafts)), rng)
    choose.advance(token)
    return Verdict(len(drafts), token)
