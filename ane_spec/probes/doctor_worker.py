"""The doctor's Core ML checks, run in a child process that a native crash cannot take down with
the report.

A libc++ abort or a segfault inside Core ML kills the process it happens in; Python cannot catch
it. So the doctor runs its Core ML checks in one worker process, started with `spawn` (never
`fork`: Core ML and the Objective-C runtime are not fork-safe), one check per request, in the
doctor's order. If the worker dies during a check, that check reads `crashed: signal N during
<check>` and the next Core ML check starts a fresh worker. One worker for all checks, rather
than one per check, because loading a Phi-size build and specialising it costs minutes, and the
checks after `cold-jit` rely on the build being loaded and warm, as it is in `serve`.
"""

from __future__ import annotations

import multiprocessing
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to rebuild the doctor's run: plain values, pickled to the child."""

    manifest: str | None
    decode_shape: str
    gguf: str | None
    work: str


def _serve(conn: Any, spec: WorkerSpec, checks: list) -> None:
    """Child side: answer ("run", i) with ("done", i, verdict fields); ("stop",) ends it."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.probes.doctor import DoctorRun, run_one

    # The parent verified the build's hashes once; the child only reads it.
    build = None if spec.manifest is None else load_manifest(spec.manifest, verify=False)
    run = DoctorRun(build, Path(spec.work), spec.decode_shape, spec.gguf,
                    lambda msg: conn.send(("progress", msg)))
    while True:
        request = conn.recv()
        if request[0] == "stop":
            return
        index = request[1]
        verdict = run_one(checks[index][1], run)
        conn.send(("done", index, vars(verdict)))


class CheckWorker:
    """Parent side: runs checks by index in a child process, restarting it after a crash."""

    def __init__(self, spec: WorkerSpec, checks: list, progress) -> None:
        self.spec, self.checks, self.progress = spec, checks, progress
        self._proc: Any = None
        self._conn: Any = None

    def run(self, index: int) -> dict[str, Any]:
        """The verdict fields of check `index`, or a failed verdict naming how the child died."""
        if self._proc is None:
            self._start()
        try:
            self._conn.send(("run", index))
            while True:
                message = self._conn.recv()
                if message[0] == "progress":
                    self.progress(message[1])
                elif message[0] == "done" and message[1] == index:
                    return message[2]
        except (EOFError, OSError, BrokenPipeError):
            return self._crashed(self.checks[index][0])

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_serve, args=(child, self.spec, self.checks),
                                 name="ane-spec-doctor-worker", daemon=True)
        self._proc.start()
        child.close()

    def _crashed(self, name: str) -> dict[str, Any]:
        self._proc.join(timeout=30)
        code = self._proc.exitcode
        self._proc, self._conn = None, None
        if code is not None and code < 0:
            try:
                label = signal.Signals(-code).name
            except ValueError:
                label = "unknown"
            how, details = f"signal {-code}", {"signal": -code, "signal_name": label}
        else:
            how, details = f"exit code {code}", {"exit_code": code}
        return {"status": "failed", "summary": f"crashed: {how} during {name}",
                "details": details}

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._proc = None
