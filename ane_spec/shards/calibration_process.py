"""The residual scale's calibration in a process of its own, beside the build's.

The fp32 calibration (a pass over the weights plus ~40-220 tokens of matmuls) used to run in a
helper thread beside the first shard's conversion. A thread could share only that stretch: the
rest of a build is coremltools' Python making packages, and beside Python the calibration, which
re-takes the GIL ~30,000 times a run, waits out the switch interval at each (6.1 s alone, 170 s
beside a Python loop). So the build waited for it, 2-4 s of a Phi-4-mini build, before the first
package. A process has a GIL of its own: it calibrates through the packages too, and the build
makes them meanwhile at the k it can assume (scale_aside.py).

On Linux the child is forked from the build once the model is open: it has torch, the reference
and the file's map already, so it costs no import (torch alone is ~1.2 s of CPU) and no second
open. Elsewhere (macOS, whose system libraries are not safe to use in a forked child once Core ML
is loaded; CPython's multiprocessing spawns there for the same reason) it is a fresh interpreter
that opens the file by path: `python -m ane_spec.shards.calibration_process MODEL.gguf SETTING`.

The protocol, one JSON object per line on the child's stdout: `{"say": text}` (progress, said by
the build), then `{"ranges": ...}` (the result, with the identity of the file it read: device,
inode, size, mtime) or `{"error": text}` (a BuildError's line: a corrupt tensor, a reference
that is not finite), checked with pydantic like any input. The parent holds the write end of the
child's stdin and never writes to it: end of file there means the build has ended or was
killed, and the child stops at its next checkpoint (a few per layer), so no calibration outlives
its build. A child that crashed, was killed or read another file gives no ranges; the build
then calibrates in its own process, as a small model's build always does.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from ane_spec.model.activation_range import ActivationRanges, CalibrationStopped, LayerRange

if TYPE_CHECKING:
    from ane_spec.model.gguf_file import GGUFModel

StartMethod = Literal["fork", "spawn"]
START_METHOD: StartMethod = "fork" if sys.platform == "linux" else "spawn"
# What the parent keeps of a failed child's stderr for its message.
STDERR_KEPT = 4096


class ChildLayer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    residual: float
    ffn_up: float
    ffn_down_in: float


class ChildRanges(BaseModel):
    """ActivationRanges as the child prints them (floats as JSON writes Python's: exact)."""

    model_config = ConfigDict(extra="forbid")
    identity: tuple[int, int, int, int]
    layers: list[ChildLayer]
    prompts: int
    tokens: int
    seconds: float
    embedding: float

    def ranges(self) -> ActivationRanges:
        return ActivationRanges(layers=[LayerRange(**r.model_dump()) for r in self.layers],
                                prompts=self.prompts, tokens=self.tokens, seconds=self.seconds,
                                embedding=self.embedding)


class ChildLine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    say: str | None = None
    error: str | None = None
    ranges: ChildRanges | None = None


class CalibrationFailed(Exception):
    """The calibration itself failed (its BuildError's line): the build fails with it."""


class CalibrationChild:
    """`scale_decision.calibrate(model, setting)` in a child process from the moment this is
    made. `messages()` drains its progress; `result()` waits for it."""

    def __init__(self, model: GGUFModel, setting: str, method: StartMethod | None = None):
        self._identity = model.identity
        self.why_not = ""
        method = method or START_METHOD
        self._proc: _Forked | subprocess.Popen[bytes] | None = (
            _Forked(model, setting) if method == "fork" else subprocess.Popen(
                _child_command(os.fspath(model.path), setting), stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        self._messages: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._final: ChildLine | None = None
        self._bad_line = ""
        self._stderr = b""
        # Blocking reads release the GIL and a run prints a dozen lines: these threads never
        # compete with the build's Python.
        self._readers = [threading.Thread(target=self._read_stdout, args=(self._proc.stdout,),
                                          name="calibration-child-out", daemon=True),
                         threading.Thread(target=self._read_stderr, args=(self._proc.stderr,),
                                          name="calibration-child-err", daemon=True)]
        for t in self._readers:
            t.start()

    def done(self) -> bool:
        """Whether the child has ended (`result` would not wait)."""
        return self._proc is None or self._proc.poll() is not None

    def cpu_seconds(self) -> float | None:
        """The CPU time the running child has used, where the system tells (Linux's /proc,
        where the child is forked); None elsewhere, or once it has ended."""
        if self._proc is None:
            return None
        try:
            stat = Path(f"/proc/{self._proc.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def abandon(self, why: str) -> None:
        """Kill the child; `result` then gives None, and `why_not` says `why`."""
        self.close()
        self.why_not = why

    def messages(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._messages.get_nowait())
            except queue.Empty:
                return out

    def result(self) -> ActivationRanges | None:
        """The child's ranges if it calibrated the build's file; None if it failed or read
        another file (`why_not` says which). Raises CalibrationFailed with the calibration's
        own line where the calibration itself failed."""
        proc, self._proc = self._proc, None
        if proc is None:
            self.why_not = self.why_not or "it was stopped"
            return None
        self._reap(proc)
        final = self._final
        if final is not None and final.error is not None:
            raise CalibrationFailed(final.error)
        if proc.returncode != 0 or final is None or final.ranges is None:
            last = self._bad_line or next(iter(reversed(
                self._stderr.decode(errors="replace").strip().splitlines())),
                f"exit status {proc.returncode}")
            self.why_not = f"it failed ({last[:300]})"
            return None
        if final.ranges.identity != tuple(self._identity):
            self.why_not = "the file it read is not the one the build opened"
            return None
        return final.ranges.ranges()

    def close(self) -> None:
        """Kill the child if it still runs, and reap it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            self._reap(proc)

    def _reap(self, proc: _Forked | subprocess.Popen[bytes]) -> None:
        """Wait for the ended (or killed) child and for its readers to reach end of file."""
        proc.wait()
        for t in self._readers:
            t.join()
        proc.stdin.close()   # type: ignore[union-attr]

    def __enter__(self) -> CalibrationChild:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _read_stdout(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in stream:
                try:
                    line = ChildLine.model_validate_json(raw)
                except ValidationError as exc:
                    self._bad_line = (f"its output is not what it should be "
                                      f"({exc.error_count()} errors)")
                    continue
                if line.say is not None:
                    self._messages.put(line.say)
                if line.error is not None or line.ranges is not None:
                    self._final = line

    def _read_stderr(self, stream: IO[bytes]) -> None:
        with stream:
            for raw in stream:
                self._stderr = (self._stderr + raw)[-STDERR_KEPT:]


class _Forked:
    """A forked child running `_calibrate` on the parent's own model, with Popen's surface (the
    part CalibrationChild uses). Forked before the build starts any thread of its own."""

    def __init__(self, model: GGUFModel, setting: str):
        control, data, errors = os.pipe(), os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: never returns into the build
            code = 1
            try:
                # The build's SIGBUS handler (build._sigbus_ends_build) removes its folder: a
                # child's faulting read only ends the child (the build then calibrates itself,
                # and faults in its own turn).
                signal.signal(signal.SIGBUS, signal.SIG_DFL)
                _close_all_but(control[0], data[1], errors[1])
                for fd in (1, 2):   # stray prints and warnings: the parent's message, if any
                    os.dup2(errors[1], fd)
                out, err = os.fdopen(data[1], "w"), os.fdopen(errors[1], "w")
                try:
                    code = _calibrate(model, setting, control[0], out)
                except BaseException:   # noqa: BLE001 - its stderr is the parent's message
                    traceback.print_exc(file=err)
                out.flush()
                err.flush()
            finally:
                os._exit(code)
        for fd in (control[0], data[1], errors[1]):
            os.close(fd)
        self.pid = pid
        self.returncode: int | None = None
        self.stdin = os.fdopen(control[1], "wb")
        self.stdout = os.fdopen(data[0], "rb")
        self.stderr = os.fdopen(errors[0], "rb")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


def _close_all_but(*keep: int) -> None:
    """Close every descriptor the fork inherited but `keep` (and 0-2): above all the build's
    lock (output_dir.OutputLock), an flock that a child holding a copy of its descriptor would
    keep held after a killed build, refusing the next one. The model needs none: its map
    stands on its own, and the child leaves by os._exit, so nothing closes a number twice."""
    low = 3
    for fd in sorted(keep):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


class _ParentWatch:
    """The child's checkpoint: raises CalibrationStopped once the parent's end of the pipe is
    closed (the build ended, or was killed)."""

    def __init__(self, fd: int):
        self._fd = fd

    def checkpoint(self) -> None:
        ready, _, _ = select.select([self._fd], [], [], 0)
        if ready and not os.read(self._fd, 64):
            raise CalibrationStopped()


def _calibrate(model: GGUFModel, setting: str, control: int, out: IO[str]) -> int:
    """The child's work: calibrate `model`, print what it says and what it found to `out`."""
    import torch

    from ane_spec.errors import BuildError
    from ane_spec.shards.scale_decision import calibrate

    def emit(**line: object) -> None:
        out.write(json.dumps(line) + "\n")
        out.flush()

    # The parent's conversion keeps the other cores (weights.core_taken): a second torch
    # thread here would only take turns with it.
    torch.set_num_threads(1)
    say: Callable[[str], None] = lambda text: emit(say=text)   # noqa: E731
    try:
        ranges = calibrate(model, setting, say, _ParentWatch(control).checkpoint)
        model.check_unchanged()
    except CalibrationStopped:
        return 3
    except BuildError as exc:
        emit(error=str(exc))
        return 1
    if ranges is None:
        print(f"nothing to calibrate for --residual-scale {setting}", file=sys.stderr)
        return 2
    emit(ranges=dict(identity=model.identity, layers=[vars(r) for r in ranges.layers],
                     prompts=ranges.prompts, tokens=ranges.tokens, seconds=ranges.seconds,
                     embedding=ranges.embedding))
    return 0


def _child_command(path: str, setting: str) -> list[str]:
    return [sys.executable, "-m", __name__, path, setting]


def main(argv: list[str]) -> int:
    """The spawned child: open the file by path and calibrate it."""
    if len(argv) != 2:
        print("usage: python -m ane_spec.shards.calibration_process MODEL.gguf SETTING",
              file=sys.stderr)
        return 2
    from ane_spec.errors import AneSpecError
    from ane_spec.model.gguf_file import open_gguf

    try:
        model = open_gguf(argv[0])
    except AneSpecError as exc:
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    with model:
        return _calibrate(model, argv[1], sys.stdin.fileno(), sys.stdout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
