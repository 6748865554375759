"""Installs the Core ML stand-in (tests/coreml_standin.py) in a child Python process whose
environment sets ANE_SPEC_TEST_COREML_STANDIN to a macOS version ("15.5"); tests only."""

import os

_version = os.environ.get("ANE_SPEC_TEST_COREML_STANDIN")
if _version:
    from tests import coreml_standin

    coreml_standin.install(macos=tuple(int(v) for v in _version.split(".")))
