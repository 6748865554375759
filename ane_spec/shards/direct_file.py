"""A file written front to back past the page cache, where the OS allows it (Linux's O_DIRECT).

On the VMs this project is built and tested on, a page the guest has not touched lately costs
the host a fault, so buffered writes of fresh pages ran at ~110 MB/s of pure system time (dd:
2 GiB in 20 s, 16 s of it system; with O_DIRECT 2.3 s, 0.75 s system). A Phi-4-mini build
writes 4.3 GB of packages and embeddings that it reads only once more, to hash them
(manifests/store.py `hash_path(uncached=True)` reads past the cache too).

Direct I/O needs aligned buffers, offsets and lengths, so the bytes pass through one
page-aligned staging buffer and reach the file in whole multiples of it; at the finish the last
one is padded to a block and the file cut back to its length. A direct write returns when the
disk has the bytes, so the writes are made by a thread of the file's own (DirectFile's
docstring says what that overlaps). Where O_DIRECT is refused
(EINVAL at the open or at the first write) the same writes go through the cache. Nothing is
written through a memory map, so a full disk is an OSError here, never a SIGBUS.
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np

from ane_spec.model.direct_io import set_direct_io

# Bytes per write: a multiple of every block size O_DIRECT may require (512, 4096).
STAGE_BYTES = 8 << 20
_BLOCK = 4096
# Copied (not borrowed) bytes that may wait for the writer: past this, `append` waits for it,
# so a producer faster than the disk (the embeddings' dequantization) holds 16 MB, not a table.
OWNED_BYTES_AHEAD = 16 << 20
_STOP = object()


class _Finish:
    def __init__(self, then: Callable[[], None] | None):
        self.then = then
        self.done: Future[None] = Future()


class DirectFile:
    """Appends bytes to a new file (created or truncated); `close()` finishes it, `discard()`
    only closes it (a failed build removes its folder).

    The writes are made by a thread of the file's own, in order, while the caller goes on: a
    direct write waits for the disk (~1 GB/s here; a Phi-4-mini build writes 4.3 GB), and the
    callers have work of their own between appends (coremltools' exporter its Python, the
    embeddings their dequantization). `append(data, borrowed=True)` queues `data` itself, which
    the caller then leaves unchanged until the file is finished (the weights: nothing changes a
    program's constants); otherwise the bytes are copied first. `finish_later` lets the last
    writes go on after the caller has moved on, and says when they are done. What the writer
    fails with (a full disk) is raised by the next `append`, by `close()`, or by the finishing
    future."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = True):
        self.path = os.fspath(path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0)
        self.direct = direct and hasattr(os, "O_DIRECT")
        fd = -1
        if self.direct:
            try:
                fd = os.open(self.path, flags | os.O_DIRECT, 0o666)
            except OSError as exc:
                if exc.errno != errno.EINVAL:   # EINVAL: this filesystem has no direct I/O
                    raise
                self.direct = False
        self._fd = fd if fd >= 0 else os.open(self.path, flags, 0o666)
        self._stage = mmap.mmap(-1, STAGE_BYTES)   # page-aligned, as direct I/O needs
        self._staged = 0
        self.size = 0   # bytes appended so far, those still queued included
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._owned = threading.Condition()
        self._owned_bytes = 0
        self._error: BaseException | None = None
        self._finishing: _Finish | None = None
        self._abandoned = False   # discard(): the writer stops at its next item
        self._writer = threading.Thread(target=self._write_queued, name="direct-file",
                                        daemon=True)
        self._writer.start()

    @property
    def closed(self) -> bool:
        """No more appends: finished (or finishing), or discarded."""
        return self._finishing is not None or not self._writer.is_alive()

    def append(self, data: bytes | memoryview, *, borrowed: bool = False) -> None:
        if self.closed:
            raise ValueError(f"{self.path}: the file is closed")
        self._raise_failure()
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        if not borrowed:
            with self._owned:
                self._owned.wait_for(lambda: self._owned_bytes <= OWNED_BYTES_AHEAD
                                     or self._error is not None)
                self._raise_failure()
                self._owned_bytes += view.nbytes
            view = memoryview(bytes(view))
        self._queue.put((view, not borrowed))
        self.size += view.nbytes

    def finish_later(self, then: Callable[[], None] | None = None) -> Future[None]:
        """Finish the file once what is queued is written (the last stage padded to a whole
        block, the file cut back to its length), then run `then` (in the writer thread) and
        close it. The future ends when all that is done, or with what failed."""
        if self._finishing is None:
            if not self._writer.is_alive():
                raise ValueError(f"{self.path}: the file was discarded")
            self._finishing = _Finish(then)
            self._queue.put(self._finishing)
        return self._finishing.done

    def close(self) -> None:
        """Finish the file and wait for it; raises what the writer failed with."""
        if self._finishing is None and not self._writer.is_alive():
            return   # discarded
        try:
            self.finish_later().result()
        finally:
            self.discard()

    def discard(self) -> None:
        """Stop: what is staged or still queued is not written (a write under way ends
        first), and the file is closed; a finish not yet done fails."""
        if self._writer.is_alive():
            self._abandoned = True
            self._queue.put(_STOP)
            self._writer.join()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def _write_queued(self) -> None:
        """The writer thread: each queued view into the stage, each full stage to the file,
        until told to finish (then the last stage) or to stop; after a failure it only takes
        items off the queue. The file is closed here, whatever happens."""
        stage = np.frombuffer(self._stage, np.uint8)   # copies into it release the GIL
        try:
            while True:
                item = self._queue.get()
                if item is _STOP or self._abandoned:
                    return
                if isinstance(item, _Finish):
                    self._finish(item)
                    return
                view, owned = item
                del item
                if self._error is None:
                    try:
                        self._stage_bytes(stage, view)
                    except BaseException as exc:  # noqa: BLE001 - raised in the caller
                        self._fail(exc)
                if owned:
                    with self._owned:
                        self._owned_bytes -= view.nbytes
                        self._owned.notify_all()
                del view   # a borrowed array is the caller's to free from now on
        finally:
            del stage   # the mmap cannot close while an array exports it
            os.close(self._fd)
            self._stage.close()
            with self._owned:   # an append waiting for room sees the end
                if self._error is None:
                    self._error = ValueError(f"{self.path}: the file is closed")
                self._owned.notify_all()
            if self._finishing is not None and not self._finishing.done.done():
                self._finishing.done.set_exception(self._error)

    def _stage_bytes(self, stage: np.ndarray, view: memoryview) -> None:
        data = np.frombuffer(view, np.uint8)
        while data.size:
            n = min(data.size, STAGE_BYTES - self._staged)
            stage[self._staged:self._staged + n] = data[:n]
            self._staged += n
            data = data[n:]
            if self._staged == STAGE_BYTES:
                if self._abandoned:
                    raise ValueError(f"{self.path}: the file was discarded")
                self._write_stage(STAGE_BYTES)

    def _finish(self, finishing: _Finish) -> None:
        if self._error is None:
            staged = self._staged
            padded = -(-staged // _BLOCK) * _BLOCK if self.direct else staged
            self._stage[staged:padded] = bytes(padded - staged)
            try:
                self._write_stage(padded)
                os.ftruncate(self._fd, self.size)
                if finishing.then is not None:
                    finishing.then()
            except BaseException as exc:  # noqa: BLE001 - raised in the caller
                self._fail(exc)
        if self._error is None:
            finishing.done.set_result(None)
        else:
            finishing.done.set_exception(self._error)

    def _fail(self, exc: BaseException) -> None:
        # Kept without its traceback: the writer's frames in it hold the stage's buffer,
        # which could then not be closed; the caller's raise gives it one of its own.
        self._error = exc.with_traceback(None)

    def _write_stage(self, length: int) -> None:
        done = 0
        view = memoryview(self._stage)
        try:
            while done < length:
                try:
                    done += os.write(self._fd, view[done:length])
                except OSError as exc:
                    # a filesystem that opens with O_DIRECT but refuses its writes: buffered
                    if not (self.direct and exc.errno == errno.EINVAL):
                        raise
                    set_direct_io(self._fd, False)
                    self.direct = False
        finally:
            view.release()
        self._staged = 0
