"""`current_rss_bytes`: what the process holds now, so it falls when memory is freed (unlike the
peak); the doctor's `state-reads` leak check depends on that."""

from __future__ import annotations

import numpy as np

from ane_spec.peak_memory import current_rss_bytes

MB = 10**6


def test_current_rss_grows_with_touched_memory_and_falls_after_freeing() -> None:
    before = current_rss_bytes()
    block = np.ones(100 * MB, dtype=np.uint8)  # np.ones writes every page: resident
    held = current_rss_bytes()
    assert held - before >= 90 * MB, (before, held)
    del block  # a block this large is its own mapping, unmapped when numpy frees it
    after = current_rss_bytes()
    assert after - before < 20 * MB, (before, held, after)
