"""An Objective-C autorelease pool around a native call, on macOS; nothing elsewhere.

coremltools 9.0 wraps `predict` and the model's load in `@autoreleasepool`, but not
`State::readState` or `State::writeState` (coremlpython/CoreMLPython.mm): the objects Core ML
autoreleases there (the MLFeatureValue that `writeState` makes of the value, through
`Utils::convertValueToObjC`, and whatever `getMultiArrayForStateNamed:handler:` makes) go to
the calling thread's pool. A Python thread has none of its own that ever drains while it runs,
so on the worker's thread each read or write could leave a state-sized object behind for the
process's life. `autorelease_pool()` pushes a pool before such a call and pops it after.

The runtime is opened with `ctypes.PyDLL`, never `CDLL`: a PyDLL call keeps the GIL, and the
pop releases the MLFeatureValue that holds the numpy array the value came from (its wrapper's
destructor does a Py_DECREF), which must happen with the GIL held.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The Objective-C runtime every macOS process has loaded (libobjc.A.dylib, in the shared cache).
OBJC_LIBRARY = "/usr/lib/libobjc.A.dylib"

_functions: tuple[Any, Any] | None = None
_opened_from: Any = None


def open_library() -> Any:
    """The runtime's library (a seam the test stand-in replaces: no libobjc off macOS)."""
    return ctypes.PyDLL(OBJC_LIBRARY)


def _pool_functions() -> tuple[Any, Any] | None:
    """objc_autoreleasePoolPush / Pop, typed (void *(void), void (void *)); None off macOS."""
    global _functions, _opened_from
    if sys.platform != "darwin":
        return None
    if _functions is None or _opened_from is not open_library:
        library = open_library()
        push, pop = library.objc_autoreleasePoolPush, library.objc_autoreleasePoolPop
        push.restype, push.argtypes = ctypes.c_void_p, []
        pop.restype, pop.argtypes = None, [ctypes.c_void_p]
        _functions, _opened_from = (push, pop), open_library
    return _functions


@contextmanager
def autorelease_pool() -> Iterator[None]:
    """An autorelease pool for the block (macOS); the pool is popped even if the block raises,
    so what the failed call autoreleased is freed too."""
    functions = _pool_functions()
    if functions is None:
        yield
        return
    push, pop = functions
    token = push()
    try:
        yield
    finally:
        pop(token)
