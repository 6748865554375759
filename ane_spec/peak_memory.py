"""This process's resident memory: its peak, and what it holds now, measured the same way
everywhere.

`getrusage().ru_maxrss` is KiB on Linux but bytes on macOS, and on Linux it survives exec: a child
spawned by a large process reports its parent's peak (a 13 MB child of an 800 MB parent reports
813 MB). VmHWM in /proc/self/status belongs to the current address space only.

A peak never falls, so it cannot tell memory that is freed from memory that piles up: a leak
check (the doctor's `state-reads`) watches the *current* resident size instead. Linux gives it in
/proc/self/statm (resident pages); macOS has no /proc, and its `getrusage` gives the peak only,
so there it is the kernel's `task_info(MACH_TASK_BASIC_INFO).resident_size`, the figure
Activity Monitor and psutil read, called through ctypes (no dependency for one system call).
"""

from __future__ import annotations

import ctypes
import os
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


def current_rss_bytes() -> int:
    """The bytes of this process resident in memory now (OSError where the system cannot say)."""
    # /proc first, wherever it exists, rather than a test of sys.platform: the tests' Core ML
    # stand-in makes a Linux process say "darwin", and its memory is still Linux's to tell.
    try:
        with open("/proc/self/statm") as fh:  # size resident shared text lib data dt, in pages
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except FileNotFoundError:
        if sys.platform != "darwin":
            raise OSError(f"no current resident size on {sys.platform}") from None
    return _mach_resident_size()


# <mach/task_info.h>: flavour 20, "always 64-bit basic info", declared under #pragma pack(4).
MACH_TASK_BASIC_INFO = 20
_SYSTEM_LIBRARY = "/usr/lib/libSystem.B.dylib"


class _MachTaskBasicInfo(ctypes.Structure):
    _pack_ = 4
    _fields_ = [("virtual_size", ctypes.c_uint64),
                ("resident_size", ctypes.c_uint64),
                ("resident_size_max", ctypes.c_uint64),
                ("user_time", ctypes.c_int32 * 2),    # time_value_t: seconds, microseconds
                ("system_time", ctypes.c_int32 * 2),
                ("policy", ctypes.c_int32),
                ("suspend_count", ctypes.c_int32)]


def _mach_resident_size() -> int:
    system = ctypes.CDLL(_SYSTEM_LIBRARY)
    task_info = system.task_info
    # kern_return_t task_info(task_name_t, task_flavor_t, task_info_t, mach_msg_type_number_t *)
    task_info.restype = ctypes.c_int
    task_info.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                          ctypes.POINTER(ctypes.c_uint32)]
    # mach_task_self() is a macro over this global: the task port of the calling process.
    task = ctypes.c_uint32.in_dll(system, "mach_task_self_").value
    info = _MachTaskBasicInfo()
    # MACH_TASK_BASIC_INFO_COUNT: the struct's size in natural_t (4-byte) units.
    count = ctypes.c_uint32(ctypes.sizeof(info) // 4)
    code = task_info(task, MACH_TASK_BASIC_INFO, ctypes.byref(info), ctypes.byref(count))
    if code != 0:
        raise OSError(f"task_info(MACH_TASK_BASIC_INFO) failed: kern_return_t {code}")
    return int(info.resident_size)
