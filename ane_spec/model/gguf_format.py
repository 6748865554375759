"""The GGUF container format: header, metadata, tensor directory, over one read-only mmap.

gguf-py's reader keeps a numpy view per metadata string, which for Phi-4-mini's 200k tokens and
200k merges costs ~400 MB and ~5 s per open. This parser decodes metadata into plain Python values
in one pass and leaves tensor data untouched in the mapping.

Layout (little-endian): b"GGUF", u32 version, u64 tensor_count, u64 kv_count, then kv_count
(key string, u32 type, value), then tensor_count (name, u32 n_dims, u64 dims[n_dims] innermost
first, u32 ggml type, u64 offset), padding to `general.alignment` (default 32), tensor data.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ane_spec.errors import GGUFError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type codes -> (struct format, numpy dtype) for scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (row length) first
    ggml_type: int
    offset: int            # absolute byte offset in the file


@dataclass
class GGUFContents:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    mapping: mmap.mmap


class _Cursor:
    def __init__(self, buf: mmap.mmap, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise GGUFError(f"{self.name}: file is truncated inside its header/metadata "
                            f"(needs byte {end:,}, file has {len(self.buf):,})")
        view = memoryview(self.buf)[self.pos:end]
        self.pos = end
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.take(n)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            # Byte-level vocabularies are valid UTF-8; anything else is kept, not fatal.
            return str(raw, "utf-8", errors="surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS:
                dtype = np.dtype(_SCALARS[etype][1])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(etype) for _ in range(count)]
        raise GGUFError(f"{self.name}: unknown metadata value type {vtype} at byte {self.pos}")


def read_gguf(path: str, name: str) -> GGUFContents:
    """Parse a GGUF file's header, metadata and tensor directory; tensor bytes stay mapped."""
    with open(path, "rb") as fh:
        try:
            mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{name}: file is empty") from None
    cur = _Cursor(mapping, name)
    if bytes(cur.take(4)) != MAGIC:
        raise GGUFError(f"{name}: not a GGUF file (expected magic b'GGUF')")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"{name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise GGUFError(f"{name}: implausible header ({n_tensors} tensors, {n_kv} keys): "
                        "corrupt file?")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))

    infos = []
    for _ in range(n_tensors):
        tname = cur.string()
        n_dims = cur.scalar("<I")
        if n_dims > 8:
            raise GGUFError(f"{name}: tensor '{tname}' claims {n_dims} dimensions: corrupt file?")
        dims = tuple(cur.scalar("<Q") for _ in range(n_dims))
        infos.append((tname, dims, cur.scalar("<I"), cur.scalar("<Q")))

    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{name}: general.alignment {alignment} is not a power of two")
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = [TensorInfo(t, dims, gtype, data_offset + off) for t, dims, gtype, off in infos]
    return GGUFContents(version, metadata, tensors, data_offset, mapping)
