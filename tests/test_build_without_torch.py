"""torch is the `reference` extra: the shard compiler and the daemon import without it."""

from __future__ import annotations

import subprocess
import sys

_WITHOUT_TORCH = """
import importlib.abc, sys
class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, NoTorch())
import ane_spec.shards.build, ane_spec.shards.weights, ane_spec.model.quant, ane_spec.daemon.server
assert ane_spec.model.quant.loaded_torch() is None and "torch" not in sys.modules
print("imported")
"""


def test_the_build_and_the_daemon_import_without_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "imported"
