"""Drop exactly the two import-time warnings of coremltools that say nothing about this project.

Importing coremltools off macOS logs eight lines such as
"Failed to load _MLModelProxy: No module named 'coremltools.libcoremlpython'" (models/model.py,
compute_plan.py, compute_device.py: one per native proxy class), and, with torch installed, "Torch
version 2.13.0 has not been tested with coremltools" (_deps/__init__.py). The native bridge never
exists off macOS, so the first is the normal state there (the Core ML backend says so itself, in
one line, when asked to run); and the project builds programs with the MIL builder, never with
coremltools' torch converter, so the second concerns code it does not run. Users read them as
breakage on every command.

Both are `logging` records of the "coremltools" logger (coremltools._logger), so a filter on that
logger drops them and nothing else: other coremltools warnings still show, and on macOS a proxy
that fails to load is still reported. Installed by `ane_spec/__init__.py`, so before any module of
the project imports coremltools.
"""

from __future__ import annotations

import logging
import re
import sys

_MISSING_BRIDGE = re.compile(
    r"Failed to load _ML\w*Proxy: No module named 'coremltools\.libcoremlpython'")
_UNTESTED_TORCH = re.compile(r"Torch version \S+ has not been tested with coremltools\.")


class CoremlImportNoise(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if _UNTESTED_TORCH.match(message):
            return False
        return not (sys.platform != "darwin" and _MISSING_BRIDGE.fullmatch(message))


def install() -> None:
    logger = logging.getLogger("coremltools")
    if not any(isinstance(f, CoremlImportNoise) for f in logger.filters):
        logger.addFilter(CoremlImportNoise())
