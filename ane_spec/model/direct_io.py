"""Direct I/O (O_DIRECT: reads and writes that bypass the page cache) turned on or off for an
open file, where the OS and the filesystem have it. The build's package writer and its hashing
use it (shards/direct_file.py and manifests/store.py say why)."""

from __future__ import annotations

import fcntl
import os


def set_direct_io(fd: int, on: bool) -> bool:
    """O_DIRECT on or off for `fd`; False where this OS or filesystem refuses to turn it on."""
    if not hasattr(os, "O_DIRECT"):
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)
    except OSError:
        return False
    return True
