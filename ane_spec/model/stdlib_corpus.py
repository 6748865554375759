"""The training corpus of the embedded tiny model: the Python standard library's own source.

Every machine that runs this package has it (`sysconfig.get_paths()["stdlib"]`), it is real,
varied, licence-clean code with docstrings, and it needs no download.

What is in it: every `*.py` file under the stdlib directory, minus

* `site-packages/` and `dist-packages/` (third-party code, not the standard library),
* test suites (`test/`, `tests/`, `idle_test/` directories and `test_*.py` files): a large,
  repetitive slab of assertion boilerplate that would crowd out ordinary library code,
* `encodings/` (1.4 MB of generated codec tables, mostly `'\\x..'` literals) and `pydoc_data/`
  (one generated 750 kB string of documentation).

Files are ordered by their path relative to the stdlib directory (POSIX form), so the order does
not depend on the file system. A file is held out for evaluation when the first byte of the
SHA-256 of that relative path is below `HELD_OUT_THRESHOLD` (about 2% of files): the split
depends only on the path, so the same module is held out on every Python version that has it.
The corpus hash covers every path and its bytes in order.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from ane_spec.errors import AneSpecError

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "encodings", "pydoc_data", "__pycache__"})
HELD_OUT_THRESHOLD = 6  # of 256: ~2.3% of files


@dataclass(frozen=True)
class CorpusFile:
    path: str  # relative to the stdlib directory, POSIX form
    text: str

    @property
    def held_out(self) -> bool:
        return is_held_out(self.path)


def is_held_out(relative_path: str) -> bool:
    return hashlib.sha256(relative_path.encode()).digest()[0] < HELD_OUT_THRESHOLD


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _included(relative: Path) -> bool:
    if any(part in EXCLUDED_DIRS for part in relative.parts[:-1]):
        return False
    return not relative.name.startswith("test_")


def stdlib_corpus(root: Path | None = None) -> list[CorpusFile]:
    """The corpus files in path order.

    Files that are not valid UTF-8 are skipped (the stdlib has none, but a patched tree might).
    """
    root = stdlib_dir() if root is None else root
    paths = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py")
                   if p.is_file() and _included(p.relative_to(root)))
    files: list[CorpusFile] = []
    for rel, path in paths:
        try:
            files.append(CorpusFile(rel, path.read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            continue
    if not files:
        raise AneSpecError(f"no Python source found under {root}: this Python was installed "
                           "without its standard library sources")
    return files


def corpus_sha256(files: list[CorpusFile]) -> str:
    h = hashlib.sha256()
    for f in files:
        data = f.text.encode("utf-8")
        h.update(f"{f.path}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def split(files: list[CorpusFile]) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """(training files, held-out files)."""
    return [f for f in files if not f.held_out], [f for f in files if f.held_out]
