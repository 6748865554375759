"""Unsigned integer keys that order exactly as a row's float logits, for masked argmaxes.

A constrained or penalised greedy choice is the argmax of a row with a few logits edited and
others excluded. Building that row in float32 costs a conversion and two copies of 200,064 values
per read row; the keys cost a gather and a few integer passes, an excluded token is a 0 key
(no float value has key 0), and the integer argmax is the float argmax, first index on ties.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

# float dtype -> (signed bits, unsigned key type)
_BITS = {np.dtype(np.float16): (np.int16, np.uint16), np.dtype(np.float32): (np.int32, np.uint32)}
EXCLUDED = 0


def unsigned_keys(x: np.ndarray) -> np.ndarray:
    """Keys (a new array) with key(a) < key(b) <=> a < b and key(a) == key(b) <=> a == b for the
    float16/float32 values of `x`, NaN aside; never EXCLUDED.

    Non-negative floats order as their bit patterns; negative ones backwards, so their magnitude
    bits are flipped and 1 added (which also makes -0.0 meet +0.0). The result lies in
    [MIN + 1, MAX] as a signed integer (MIN + 1: a negative NaN); flipping the sign bit maps that
    order onto the unsigned one and leaves 0 unused."""
    signed, unsigned = _BITS[x.dtype]
    info = np.iinfo(signed)
    bits = np.ascontiguousarray(x).view(signed)
    sign = bits >> (8 * bits.itemsize - 1)  # -1 for negative values, 0 otherwise
    keys = sign & signed(info.max)
    keys ^= bits
    keys -= sign
    keys ^= signed(info.min)
    return keys.view(unsigned)


def excluded_argmax(row: np.ndarray, exclude: Callable[[np.ndarray], object]) -> int | None:
    """First index of the largest value of a finite float16/float32 `row` among the entries
    `exclude` leaves, or None when it leaves none. `exclude(a)` sets the excluded entries of an
    integer copy of the row to EXCLUDED, in place.

    Usually one pass over the raw bits: non-negative floats order as their bits and negative ones
    have the sign bit set, so when the best bit pattern left is a positive value it is the
    answer (excluded entries, now 0, and the values <= 0 all lie below it). Only when nothing
    positive is left do the full order keys decide."""
    signed, _ = _BITS[row.dtype]
    bits = row.view(signed).copy()
    exclude(bits)
    best = int(bits.argmax())
    if bits[best] > 0:
        return best
    keys = unsigned_keys(row)
    exclude(keys)
    best = int(keys.argmax())
    return None if keys[best] == EXCLUDED else best
