"""A build's output folder: one builder at a time, no litter from dead builds, an atomic swap.

Everything lives next to OUT in its parent folder:

    .OUT.lock              flock()ed by the running build, holding its PID; removed at the end
    .OUT.building-PID      the build being written; renamed to OUT when complete
    .OUT.old-PID           the previous build, only during the fallback swap

The swap exchanges the two folders in one step where the OS can (Linux renameat2 with
RENAME_EXCHANGE, macOS renamex_np with RENAME_SWAP): OUT is at every instant either the previous
build or the new one. Elsewhere it takes two renames, and a build killed between them leaves OUT
missing; the next build under the lock finds that state and puts a build back before anything
else (`recover`). Leftovers of builds whose process is gone are removed then too.

`ANE_SPEC_BUILD_FAULT` is a test hook read only by the swap: "no-exchange" forces the two-rename
path, "kill-mid-swap" SIGKILLs the build between the two steps of either path.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from ane_spec.errors import BuildError

FAULT_ENV = "ANE_SPEC_BUILD_FAULT"
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2   # linux/fs.h
_RENAME_SWAP = 2       # macOS sys/stdio.h
_UNSUPPORTED = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV}


def building_dir(out: Path, pid: int | None = None) -> Path:
    return out.parent / f".{out.name}.building-{os.getpid() if pid is None else pid}"


def _old_dir(out: Path, pid: int | None = None) -> Path:
    return out.parent / f".{out.name}.old-{os.getpid() if pid is None else pid}"


class OutputLock:
    """An exclusive, non-blocking flock on `.OUT.lock`: a second build of the same OUT is
    refused at once, naming the PID that holds it."""

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}.lock"
        self.fd: int | None = None

    def __enter__(self) -> "OutputLock":
        self.out.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise BuildError(f"another build (PID {holder}) is writing {self.out}; wait "
                                 "for it to finish") from None
            # The previous holder unlinks the file before unlocking it: if ours is no longer
            # the file at that path, a third build may already hold the new one. Start over.
            try:
                current = os.stat(self.path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _dead_leftovers(out: Path, kind: str) -> dict[int, Path]:
    """PID -> leftover folder of `kind` ("building" or "old") whose process is gone."""
    pattern = re.compile(rf"\.{re.escape(out.name)}\.{kind}-(\d+)")
    found = {}
    for entry in out.parent.iterdir():
        m = pattern.fullmatch(entry.name)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            found[int(m.group(1))] = entry
    return found


def recover(out: Path, is_complete: Callable[[Path], bool]) -> list[Path]:
    """Under the lock: undo an interrupted fallback swap, then delete what dead builds left.

    OUT missing while a dead build's `.OUT.old-PID` exists means it died between the two
    renames: its `.OUT.building-PID` goes into place if `is_complete` says it is a whole build,
    else the old one goes back. Returns the folders removed."""
    olds = _dead_leftovers(out, "old")
    if not out.exists() and olds:
        pid, old = max(olds.items())
        new = building_dir(out, pid)
        os.rename(new if new.is_dir() and is_complete(new) else old, out)
    removed = []
    for kind in ("building", "old"):
        for path in _dead_leftovers(out, kind).values():
            shutil.rmtree(path)
            removed.append(path)
    return removed


def swap_into_place(tmp: Path, out: Path) -> None:
    """Make `tmp` the build at `out`; the previous build there, if any, is deleted after."""
    faults = set(os.environ.get(FAULT_ENV, "").split(","))
    if not out.exists():
        os.rename(tmp, out)
        return
    if "no-exchange" not in faults and _exchange(tmp, out):
        _fault_point(faults)
        shutil.rmtree(tmp)  # now the previous build
        return
    old = _old_dir(out)
    os.rename(out, old)
    _fault_point(faults)
    os.rename(tmp, out)
    shutil.rmtree(old)


def _fault_point(faults: set[str]) -> None:
    if "kill-mid-swap" in faults:
        os.kill(os.getpid(), signal.SIGKILL)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where this OS or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        fn = libc.renameat2
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                       ctypes.c_uint]
        rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        fn = libc.renamex_np
        fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_uint]
        rc = fn(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
    else:
        return False
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))
