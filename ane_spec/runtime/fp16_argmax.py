"""Argmax of a logits row, float16 without converting it to float32, and the one rule for
non-finite logits.

Greedy decoding reads one argmax per verified row, over a 200,064-token vocabulary. numpy casts
float16 to float32 at ~0.4 ms a row here and compares float16 values slower still, which is most
of a pass's host budget (1 ms). Reading the half floats as integers turns it into an integer
argmax with the same answer, ties included: the raw bits when the maximum is positive (~0.01 ms
for a contiguous 200,064 row here, the finiteness check included), else keys that sort like the
floats (~0.06 ms).

Non-finite logits are refused, on every path (`NonFiniteLogits`): a NaN or inf logit means the
build or the backend is broken, and no rule for picking a token among them would be one that
every path agrees on. numpy's argmax answers the first NaN; order keys put a negative NaN below
-inf, so an integer argmax would answer the largest finite value instead. Refusing is the one
answer every path can give; `pipeline.BlockOutput` applies it to every row it reads."""

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


# Non-finite halves on the raw bits: as int16, +inf and positive NaNs are the patterns at or
# above 0x7C00; as uint16, -inf and negative NaNs are those at or above 0xFC00.
_POS_INF_BITS, _NEG_INF_UBITS = 0x7C00, 0xFC00


def argmax(x: np.ndarray) -> int:
    """Index of the first maximum of a 1-D float array. Raises NonFiniteLogits if any value is
    NaN or +-inf.

    float16 rows are read as their int16 bits: non-negative halves order as their bits and every
    negative one has the sign bit set, so when the largest bit pattern is a positive half, its
    first index is the float argmax, and one more integer reduction checks for non-finite values.
    Rows whose maximum is zero or negative (where -0.0 and the reversed negative order matter)
    go through `order_keys`."""
    if x.dtype == np.float16:
        bits = np.ascontiguousarray(x).view(np.int16)
        i = int(bits.argmax())
        top = int(bits[i])
        if top >= _POS_INF_BITS or int(bits.view(np.uint16).max()) >= _NEG_INF_UBITS:
            raise NonFiniteLogits()
        if top > 0:
            return i
        return int(order_keys(bits.view(np.float16)).argmax())
    i = int(x.argmax())  # the first NaN, if any: numpy's argmax propagates NaN
    if not (np.isfinite(x[i]) and np.isfinite(x.min())):
        raise NonFiniteLogits()
    return i
