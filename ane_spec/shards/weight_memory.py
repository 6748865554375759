"""The build's memory pools (model/memory_pool.py says why pooled memory is faster here): one
for converted weights, reused from package to package (a shard's 1.3-1.7 GB of int8 weights
are freed once its package is written, and the next shard's take the same pages), one for the
conversion's chunk-sized float32 temporaries. Outside a build, plain np.empty.

And, for the build's duration, numpy's large arrays in 4 kB pages (`small_pages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from ane_spec.model.memory_pool import MemoryPool

_current: tuple[MemoryPool, MemoryPool] | None = None   # (weights, scratch)


def _huge_page_switch() -> Callable[[bool], bool] | None:
    """numpy's own switch for the MADV_HUGEPAGE it gives every allocation of 4 MB or more on
    Linux (`_set_madvise_hugepage`, what NUMPY_MADVISE_HUGEPAGE sets at import; it returns the
    previous setting). Private, so looked up, not assumed."""
    core = getattr(np, "_core", None) or getattr(np, "core", None)
    return getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)


@contextlib.contextmanager
def small_pages() -> Iterator[None]:
    """numpy's large allocations without MADV_HUGEPAGE while the block runs.

    A build writes each weight array once, reads it once (the writes to disk, the hash) and
    lets it go: 1.7 GB of fresh memory for Phi-4-mini's first shard. Huge pages save it page
    faults, not zeroing, and on a VM they are the dearest memory to zero: a guest with free page
    reporting (virtio-balloon's REPORTING, on for the dev VM) hands its free 2 MB blocks back to
    the host, exactly what a huge page fault takes, so each first write faults in the host
    too, while 4 kB pages come mostly from memory freed lately. perf put 17% of a Phi-4-mini
    build's CPU samples in clear_page_erms under do_huge_pmd_anonymous_page, most of them in
    the first write of the int8 weight arrays; with 4 kB pages, 0.6% (no compaction stalls
    either way). Four alternating pairs of builds: median 32.9 against 36.4 CPU s (system
    time 4.9-5.6 against 9.3-9.8 s), 20.7 against 22.2 s wall, lower in every pair. Nothing
    changes where numpy has no such switch or gives no advice (macOS).

    Only numpy's advice is withheld: heap memory an array was advised in before the block
    keeps its flag when malloc hands it out again.
    """
    switch = _huge_page_switch()
    if switch is None:
        yield
        return
    previous = switch(False)
    try:
        yield
    finally:
        switch(previous)


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
