"""Conversions without scanning the whole heap: the objects that exist before them are frozen out
of the cyclic garbage collector while they run.

Every package costs full collections: `ct.convert` ends with `gc.collect()`, and the build
frees each package's MIL program with one (`build._save_checked`: a program is a web of
reference cycles). A full collection walks every container object the process holds, whatever
the conversion made: in a process that has imported torch, coremltools and the daemon's stack
(420,000 objects) one took 0.3-2.2 s on this machine, so a tiny model's package paid more for
collections than for converting, and a Phi-4-mini-shaped build paid 6 of 59 s.

`gc.freeze()` moves everything alive into a generation the collector skips; objects made
afterwards (the programs) are still collected, and frozen ones are still freed by reference
counting. Only cycles among frozen objects wait for `gc.unfreeze()` at the end.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

# Whether a `frozen_heap` block is open. Kept here because `gc.get_freeze_count()` counts the
# frozen objects one by one: 35 ms a call over the ~300,000 a build freezes after its imports.
_frozen = False
_lock = threading.Lock()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what exists now for the block's duration. Nested or concurrent uses leave the
    outermost one to unfreeze: an inner unfreeze would thaw the outer block's objects too."""
    global _frozen
    with _lock:
        outermost = not _frozen
        if outermost:
            gc.freeze()
            _frozen = True
    if not outermost:
        yield
        return
    try:
        yield
    finally:
        with _lock:
            gc.unfreeze()
            _frozen = False


def freeze_more() -> None:
    """Inside a `frozen_heap` block: freeze what has been made since that is long-lived too."""
    with _lock:
        if _frozen:
            gc.freeze()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection in the block: for imports, which make hundreds of thousands of
    long-lived objects and nothing to collect, and whose growing heap the collector walked
    again and again (coremltools' and torch's: ~0.6 s of a 2.3 s import, its whole gen-2
    share). The collector is enabled again after, as it was."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
