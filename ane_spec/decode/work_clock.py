"""This thread's CPU time, less what the garbage collector spent in it.

The grammar cost guard (session.py) charges a grammar the thread CPU time of its matcher calls.
A collection that an allocation inside one of them happens to trigger runs in that thread too:
in a process with a large heap a full collection takes tenths of a second, which the guard read
as a grammar costing 57 ms a token (0.25 ms measured alone) and refused a valid request (a test
server inside a test worker that had run hundreds of tests). The collector's time is counted
per thread through `gc.callbacks` and left out.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_in_gc = threading.local()   # per thread: `started` (during a collection) and `seconds` (total)


def _count_collections(phase: str, _info: dict[str, Any]) -> None:
    now = time.thread_time()
    if phase == "start":
        _in_gc.started = now
    elif (started := getattr(_in_gc, "started", None)) is not None:
        _in_gc.seconds = getattr(_in_gc, "seconds", 0.0) + now - started
        _in_gc.started = None


gc.callbacks.append(_count_collections)


def work_seconds() -> float:
    """This thread's CPU seconds so far, less its garbage collections'."""
    return time.thread_time() - getattr(_in_gc, "seconds", 0.0)


def timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    """`fn(*args)` and the work seconds it took in this thread."""
    start = work_seconds()
    result = fn(*args)
    return result, work_seconds() - start
