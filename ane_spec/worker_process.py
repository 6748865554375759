"""One small mechanism for native code that can crash or hold the GIL: a worker process.

Core ML's native bridge holds the GIL for every call (coremltools 9.0 binds `predict`, the
model's load, `read_state` and `write_state` as plain pybind `.def`s, with no
`gil_scoped_release`: coremlpython/CoreMLPython.mm), including the minutes a Phi-size build
spends specialising on its first prediction; and a failed ANE compile is silent until the first
prediction kills the process (coremltools #2758). Inside a server, either would stall every
thread or take the server down. So such code runs in a worker process, and this module is the
only way the package starts one:

- **spawn**, never fork: Core ML and the Objective-C runtime are not fork-safe.
- **warm**: the worker is started once and serves calls until closed; what it loaded stays
  loaded. `on_start` (the owner's hook) replays what a fresh worker needs after a restart.
- **talk**: a call is one message on a pipe (method name and small arguments); per-pass arrays
  travel through shared memory (`SharedArrays`), never through the pipe. The calling thread
  waits in `recv`, which releases the GIL, so the caller's other threads (an HTTP event loop)
  run meanwhile.
- **notice a death**: a worker that dies mid-call (a signal, an abort, an exit) closes its end
  of the pipe; the call raises `WorkerDied`, naming how it died and during what.
- **restart**: the next call starts a fresh worker (`restarts` counts them) and runs
  `on_start` first.
- **report**: `health()` says whether it runs, its pid, how many restarts, and the last death.

The child runs `factory(channel)` once to build its handler, then answers calls with the
handler's methods. Exceptions raised there come back as the same type where they can be
pickled (a `RuntimeError` from Core ML's bridge stays a `RuntimeError`).
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import multiprocessing
import multiprocessing.util  # noqa: F401 - its exit hook must be registered before ours
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError

log = logging.getLogger("ane_spec.worker")

JOIN_SECONDS = 10.0
_live: weakref.WeakSet[WorkerProcess] = weakref.WeakSet()


class WorkerDied(AneSpecError):
    """The worker process died during a call. `how`: "signal 9 (SIGKILL)", "exit code 1"."""

    def __init__(self, worker: str, how: str, during: str, details: dict[str, Any]):
        super().__init__(f"the {worker} process died ({how}) during {during}")
        self.worker, self.how, self.during, self.details = worker, how, during, details


class RemoteError(AneSpecError):
    """An exception raised in the worker that could not be sent back as itself."""


# --- shared memory ---------------------------------------------------------------------------

def _attach(name: str):
    """Attach to a block another process created, without handing it to this process's
    resource tracker (before Python 3.13 attaching registers the block, and the tracker would
    unlink it, or warn about it, when this process exits: the creator owns it)."""
    from multiprocessing import resource_tracker, shared_memory

    if sys.version_info >= (3, 13):
        return shared_memory.SharedMemory(name, track=False)
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name)
    finally:
        resource_tracker.register = register


class Slab:
    """One shared-memory block, created by the parent. Arrays handed out of it are leased:
    each lease is a ctypes window onto the block that every array made from it keeps alive
    (numpy collapses a view's base to the first non-array object), so the slab is free again
    exactly when no such array remains."""

    def __init__(self, size: int):
        from multiprocessing import shared_memory

        self.size = max(int(size), 4096)
        self.shm = shared_memory.SharedMemory(create=True, size=self.size)
        self.name = self.shm.name
        self._leases: list[Any] = []

    def lease(self, nbytes: int) -> Any:
        window = (ctypes.c_char * max(nbytes, 1)).from_buffer(self.shm.buf)
        self._leases.append(window)
        return window

    @property
    def free(self) -> bool:
        # 3 = the list's reference, the loop's and getrefcount's argument: no array holds it.
        self._leases = [w for w in self._leases if sys.getrefcount(w) > 3]
        return not self._leases

    def close(self) -> None:
        self._leases = []
        close_shared(self.shm)
        try:
            self.shm.unlink()
        except FileNotFoundError:
            pass


def close_shared(shm: Any) -> None:
    """Close a block's mapping, or, where an array still views it, leave the mapping to the
    process's end (the name can still be unlinked) without SharedMemory's __del__ retrying."""
    try:
        shm.close()
    except BufferError:
        shm.close = lambda: None


@dataclass(frozen=True)
class ArraySpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    fortran: bool


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def layout(arrays: dict[str, np.ndarray], fortran: bool = False) -> tuple[list[ArraySpec], int]:
    specs, offset = [], 0
    for name, a in arrays.items():
        specs.append(ArraySpec(name, a.dtype.str, tuple(a.shape), offset, fortran))
        offset = _align(offset + a.nbytes)
    return specs, offset


def write_arrays(buf: Any, arrays: dict[str, np.ndarray], specs: list[ArraySpec]) -> None:
    for spec in specs:
        np.copyto(view(buf, spec), arrays[spec.name], casting="unsafe")


def view(buf: Any, spec: ArraySpec) -> np.ndarray:
    dtype = np.dtype(spec.dtype)
    count = math.prod(spec.shape)
    flat = np.frombuffer(buf, dtype=dtype, count=count, offset=spec.offset)
    return flat.reshape(spec.shape, order="F" if spec.fortran else "C")


class SharedArrays:
    """Parent side of the per-call arrays: one input slab (the parent writes, the child reads
    during the call) and a pool of output slabs (the child writes; the parent hands out views,
    and reuses a slab once nothing views it)."""

    def __init__(self) -> None:
        self.inputs: Slab | None = None
        self.pool: list[Slab] = []

    def put(self, arrays: dict[str, np.ndarray]) -> tuple[str, list[ArraySpec]]:
        specs, size = layout(arrays)
        if self.inputs is None or self.inputs.size < size:
            if self.inputs is not None:
                self.inputs.close()
            self.inputs = Slab(1 << max(size - 1, 1).bit_length())
        write_arrays(self.inputs.shm.buf, arrays, specs)
        return self.inputs.name, specs

    def output_slab(self, size: int = 0) -> Slab:
        for slab in self.pool:
            if slab.size >= size and slab.free:
                return slab
        slab = Slab(1 << max(size - 1, 1).bit_length() if size else 1 << 20)
        self.pool.append(slab)
        return slab

    def take(self, slab: Slab, specs: list[ArraySpec]) -> dict[str, np.ndarray]:
        end = max((s.offset + np.dtype(s.dtype).itemsize * math.prod(s.shape) for s in specs),
                  default=0)
        window = slab.lease(end)
        return {s.name: view(window, s) for s in specs}

    def close(self) -> None:
        for slab in [self.inputs, *self.pool]:
            if slab is not None:
                slab.close()
        self.inputs, self.pool = None, []


# --- the child -------------------------------------------------------------------------------

class Channel:
    """What a handler in the child may use: progress messages to the caller, and the shared
    arrays of the call being served."""

    def __init__(self, conn: Any):
        self._conn = conn
        self._attached: dict[str, Any] = {}
        self._out: tuple[str, int] | None = None  # the output slab of the call being served

    def progress(self, message: str) -> None:
        self._conn.send(("progress", message))

    def buffer(self, name: str) -> Any:
        if name not in self._attached:
            self._attached[name] = _attach(name)
        return self._attached[name].buf

    def output(self, nbytes: int) -> Any | None:
        """The call's output slab, for a handler that writes its result there itself (and
        returns `Written`): no copy through its own heap first. None where the slab is smaller
        than `nbytes` (then return `Outputs`, which grows it)."""
        if self._out is None or self._out[1] < nbytes:
            return None
        return self.buffer(self._out[0])

    def close(self) -> None:
        for shm in self._attached.values():
            close_shared(shm)
        self._attached = {}


def _portable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - anything unpicklable travels as its text
        return RemoteError(f"{type(exc).__name__}: {exc}")


def _child_main(conn: Any, factory: Callable[[Channel], Any]) -> None:
    channel = Channel(conn)
    try:
        _serve(conn, channel, factory)
    finally:
        channel.close()


def _serve(conn: Any, channel: Channel, factory: Callable[[Channel], Any]) -> None:
    try:
        handler = factory(channel)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller of the first call
        conn.send(("error", _portable(exc)))
        return
    conn.send(("ready", None))
    stash: dict[str, np.ndarray] | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        method, args, arrays_in, out = message
        if method == "__stop__":
            conn.send(("ok", None))
            _exit_at_once()
        if method == "__cpu__":  # the worker's CPU seconds so far (benchmarks)
            conn.send(("ok", time.process_time()))
            continue
        try:
            if method == "__deliver__":  # the outputs of the last call, into a bigger slab
                result, arrays = None, stash
            else:
                kwargs = {}
                channel._out = out
                if arrays_in is not None:
                    buf = channel.buffer(arrays_in[0])
                    kwargs["arrays"] = {s.name: view(buf, s) for s in arrays_in[1]}
                result = getattr(handler, method)(*args, **kwargs)
                channel._out = None
                arrays = None
                if isinstance(result, Written):
                    stash = None
                    conn.send(("arrays", (result.value, result.specs)))
                    continue
                if isinstance(result, Outputs):
                    result, arrays = result.value, result.arrays
            if arrays is None:
                conn.send(("ok", result))
                continue
            specs, size = layout(arrays, fortran=True)
            slab_name, slab_size = out
            if size > slab_size:
                stash = arrays
                conn.send(("grow", (result, size)))
                continue
            write_arrays(channel.buffer(slab_name), arrays, specs)
            stash = None
            conn.send(("arrays", (result, specs)))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
            conn.send(("error", _portable(exc)))


def _exit_at_once() -> None:
    """End the worker without interpreter shutdown: Core ML may still hold buffers that the
    handler's objects own (an input it has not unbound yet, a state), and a normal exit would
    free them, module by module, while Core ML's queues run. Workers this one started are
    stopped first (their own pipes would end them anyway), and what was printed is flushed."""
    _close_all()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream: nothing to flush
            pass
    os._exit(0)


@dataclass
class Outputs:
    """A handler's result that carries arrays: `arrays` go back through shared memory, laid
    out with each array's first axes fastest (Fortran order: a [1, V, T, 1] head output's row
    of V values is then contiguous), `value` through the pipe."""

    value: Any
    arrays: dict[str, np.ndarray]


@dataclass
class Written:
    """A handler's result whose arrays it wrote into the call's output slab itself
    (`Channel.output`), at `specs`: the parent gets them as it gets `Outputs`' arrays."""

    value: Any
    specs: list[ArraySpec]


# --- the parent ------------------------------------------------------------------------------

class WorkerProcess:
    """Parent side of one worker: `call(method, *args)` runs `handler.method(*args)` in it."""

    def __init__(self, label: str, factory: Callable[[Channel], Any], *,
                 on_start: Callable[[WorkerProcess], None] | None = None,
                 progress: Callable[[str], None] | None = None):
        self.label = label
        self.factory = factory
        self.on_start = on_start
        self.progress = progress or (lambda message: None)
        self.restarts = 0
        self.deaths: list[dict[str, Any]] = []
        self.arrays = SharedArrays()
        self._proc: Any = None
        self._conn: Any = None
        self._starts = 0
        self._lock = threading.RLock()
        self._starting = False
        self._restart_due = False
        _live.add(self)

    # --- lifecycle ---------------------------------------------------------------------------

    # Read from other threads (the server's /health) while a call may be ending: one read of
    # _proc each, never a lock (a call holds it for as long as Core ML runs).
    @property
    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.is_alive()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    @property
    def generation(self) -> int:
        """How many workers have been started: state made in an earlier one is gone."""
        return self._starts

    def runs(self, generation: int) -> bool:
        """Whether the worker started as `generation` is still the one calls go to: no later
        one started, and it was not found dead (nor closed) since. What lived in it is gone
        otherwise, even before the next call starts a fresh worker."""
        return self._proc is not None and self._starts == generation

    def start(self) -> None:
        """Start the worker (and run `on_start`) unless it runs; idempotent."""
        with self._lock:
            if self._proc is not None:
                return
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe(duplex=True)
            # Not a daemonic process: a daemonic one may not start processes of its own, and
            # the doctor's worker starts Core ML workers. The atexit hook below ends workers.
            proc = ctx.Process(target=_child_main, args=(child, self.factory),
                               name=f"ane-spec-{self.label}", daemon=False)
            proc.start()
            child.close()
            self._proc, self._conn = proc, parent
            self._starts += 1
            if self._restart_due:  # a start after a death (not after a close)
                self.restarts += 1
                self._restart_due = False
            try:
                self._receive("starting the worker")  # "ready", or the factory's error
            except WorkerDied:
                raise
            except BaseException:
                self.close()  # the factory failed: the child has returned
                raise
            if self.on_start is not None and not self._starting:
                self._starting = True
                try:
                    self.on_start(self)
                finally:
                    self._starting = False

    def call(self, method: str, *args: Any, during: str | None = None,
             arrays: dict[str, np.ndarray] | None = None, reply_bytes: int = 0) -> Any:
        """`handler.method(*args)` in the worker (started first if it is not running). With
        `arrays`, they reach the handler as its `arrays` keyword through shared memory; a
        handler returning `Outputs` gives back (value, arrays), the arrays viewing shared
        memory that stays theirs until they are dropped. `reply_bytes`: the size of the
        arrays the reply is known to carry, so that the handler can write them in one trip."""
        with self._lock:
            if self._proc is None:
                self.start()
            slab = self.arrays.output_slab(reply_bytes)
            shipped = None if arrays is None else self.arrays.put(arrays)
            self._send((method, args, shipped, (slab.name, slab.size)), during or method)
            kind, payload = self._receive(during or method)
            if kind == "grow":
                value, size = payload
                slab = self.arrays.output_slab(size)
                self._send(("__deliver__", (), None, (slab.name, slab.size)), during or method)
                kind, payload = self._receive(during or method)
            if kind == "arrays":
                value, specs = payload
                return value, self.arrays.take(slab, specs)
            return payload

    def close(self) -> None:
        with self._lock:
            proc, conn = self._proc, self._conn
            self._proc = self._conn = None
            if proc is not None:
                try:
                    conn.send(("__stop__", (), None, None))
                except (OSError, BrokenPipeError):
                    pass
                proc.join(JOIN_SECONDS)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
                conn.close()
            self.arrays.close()

    def cpu_seconds(self) -> float:
        """CPU time the running worker has used (user + system), for benchmarks."""
        return self.call("__cpu__")

    def kill(self) -> None:
        """End the worker at once (tests, and a caller that gave up on it)."""
        if self._proc is not None:
            self._proc.kill()

    def health(self) -> dict[str, Any]:
        last = self.deaths[-1] if self.deaths else None
        return {"running": self.alive, "pid": self.pid, "restarts": self.restarts,
                "deaths": len(self.deaths),
                "last_death": None if last is None else last["reason"],
                "last_death_at": None if last is None else last["at"]}

    # --- the pipe ----------------------------------------------------------------------------

    def _send(self, message: tuple, during: str) -> None:
        try:
            self._conn.send(message)
        except (OSError, BrokenPipeError):
            self._died(during)

    def _receive(self, during: str) -> tuple[str, Any]:
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                self._died(during)
            if kind == "progress":
                self.progress(payload)
            elif kind == "error":
                raise payload
            else:
                return kind, payload

    def _died(self, during: str) -> None:
        proc = self._proc
        self._proc, self._conn = None, None
        proc.join(JOIN_SECONDS)
        code = proc.exitcode
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown"
            how, details = f"signal {-code} ({name})", {"signal": -code, "signal_name": name}
        else:
            how, details = f"exit code {code}", {"exit_code": code}
        reason = f"{how} during {during}"
        self._restart_due = True
        self.deaths.append({"reason": reason, "at": time.time()} | details)
        log.error("the %s process (pid %s) died: %s", self.label, proc.pid, reason)
        raise WorkerDied(self.label, how, during, details)


@atexit.register
def _close_all() -> None:
    # Registered after multiprocessing's own exit hook (imported above), so it runs first:
    # that hook joins non-daemonic children, which wait for their parent to say stop.
    for worker in list(_live):
        try:
            worker.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
