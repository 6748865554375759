"""The content hashes this project records: BLAKE3 now, sha256 in builds from before.

BLAKE3 hashes 5.7 GB/s on one core of the dev machine against sha256's 1.5 (OpenSSL, SHA-NI),
and spreads over cores. Everything a build writes is hashed as it is written, the source GGUF is
hashed while the build starts (model/hash_process.py), and every load verifies every artifact
(3.8 GB on Phi-4-mini): sha256 was 5.6 of a Phi-4-mini build's ~30 CPU seconds, and 3.0 s of
each verified load, 0.8 with BLAKE3.
"""

from __future__ import annotations

import hashlib
from typing import Literal, Protocol

import blake3

Digest = Literal["blake3", "sha256"]
# What a build records; manifests from before hold sha256, verified as such.
DIGEST: Digest = "blake3"


class Hasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


class _Blake3:
    """BLAKE3 with hashlib's two methods, taking any contiguous buffer as hashlib does (blake3's
    own refuses a typed memoryview, such as a weight file's int8 or fp16 pieces)."""

    def __init__(self, threads: bool):
        self._h = blake3.blake3(max_threads=blake3.blake3.AUTO if threads else 1)

    def update(self, data: bytes | memoryview, /) -> None:
        self._h.update(data if isinstance(data, bytes) else memoryview(data).cast("B"))

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def new_hasher(algorithm: Digest, *, threads: bool = False) -> Hasher:
    """An empty hash of `algorithm`; `threads`: BLAKE3 on every core (verifying a build at
    load), not one (a build, whose other core converts)."""
    return _Blake3(threads) if algorithm == "blake3" else hashlib.sha256()
