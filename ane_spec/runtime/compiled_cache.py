"""Compiled Core ML models (`.mlmodelc`), cached per user and keyed by the package's digest.

Compiling a Phi-4-mini shard takes minutes; the cache keeps the result outside the build folder,
so `build --force` reusing an unchanged package (same bytes, same hash) also reuses its compiled
copy, and two builds holding the same package share one. Layout:

    $ANE_SPEC_CACHE_DIR/compiled/<digest>.mlmodelc          (if the variable is set)
    ~/Library/Caches/ane-spec/compiled/<digest>.mlmodelc    (macOS)
    $XDG_CACHE_HOME/ane-spec/compiled/<digest>.mlmodelc     (elsewhere, default ~/.cache)

Publishing is atomic and safe between processes: each compile writes into its own temporary
folder inside the cache, and the result is renamed into place in one step. A rename onto a
compiled folder that another process published meanwhile fails, and the loser discards its copy
and uses the winner's, so every process ends with a complete cache entry and none ever sees half
of one. Nothing here needs Core ML: the compiler is passed in.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ane_spec.errors import AneSpecError

CACHE_ENV = "ANE_SPEC_CACHE_DIR"
STALE_TEMP_SECONDS = 24 * 3600  # a compile that died this long ago left its folder behind
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_TEMP_PREFIX = ".compiling-"

# compile(package, destination): write the compiled model to `destination`, which does not exist
# yet and ends in ".mlmodelc" (coremltools' compile_model moves its output there).
Compiler = Callable[[Path, Path], None]


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "ane-spec"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ane-spec"


def compiled_dir(root: Path | None = None) -> Path:
    return (root or cache_root()) / "compiled"


def cached_path(digest: str, root: Path | None = None) -> Path:
    # The key may come from a manifest, i.e. from a file: it must be a hash, never a path.
    if not _HEX_DIGEST.fullmatch(digest):
        raise AneSpecError(f"package hash {digest[:80]!r} is not 64 hex digits (a blake3 or "
                           "sha256 digest)")
    return compiled_dir(root) / f"{digest}.mlmodelc"


def compile_cached(package: Path, digest: str, compile_fn: Compiler,
                   root: Path | None = None) -> Path:
    """The compiled copy of `package` (whose content hash is `digest`), compiling it only if no
    process has published one yet."""
    target = cached_path(digest, root)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(target.parent)
    work = Path(tempfile.mkdtemp(prefix=f"{_TEMP_PREFIX}{digest[:16]}-", dir=target.parent))
    try:
        built = work / "model.mlmodelc"
        compile_fn(Path(package), built)
        if not built.is_dir():
            raise AneSpecError(f"compiling {package} produced no .mlmodelc folder")
        try:
            os.rename(built, target)  # atomic; fails if another process published first
        except OSError:
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _sweep_stale(folder: Path) -> None:
    """Remove temporary folders of compiles that died long ago (a live compile is younger)."""
    cutoff = time.time() - STALE_TEMP_SECONDS
    for p in folder.glob(f"{_TEMP_PREFIX}*"):
        try:
            if p.stat().st_mtime < cutoff:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:
            pass
