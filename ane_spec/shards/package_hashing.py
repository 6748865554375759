"""The build's packages hashed by a helper thread while the next package is made.

A package's manifest entry needs the sha256 of everything in it, read back past the page cache
(store.hash_path). On a real-size Phi-4-mini that is 3.7 GB and ~3.6 s of the building thread,
during which the second core had nothing to do; the next shard's conversion and MIL program
(numpy and Python) need nothing from the hash. sha256 and the reads release the GIL, so a
helper thread hashes each package while the building thread goes on, and the entries are
complete by the time the manifest is written.

One helper, in submission order. A build that fails or is interrupted cancels what has not
started and waits for the package being hashed (at most one, a few seconds), so no thread reads
the build's folder while it is removed.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ane_spec.manifests.schema import FileRef
from ane_spec.manifests.store import file_ref

Entry = TypeVar("Entry")


class PackageHashing:
    """Hashes packages of a build's folder in the background, in order."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hash-package")

    def submit(self, root: Path, path: Path, entry: Callable[[FileRef], Entry]
               ) -> Future[Entry]:
        """`entry(file_ref(root, path))`, computed by the helper: the package at `path` must
        not change from now on."""
        return self._pool.submit(lambda: entry(file_ref(root, path, uncached=True)))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> PackageHashing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def done(value: Entry) -> Future[Entry]:
    """A future that already holds `value` (a reused package's entry)."""
    future: Future[Entry] = Future()
    future.set_result(value)
    return future
