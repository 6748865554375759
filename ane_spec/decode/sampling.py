"""Token choice: greedy by default, or temperature/top-p sampling with a seed.

With speculation, sampling uses exact speculative sampling for deterministic drafts: draft x is
accepted with probability p(x); on rejection the token is drawn from p with x removed and
renormalised. Each emitted token then has exactly the distribution plain sampling gives it.
"""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True)

    temperature: float = Field(0.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """p over the vocabulary after temperature and top-p (float64, sums to 1)."""
    z = logits.astype(np.float64) / params.temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cumulative = np.cumsum(p[order])
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = order[: int(np.searchsorted(cumulative, params.top_p) + 1)]
        kept = np.zeros_like(p)
        kept[keep] = p[keep]
        p = kept / kept.sum()
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


def top2_margin(row: np.ndarray) -> float:
    """top-1 minus top-2 logit: how far a row's argmax is from flipping."""
    best = int(row.argmax())
    top = row[best]
    row = row.copy()
    row[best] = -np.inf
    return float(top - row.max())
