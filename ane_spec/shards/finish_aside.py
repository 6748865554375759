"""Work that finishes a build's artifacts, done by a helper thread while the next one is made.

A package's manifest entry needs the hash of everything in it (store.hash_path): on a
real-size Phi-4-mini, 3.7 GB and ~3.6 s of the building thread, during which the second core
had nothing to do. The embeddings (0.65 GB written and hashed) need only the residual scale,
and used to be the build's last 1.5-2.4 s; they start the moment it is decided or assumed
(scale_aside.py), beside the first shard's MIL program. Neither needs anything the next shard's
conversion and MIL program (numpy and Python) make, and the hash, the reads and the writes
release the GIL: a helper thread does them while the building thread goes on, and their results
are waited for when the manifest is written.

A package's weight file may still be being written by its own thread when the package is
handed over (conversion_passes.weights_written_once `finish_later`: the disk takes ~1 GB/s, the
next shard's conversion need not wait for it). A second helper hashes it meanwhile, from the
memory it is written from (the bytes the writes were handed, as git hashes an object), and the
package's job waits for the file to be whole before it makes the entry. The load's
verification reads it from the disk, so a file the disk did not keep is still refused.

The jobs run in submission order. A build that fails or is interrupted stops the weight files
still being written, cancels what has not started and waits for what is under way (one job, a
few seconds), so no thread writes to or reads from the build's folder while it is removed.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from ane_spec.manifests.schema import FileRef
from ane_spec.manifests.store import file_ref
from ane_spec.shards.conversion_passes import PendingWeights, wait_whole

Result = TypeVar("Result")


class FinishAside:
    """Runs a build's finishing jobs in the background, in order."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="finish-aside")
        # Its own thread, so a package's weights are hashed (from memory) at once, not after
        # the jobs queued before it: until then they cannot be reused by the next shard's.
        self._hashing = ThreadPoolExecutor(1, thread_name_prefix="hash-package")
        self._writing: list[PendingWeights] = []

    def run(self, job: Callable[[], Result]) -> Future[Result]:
        return self._pool.submit(job)

    def hash_package(self, root: Path, path: Path, entry: Callable[[FileRef], Result],
                     writing: Sequence[PendingWeights] = (),
                     failed: Callable[[BaseException], BaseException] = lambda exc: exc
                     ) -> Future[Result]:
        """`entry(file_ref(root, path))`, made by the helper once the weight files still
        `writing` are whole (what one failed with is raised as `failed(error)`): the package
        at `path` must not change from now on. Those weight files are hashed from the memory
        they are written from (BlobFileWriter.hash_into), beside their writes, instead of read
        back once written: on a Phi-4-mini build, 3.1 GB read at ~1 GB/s after the last
        write, most of the build's last seconds."""
        self._writing.extend(writing)
        hashed = self._hashing.submit(
            file_ref, root, path, uncached=True,
            known={os.path.abspath(w.path): w.writer.hash_into for w in writing})

        def job() -> Result:
            wait_whole(writing, failed)
            for w in writing:   # the disk holds as many bytes as were hashed
                if (on_disk := os.stat(w.path).st_size) != w.bytes:
                    raise failed(OSError(f"{w.path.name} is {on_disk:,} bytes once written, "
                                         f"not {w.bytes:,}"))
            return entry(hashed.result())

        return self.run(job)

    def close(self) -> None:
        """Stop the weight files still being written (a build that failed: their writes end
        at once), cancel the jobs not started and wait for the one under way."""
        for w in self._writing:
            w.discard()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._hashing.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> FinishAside:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def done(value: Result) -> Future[Result]:
    """A future that already holds `value` (a reused package's entry)."""
    future: Future[Result] = Future()
    future.set_result(value)
    return future
