"""Run hostile inputs through the real CLI in one long-lived process, under a memory limit.

`Worker` starts `python -m tests.fuzz_worker` once and sends it one `ane-spec` command line per
case; the worker calls `ane_spec.cli.main` in-process (no interpreter start per case) and
reports how it ended. The parent enforces the time limit (a case that does not answer in time is
a hang: the worker is killed and restarted), the worker the memory limit: after a warm-up it sets
RLIMIT_AS to its current size plus `limit_mb`, so any case that tries to allocate more gets a
MemoryError (which the CLI reports as "out of memory", counted here as a failure) instead of
taking the machine down.

An audit hook records every absolute path the case opens, lists, renames, creates or deletes;
anything outside the case's own folders (and the Python installation, for lazy imports) is
reported. (Relative paths only occur below an already-recorded folder, through dir_fd calls.)

Outcomes: "valid" (rc 0), "refused" (rc 2 with exactly one `ane-spec CMD: error: ...` line and no
traceback), and the failures "bug" (anything else), "memory", "hang", "crash" (worker died).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import select
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATH_EVENTS = {"open", "os.listdir", "os.scandir", "os.rename", "os.replace", "os.remove",
               "os.rmdir", "os.mkdir", "shutil.rmtree", "os.symlink", "os.link", "os.truncate",
               "os.chmod", "os.chown", "os.utime", "os.chdir", "glob.glob"}
FAILURES = ("bug", "memory", "hang", "crash")


@dataclass
class Outcome:
    kind: str                      # valid, refused, bug, memory, hang, crash
    detail: str = ""
    outside: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.kind not in FAILURES and not self.outside


def classify(argv: list[str], rc: int, stderr: str) -> tuple[str, str]:
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    prefix = f"ane-spec {argv[0]}: "
    errors = [ln for ln in lines if ln.startswith(prefix)]
    if "Traceback" in stderr:
        return "bug", stderr[-2000:]
    if rc == 0:
        return "valid", ""
    if rc == 2 and len(errors) == 1 and errors[0].startswith(prefix + "error: "):
        if errors[0] == prefix + "error: out of memory":
            return "memory", errors[0]
        # Only the build prints other lines (its progress); everything else prints just this.
        others = [ln for ln in lines if ln not in errors and not ln.startswith("[build] ")]
        if not others:
            return "refused", errors[0]
    return "bug", f"rc {rc}: {stderr[-2000:]}"


class Worker:
    """The parent side: one worker process, restarted after a hang or a crash."""

    def __init__(self, limit_mb: int, warmup: list[list[str]], timeout: float = 60.0):
        self.limit_mb, self.warmup, self.timeout = limit_mb, warmup, timeout
        self.proc: subprocess.Popen | None = None
        self.started = 0

    def _start(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), OPENBLAS_NUM_THREADS="1",
                   OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz_worker"], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, env=env)
        self.started += 1
        reply = self._ask({"warmup": self.warmup, "limit_mb": self.limit_mb}, timeout=300)
        if reply is None or not reply.get("ready"):
            raise RuntimeError(f"fuzz worker did not start: {reply}")

    def _ask(self, message: dict, timeout: float) -> dict | None:
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"died": self.proc.poll()}

    def run(self, argv: list[str], allowed: list[Path], timeout: float | None = None) -> Outcome:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        t0 = time.monotonic()
        reply = self._ask({"argv": argv, "allowed": [os.fspath(p) for p in allowed]},
                          timeout or self.timeout)
        seconds = time.monotonic() - t0
        if reply is None:
            self.close()
            return Outcome("hang", f"no answer in {timeout or self.timeout:.0f} s", [], seconds)
        if "died" in reply:
            self.close()
            return Outcome("crash", f"worker exited with {reply['died']}", [], seconds)
        kind, detail = classify(argv, reply["rc"], reply["stderr"])
        return Outcome(kind, detail, reply["outside"], seconds)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


# --- the worker side ----------------------------------------------------------------------------

def _vm_bytes() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


class _Recorder:
    def __init__(self) -> None:
        self.active = False
        self.paths: list[str] = []
        install = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.fspath(REPO / "ane_spec")}
        self.install = tuple(os.path.realpath(p) + os.sep for p in install)

    def hook(self, event: str, args: tuple) -> None:
        if not self.active or event not in PATH_EVENTS or not args:
            return
        for arg in args[:2] if event in ("os.rename", "os.replace", "os.symlink", "os.link") \
                else args[:1]:
            # Relative paths come from dir_fd calls (shutil.rmtree's walk below a top folder
            # whose absolute path was recorded); every command line here is absolute.
            if isinstance(arg, (str, bytes, os.PathLike)) and os.path.isabs(arg):
                self.paths.append(os.fsdecode(arg))

    def outside(self, allowed: list[str]) -> list[str]:
        roots = tuple(os.path.realpath(a) + os.sep for a in allowed)
        bad = []
        for p in self.paths:
            real = os.path.realpath(os.path.abspath(p)) + os.sep
            if not real.startswith(roots) and not real.startswith(self.install):
                bad.append(p)
        return sorted(set(bad))


def _call(argv: list[str]) -> tuple[int, str]:
    from ane_spec.cli import main

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - reported to the parent as a bug
            import traceback

            return 99, "Traceback (escaped main):\n" + "".join(
                traceback.format_exception(exc))
    return rc, err.getvalue()


def serve() -> None:
    # The protocol goes over the original stdout; anything else written to fd 1 is discarded.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    recorder = _Recorder()
    sys.addaudithook(recorder.hook)
    for line in sys.stdin:
        msg = json.loads(line)
        if "warmup" in msg:
            for argv in msg["warmup"]:
                _call(argv)
            limit = None
            if sys.platform.startswith("linux"):  # macOS does not enforce RLIMIT_AS
                limit = _vm_bytes() + msg["limit_mb"] * 2**20
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
            proto.write(json.dumps({"ready": True, "limit": limit}) + "\n")
            continue
        recorder.paths.clear()
        recorder.active = True
        rc, stderr = _call(msg["argv"])
        recorder.active = False
        proto.write(json.dumps({"rc": rc, "stderr": stderr[-20000:],
                                "outside": recorder.outside(msg["allowed"])}) + "\n")


if __name__ == "__main__":
    serve()
