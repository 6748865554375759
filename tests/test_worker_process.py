"""The one mechanism for native code in a worker process (ane_spec/worker_process.py): calls,
errors, arrays through shared memory and their leases, a death noticed and a restart."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from ane_spec.worker_process import (
    Outputs, SharedArrays, WorkerDied, WorkerProcess, layout,
)


class Handler:
    def __init__(self, channel) -> None:  # noqa: ANN001
        self.channel = channel
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        self.calls += 1
        self.channel.progress(f"adding {a}")
        return a + b

    def fail(self) -> None:
        raise ValueError("no good")

    def double(self, *, arrays: dict[str, np.ndarray]) -> Outputs:
        return Outputs(os.getpid(), {k: v.astype(np.float32) * 2 for k, v in arrays.items()})

    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


def make(channel) -> Handler:  # noqa: ANN001
    return Handler(channel)


def broken(channel) -> Handler:  # noqa: ANN001
    raise RuntimeError("cannot start")


def test_calls_errors_arrays_death_and_restart() -> None:
    seen, started = [], []
    worker = WorkerProcess("test worker", make, progress=seen.append,
                           on_start=lambda w: started.append(w.pid))
    try:
        assert worker.call("add", 2, 3) == 5 and seen == ["adding 2"]
        with pytest.raises(ValueError, match="no good"):  # the same type, back in the caller
            worker.call("fail")
        x = np.arange(12, dtype=np.float16).reshape(1, 3, 4, 1)
        pid, out = worker.call("double", arrays={"x": x})
        assert pid == worker.pid != os.getpid()
        np.testing.assert_array_equal(out["x"], x.astype(np.float32) * 2)
        row = out["x"][0, :, 2, 0]  # Fortran order: a [1, V, T, 1] row is contiguous
        assert row.flags.c_contiguous
        first = worker.arrays.pool[0]
        assert not first.free  # `out` still views it
        del out, row
        assert first.free
        with pytest.raises(WorkerDied, match=r"died \(signal 9 \(SIGKILL\)\) during dying"):
            worker.call("die", during="dying")
        assert worker.health()["last_death"] == "signal 9 (SIGKILL) during dying"
        assert worker.call("add", 1, 1) == 2  # a fresh worker
        health = worker.health()
        assert health["restarts"] == 1 and health["running"] and len(started) == 2
    finally:
        worker.close()
    assert not worker.alive


def test_a_factory_that_fails_is_an_error_not_a_hang() -> None:
    worker = WorkerProcess("broken worker", broken)
    with pytest.raises(RuntimeError, match="cannot start"):
        worker.call("add", 1, 2)
    worker.close()


def test_output_slabs_are_reused_once_free() -> None:
    arrays = SharedArrays()
    try:
        slab = arrays.output_slab(1000)
        specs, _ = layout({"a": np.zeros((4, 4), np.float32)}, fortran=True)
        out = arrays.take(slab, specs)
        assert arrays.output_slab(1000) is not slab  # leased: another one
        view = out["a"].T[1:]
        del out
        assert arrays.output_slab(1000) is not slab  # a view of a view still holds it
        del view
        assert arrays.output_slab(1000) is slab
    finally:
        arrays.close()


def exits_without_shutdown(channel) -> Handler:  # noqa: ANN001
    """A handler whose process leaves a mark if its interpreter shuts down normally (atexit
    runs then; `os._exit` skips it)."""
    import atexit

    marker = os.environ["ANE_SPEC_TEST_EXIT_MARKER"]
    atexit.register(lambda: open(marker, "w").close())
    return Handler(channel)


def test_the_worker_exits_at_once_after_answering_stop(tmp_path, monkeypatch) -> None:
    """After `__stop__` the worker ends with os._exit(0): no interpreter shutdown, so nothing
    Core ML may still hold is freed module by module while its queues run."""
    marker = tmp_path / "shut-down-normally"
    monkeypatch.setenv("ANE_SPEC_TEST_EXIT_MARKER", str(marker))
    worker = WorkerProcess("exit worker", exits_without_shutdown)
    assert worker.call("add", 1, 1) == 2
    proc = worker._proc
    worker.close()
    assert proc.exitcode == 0
    assert not marker.exists()  # no atexit ran: the process did not shut down normally
