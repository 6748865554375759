"""Argmax of a logits row, float16 without converting it to float32, and the one rule for
non-finite logits.

Greedy decoding reads one argmax per verified row, over a 200,064-token vocabulary. numpy casts
float16 to float32 at ~0.4 ms a row here and compares float16 values slower still, which is most
of a pass's host budget (1 ms). Reinterpreting the half floats as int16 keys that sort like
the floats turns it into an integer argmax (~0.05 ms) with the same answer, ties included.

Non-finite logits are refused, on every path (`NonFiniteLogits`): a NaN or inf logit means the
build or the backend is broken, and no rule for picking a token among them would be one that
every path agrees on. numpy's argmax answers the first NaN; the keys put a negative NaN below
-inf, so the fast path would answer the largest finite value instead; a chunked argmax compares
chunk maxima, where NaN is never greater. Refusing is the one answer all of them can give.
"""

from __future__ import annotations

import numpy as np

from ane_spec.errors import AneSpecError


class NonFiniteLogits(AneSpecError):
    """A logits row holds NaN or inf: no token can be chosen from it."""

    def __init__(self, where: str = "a logits row") -> None:
        super().__init__(f"{where} holds non-finite logits (NaN or inf): the build or the "
                         "backend is broken (`ane-spec probe parity` and `probe overflow` say "
                         "which); refusing to choose a token from it")


def order_keys(x: np.ndarray) -> np.ndarray:
    """int16 keys ordered exactly as the float16 values of `x` (NaN aside).

    Non-negative halves already order as their bit patterns. Negative ones order backwards, so
    their 15 magnitude bits are flipped; that puts -0.0 one below +0.0, and adding 1 to every
    negative key makes them equal, as the floats are. Equal keys <=> equal values, so the first
    maximal key is where np.argmax of the float values points. A positive NaN keys above +inf,
    a negative NaN below -inf."""
    bits = np.ascontiguousarray(x, dtype=np.float16).view(np.int16)
    sign = bits >> 15  # -1 for negative halves, 0 otherwise
    return (bits ^ (sign & np.int16(0x7FFF))) - sign


# Every key at or above +inf's, or at or below -inf's, is a non-finite half.
_POS_INF_KEY, _NEG_INF_KEY = (int(k) for k in order_keys(np.array([np.inf, -np.inf])))


def argmax(x: np.ndarray) -> int:
    """Index of the first maximum of a 1-D float array; float16 goes through `order_keys`.
    Raises NonFiniteLogits if any value is NaN or +-inf."""
    if x.dtype == np.float16:
        keys = order_keys(x)
        i = int(keys.argmax())
        if keys[i] >= _POS_INF_KEY or keys.min() <= _NEG_INF_KEY:
            raise NonFiniteLogits()
        return i
    i = int(x.argmax())  # the first NaN, if any: numpy's argmax propagates NaN
    if not (np.isfinite(x[i]) and np.isfinite(x.min())):
        raise NonFiniteLogits()
    return i


def require_finite(x: np.ndarray, where: str = "a logits row") -> None:
    """Raise NonFiniteLogits unless every value of `x` is finite. min and max propagate NaN, and
    are cheaper than a full isfinite mask (two reductions, no array)."""
    if x.size and not (np.isfinite(x.max()) and np.isfinite(x.min())):
        raise NonFiniteLogits(where)


def chunked_argmax(parts: list[tuple[int, np.ndarray]]) -> int:
    """Global argmax over a row split into chunks (start offset, values): the first chunk that
    holds the maximum wins, as a global argmax's first index would. Every chunk is checked."""
    best, best_value = -1, None
    for start, values in parts:
        i = argmax(values)
        value = values[i]
        if best_value is None or value > best_value:
            best, best_value = start + i, value
    return best
