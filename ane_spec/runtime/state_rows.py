"""A state's first n rows along its sequence axis: read them, or write them over zeros.

A conversation of n tokens means only slots 0..n-1 of each K/V state (daemon/kv_state.py), so a
slot swap needs only those rows. A backend program may do this itself (`read_rows`,
`write_rows`: the Core ML worker slices and casts where the state lives, and builds the
zero-padded state there, so only the rows cross the process boundary); otherwise it is done
here from the whole state (`read_state`, `write_state`).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def first_rows(ndim: int, axis: int, n: int) -> tuple[slice, ...]:
    """The index of rows 0..n-1 along `axis` of an `ndim`-axis array."""
    return (slice(None),) * axis + (slice(0, n),) + (slice(None),) * (ndim - axis - 1)


def read_rows(program: Any, state: Any, name: str, n: int, axis: int | None,
              dtype: np.dtype) -> np.ndarray:
    """A fresh C-order array of state `name`'s rows 0..n-1 along `axis` (None: the whole
    state), in `dtype`."""
    native = getattr(program, "read_rows", None)
    if native is not None:
        return native(state, name, n, axis, np.dtype(dtype))
    full = program.read_state(state, name)
    rows = full if axis is None else full[first_rows(full.ndim, axis, n)]
    return np.array(rows, dtype=dtype, order="C")


def write_rows(program: Any, state: Any, name: str, rows: np.ndarray | None, n: int,
               axis: int | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Write `rows` as rows 0..n-1 along `axis` of state `name` (of `shape`) and zeros past
    them; `rows` None writes zeros throughout (a fresh state's values)."""
    native = getattr(program, "write_rows", None)
    if native is not None:
        native(state, name, rows, n, axis, shape)
        return
    full = np.zeros(shape, dtype=dtype)
    if rows is not None:
        full[first_rows(len(shape), axis, n) if axis is not None else ...] = rows
    program.write_state(state, name, full)
