"""The build's memory pools (model/memory_pool.py says why pooled memory is faster here): one
for converted weights, reused from package to package (a shard's 1.3-1.7 GB of int8 weights
are freed once its package is written, and the next shard's take the same pages), one for the
conversion's chunk-sized float32 temporaries. Outside a build, plain np.empty.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np

from ane_spec.model.memory_pool import MemoryPool

_current: tuple[MemoryPool, MemoryPool] | None = None   # (weights, scratch)


@contextlib.contextmanager
def reused_weight_memory() -> Iterator[MemoryPool]:
    """For the duration of a build: `empty` allocates from one pool and `scratch` from another
    (they are dropped at the end). Yields the weights' pool."""
    global _current
    previous, _current = _current, (MemoryPool(), MemoryPool())
    try:
        yield _current[0]
    finally:
        _current = previous


def trim() -> None:
    """MemoryPool.trim on the current build's weights pool, if there is one."""
    if _current is not None:
        _current[0].trim()


def empty(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty, or the current build's pooled memory for converted weights."""
    return np.empty(shape, dtype) if _current is None else _current[0].empty(shape, dtype)


def scratch(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """np.empty, or the current build's pooled memory for a conversion's temporaries: a few
    chunk-sized float32 arrays per thread, dropped after each row chunk and taken again by the
    next (kept apart from the weights' pool, whose buffers they would otherwise split)."""
    return np.empty(shape, dtype) if _current is None else _current[1].empty(shape, dtype)
