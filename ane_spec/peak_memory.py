"""This process's peak resident memory, measured the same way everywhere.

`getrusage().ru_maxrss` is KiB on Linux but bytes on macOS, and on Linux it survives exec: a child
spawned by a large process reports its parent's peak (a 13 MB child of an 800 MB parent reports
813 MB). VmHWM in /proc/self/status belongs to the current address space only.
"""

from __future__ import annotations

import re
import resource
import sys


def peak_rss_bytes() -> int:
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status") as fh:
                found = re.search(r"^VmHWM:\s+(\d+) kB", fh.read(), re.MULTILINE)
            if found:
                return int(found.group(1)) * 1024
        except OSError:
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
