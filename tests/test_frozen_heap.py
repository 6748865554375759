"""The build's handling of the cyclic collector: frozen heaps, paused collection, no redundant
collection in ct.convert."""

from __future__ import annotations

import gc

from coremltools.converters import _converters_entry

from ane_spec.shards.frozen_heap import collector_paused, freeze_more, frozen_heap
from ane_spec.shards.programs import _no_final_collection


def test_the_outermost_frozen_heap_unfreezes_and_inner_ones_leave_it_frozen() -> None:
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with frozen_heap():
            made = [[] for _ in range(100)]   # containers made inside an inner block
            freeze_more()
            assert gc.get_freeze_count() >= outer + len(made)
        assert gc.get_freeze_count() >= outer + len(made)   # the inner exit thawed nothing
    assert gc.get_freeze_count() == 0
    freeze_more()   # outside any block: freezes nothing
    assert gc.get_freeze_count() == 0


def test_a_failing_block_unfreezes_too() -> None:
    try:
        with frozen_heap():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.get_freeze_count() == 0


def test_the_collector_is_paused_in_the_block_and_left_as_it_was() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()   # it was off before: it stays off
    finally:
        gc.enable()


def test_ct_convert_collects_nothing_in_the_block_and_again_after() -> None:
    assert _converters_entry.gc is gc
    with _no_final_collection():
        assert _converters_entry.gc is not gc
        assert _converters_entry.gc.collect() == 0
    assert _converters_entry.gc is gc
