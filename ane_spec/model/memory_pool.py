"""Arrays whose memory is reused once nothing refers to them.

On the VMs this project is built and tested on, memory the guest has freed goes back to the
host, and the next first touch of each page costs a host fault (perf: `clear_page_erms` under
the numpy op that first writes a fresh array). Zeroing a Phi-4-mini build's fresh pages took
more system time than the whole numpy requantization pass the build is measured against. A
loop that takes its large arrays from a pool touches warm pages after its first round.

Reuse must never hand out memory an array still reads. Each hand-out is a view of an "owner"
array made with np.frombuffer over the pooled buffer; numpy sets every view's base to the first
array up the chain whose own base is not an array, so every view of the hand-out, and every
view of those (torch.from_numpy's tensors hold the array they share), refers to the owner
itself. A buffer whose owner nothing but the pool refers to has no live array left: only such
buffers are reused. Anything else is left alone and checked again at the next allocation.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

# Smaller arrays come from malloc's own heap, which keeps and reuses its pages already.
MIN_POOLED_BYTES = 1 << 20


class MemoryPool:
    """Buffers handed out as arrays, reused once no array refers to them."""

    def __init__(self) -> None:
        self._buffers: list[tuple[np.ndarray, list[np.ndarray]]] = []   # buffer, [its owner]
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """An uninitialised array, in the smallest free pooled buffer that holds it, or in a new
        one."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes < MIN_POOLED_BYTES:
            return np.empty(shape, dtype)
        with self._lock:
            free = [(buf.nbytes, n) for n, (buf, handle) in enumerate(self._buffers)
                    if buf.nbytes >= nbytes and _unreferenced(handle)]
            if free:
                _, n = min(free)
                buffer, handle = self._buffers[n]
            else:
                buffer, handle = np.empty(nbytes, np.uint8), []
                self._buffers.append((buffer, handle))
            # A new owner per hand-out: every array and view of it refers to this object.
            handle[:] = [np.frombuffer(memoryview(buffer)[:nbytes], np.uint8)]
            return handle[0].view(dtype).reshape(shape)

    def trim(self) -> None:
        """Drop the buffers no array refers to, when what comes next will not reuse them (the
        build's LM head chunks are larger than any layer's matrix): a pool must not raise a
        peak with memory it holds for nothing."""
        with self._lock:
            self._buffers = [(buf, h) for buf, h in self._buffers if not _unreferenced(h)]

    def pooled_bytes(self) -> int:
        return sum(buf.nbytes for buf, _ in self._buffers)


def _unreferenced(handle: list[np.ndarray]) -> bool:
    """Nothing but the pool refers to this buffer's owner (or it was never handed out).
    getrefcount counts the list's reference and its own argument's."""
    return not handle or sys.getrefcount(handle[0]) <= 2
