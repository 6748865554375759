"""`current_rss_bytes`: what the process holds now, so it falls when memory is freed (unlike the
peak); the doctor's `state-reads` leak check depends on that."""

from __future__ import annotations

import numpy as np

from ane_spec.peak_memory import current_rss_bytes

MB = 10**6


def test_current_rss_grows_with_touched_memory_and_falls_after_freeing() -> None:
    """The block is an anonymous mapping of its own, unmapped when closed. A numpy array of the
    same size is one too as a rule, but not always: late in a full run, a worker holding 7 GB
    got its 100 MB from malloc's heap, which kept the pages after the free."""
    import mmap

    before = current_rss_bytes()
    block = mmap.mmap(-1, 100 * MB)
    np.frombuffer(block, np.uint8)[:] = 1   # every page written: resident
    held = current_rss_bytes()
    assert held - before >= 90 * MB, (before, held)
    block.close()
    after = current_rss_bytes()
    assert after - before < 20 * MB, (before, held, after)
