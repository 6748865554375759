"""Token choice: greedy by default, or temperature/top-k/top-p/min-p sampling with a seed, after
llama.cpp's logit processors (logit bias, ignore_eos, repetition/presence/frequency penalties).

Every processor is a deterministic function of a row's logits and of the tokens before that row
(the committed history plus the drafts the row was computed after). Verification applies the same
function to every row it reads, so speculative greedy decoding still equals plain greedy decoding
token for token, and speculative sampling still has exactly the plain sampler's distribution.

With speculation, sampling uses exact speculative sampling for deterministic drafts: draft x is
accepted with probability p(x); on rejection the token is drawn from p with x removed and
renormalised. Each emitted token then has exactly the distribution plain sampling gives it.

Order (llama.cpp's chain for the parts that move logits, then the truncations): logit bias,
ignore_eos, penalties over the last `repeat_last_n` tokens, grammar mask; then temperature, top-k,
top-p, min-p. Temperature comes first, as in HF and vLLM (llama.cpp's default chain applies it
last): top-p and min-p see the tempered distribution, as they did here before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ane_spec.errors import AneSpecError

MAX_LOGIT_BIAS = 100.0  # OpenAI's range; -100 bans a token in practice, and so does -inf here


class NoTokenLeft(AneSpecError):
    """Every token's logit is -inf: banned by logit_bias or masked by the grammar."""

    def __init__(self) -> None:
        super().__init__("logit_bias and the grammar together leave no token that may come next")


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0: off (llama.cpp's <= 0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(1.0, gt=0.0, le=100.0)  # 1: off
    repeat_last_n: int = Field(64, ge=0)  # the penalties' window (llama.cpp's default 64)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit; -inf bans)
    ignore_eos: bool = False
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0
                                           or self.presence_penalty != 0.0
                                           or self.frequency_penalty != 0.0)

    @property
    def logit_edits(self) -> list[str]:
        """The fields whose processors move logits, in the processors' order (top-k/top-p/min-p
        never move the argmax)."""
        names = [n for n, on in (("logit_bias", bool(self.logit_bias)),
                                 ("ignore_eos", self.ignore_eos)) if on]
        if self.penalized:
            names += [n for n, off in (("repeat_penalty", 1.0), ("presence_penalty", 0.0),
                                       ("frequency_penalty", 0.0)) if getattr(self, n) != off]
        return names

    @property
    def edits_logits(self) -> bool:
        return bool(self.logit_edits)


class LogitProcessor:
    """The history-dependent part of `SamplingParams`, bound to a vocabulary's end-of-generation
    ids. `apply` returns new float32 logits; the input row is never modified."""

    def __init__(self, params: SamplingParams, eog_ids: Sequence[int]):
        self.params = params
        self.bias_ids = np.array([t for t, _ in params.logit_bias], dtype=np.int64)
        self.bias_values = np.array([b for _, b in params.logit_bias], dtype=np.float32)
        self.eog_ids = np.array(sorted(eog_ids), dtype=np.int64)
        self._bias_set = frozenset(self.bias_ids.tolist())
        self._eog_set = frozenset(self.eog_ids.tolist())

    @property
    def window(self) -> int:
        return self.params.repeat_last_n if self.params.penalized else 0

    @cached_property  # asked on every verified row; the params are frozen
    def only_lowers(self) -> bool:
        """Whether no processor can raise a logit (the usual settings): a non-positive bias,
        ignore_eos's -inf, and penalties that divide positive logits, multiply negative ones by
        at least 1 and subtract non-negative amounts; in float32 each result is <= its input."""
        p = self.params
        return bool((self.bias_values <= 0).all()) and (not p.penalized or (
            p.repeat_penalty >= 1.0 and p.frequency_penalty >= 0.0
            and p.presence_penalty >= 0.0))

    def touches(self, token: int, recent: Sequence[int]) -> bool:
        """Whether `edits` would edit `token`'s logit after `recent`."""
        if token in self._bias_set or (self.params.ignore_eos and token in self._eog_set):
            return True
        if not self.params.penalized or token not in recent:
            return False
        # Only a history longer than the window (the chooser keeps just the window) needs a cut.
        n = self.params.repeat_last_n
        return len(recent) <= n or token in list(recent)[-n:]

    def apply(self, logits: np.ndarray, recent: Sequence[int]) -> np.ndarray:
        """`recent`: the last `window` tokens before this row (prompt included, as llama-server
        feeds the prompt to its penalties sampler)."""
        z = np.array(logits, dtype=np.float32)
        ids, values = self.edits(lambda ids: z[ids], recent)
        z[ids] = values
        return z

    def edits(self, values_at: Callable[[np.ndarray], np.ndarray],
              recent: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The processors as (ids, new float32 logits): every other logit is left as it is.
        `values_at(ids)` reads the row's logits there. The few ids they touch (the bias, the
        end-of-generation ids, the window's distinct tokens) are all that is read or computed,
        with the same float32 operations `apply` does on the whole row."""
        p = self.params
        parts = [self.bias_ids]
        if p.ignore_eos:
            parts.append(self.eog_ids)
        window = counts = None
        if p.penalized and len(recent):
            window, counts = np.unique(np.fromiter(recent, dtype=np.int64, count=len(recent))
                                       [-p.repeat_last_n:], return_counts=True)
            parts.append(window)
        ids = np.unique(np.concatenate(parts))
        z = np.asarray(values_at(ids), dtype=np.float32).copy()
        if len(self.bias_ids):
            np.add.at(z, np.searchsorted(ids, self.bias_ids), self.bias_values)
        if p.ignore_eos:
            z[np.searchsorted(ids, self.eog_ids)] = -np.inf
        if window is not None:
            at = np.searchsorted(ids, window)
            v = z[at]
            # llama.cpp's penalties sampler: divide a positive logit, multiply a negative one
            # (dividing would make it likelier), then subtract the OpenAI-style penalties.
            v = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
            v -= counts.astype(np.float32) * p.frequency_penalty + p.presence_penalty
            z[at] = v
        return ids, z


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p over the vocabulary after temperature, top-k, top-p and min-p (float64, sums to 1).
    Logits of -inf (masked tokens) get probability 0."""
    z = logits.astype(np.float64)
    top = z.max()
    if top == -np.inf:
        raise NoTokenLeft()
    # Shift, then scale: the largest is 0 whatever the temperature, so a tiny one (5e-324)
    # sends the others to -inf (probability 0), the greedy limit, instead of inf - inf = NaN.
    with np.errstate(over="ignore", divide="ignore"):
        z = (z - top) / params.temperature
    p = np.exp(z)
    p /= p.sum()
    if 0 < params.top_k < len(p):
        # Exactly k survivors; argpartition is O(V) where a sort would be O(V log V).
        drop = np.argpartition(-p, params.top_k - 1)[params.top_k:]
        p[drop] = 0.0
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = order[: int(np.searchsorted(cumulative, params.top_p) + 1)]
        kept = np.zeros_like(p)
        kept[keep] = p[keep]
        p = kept / kept.sum()
    if params.min_p > 0.0:
        # llama.cpp's min-p: drop tokens less likely than min_p times the likeliest one.
        p[p < params.min_p * p.max()] = 0.0
        p /= p.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(len(p), p=p))


def accept_draft(p: np.ndarray, draft: int, rng: np.random.Generator) -> tuple[bool, int | None]:
    """Speculative sampling for one deterministic draft token.

    Returns (accepted, replacement): on rejection, the replacement is drawn from p with the draft
    removed. P(emit y) = p(x)[y == x] + (1 - p(x)) * p(y)/(1 - p(x)) [y != x] = p(y).
    """
    px = float(p[draft])
    if rng.random() < px:
        return True, None
    residual = p.copy()
    residual[draft] = 0.0
    total = residual.sum()
    if total <= 0.0:  # p was a point mass on the draft; rng.random() < 1 always accepts it
        return True, None
    return False, sample(residual / total, rng)


def accept_draft_q(p: np.ndarray, q: np.ndarray, draft: int,
                   rng: np.random.Generator) -> tuple[bool, int | None]:
    """Speculative sampling for a draft x drawn from the draft model's distribution q
    (Leviathan et al. 2023; Chen et al. 2023): accept with probability min(1, p(x) / q(x)); on
    rejection draw from the residual (p - q)+, normalised. Then P(emit y) = min(p(y), q(y)) +
    (1 - sum_z min(p(z), q(z))) (p(y) - q(y))+ / sum_z (p(z) - q(z))+ = p(y).

    A q that is a point mass on x is `accept_draft` (the residual is p without x)."""
    px, qx = float(p[draft]), float(q[draft])
    if qx <= 0.0:  # x could not have been drawn from q: never trust it
        accept = False
    else:
        accept = rng.random() < min(1.0, px / qx)
    if accept:
        return True, None
    residual = np.maximum(p - q, 0.0)
    total = residual.sum()
    if total <= 0.0:  # p <= q everywhere means p == q: rng.random() < 1 always accepts
        return True, None
    return False, sample(residual / total, rng)


def token_logprobs(logits: np.ndarray, token: int,
                   top_n: int) -> tuple[float, list[tuple[int, float]]]:
    """log p(token) under softmax(logits), and the top_n likeliest tokens with theirs."""
    z = logits.astype(np.float64)
    z -= z.max()
    logp = z - np.log(np.exp(z).sum())
    top: list[tuple[int, float]] = []
    if top_n:
        best = np.argpartition(-logp, top_n - 1)[:top_n]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = [(int(t), float(logp[t])) for t in best]
    return float(logp[token]), top


def top2_margin(row: np.ndarray) -> float:
    """top-1 minus top-2 logit: how far a row's argmax is from flipping."""
    best = int(row.argmax())
    top = row[best]
    row = row.copy()
    row[best] = -np.inf
    return float(top - row.max())
