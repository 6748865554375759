"""The GGUF's content hashes, taken by a helper thread while the first shard converts.

A build with nothing to reuse needs the hashes only when it writes the first shard's fingerprint.
Hashing a 4 GB file was ~5 s (sha256 of the file then, BLAKE3 now, XXH3 of each tensor; each
releases the GIL for every 64 MB block), which the building thread used to spend itself, between
the first shard's conversion and its program; beside it, the second core does it while the first
converts (issue 33's build cost). A build that fails or is interrupted stops the thread at its next
block and waits for it, so no hashing outlives the build.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

from ane_spec.model.gguf_file import GGUFModel, HashingStopped
from ane_spec.model.hash_process import Hashes


class HashAside:
    """`model.content_hashes()` running in a helper thread; `result()` waits for it."""

    def __init__(self, model: GGUFModel):
        self._stop = threading.Event()
        self._future: Future[Hashes] = Future()
        self._thread = threading.Thread(target=self._run, args=(model,), name="hash-gguf",
                                        daemon=True)
        self._thread.start()

    def _run(self, model: GGUFModel) -> None:
        try:
            self._future.set_result(model.content_hashes(stop=self._stop))
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that asks
            self._future.set_exception(exc)

    def result(self) -> Hashes:
        return self._future.result()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> "HashAside":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
