"""The GGUF container format: header, metadata, tensor directory, over one read-only mmap.

gguf-py's reader keeps a numpy view per metadata string, which for Phi-4-mini's 200k tokens and
200k merges costs ~400 MB and ~5 s per open. This parser decodes metadata into plain Python values
in one pass and leaves tensor data untouched in the mapping.

Layout (little-endian): b"GGUF", u32 version, u64 tensor_count, u64 kv_count, then kv_count
(key string, u32 type, value), then tensor_count (name, u32 n_dims, u64 dims[n_dims] innermost
first, u32 ggml type, u64 offset), padding to `general.alignment` (default 32), tensor data.

The file is hostile until proven otherwise. Every count and length is checked against the bytes
left in the file before anything is allocated for it (a key count, an array length or a string
length can claim 2^64), arrays of arrays are refused (so parsing never recurses), and the tensor
directory obeys llama.cpp's `gguf_init_from_file_impl` rules: at most 4 dimensions, names shorter
than 64 bytes, no duplicates, element counts below 2^63, rows a whole number of blocks, and each
tensor's offset exactly the padded end of the one before it.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ane_spec.errors import GGUFError, untrusted

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4        # GGML_MAX_DIMS
MAX_NAME = 64       # GGML_MAX_NAME: a tensor name must be shorter
MAX_ELEMENTS = 2**63 - 1

# GGUF value type codes -> (struct format, numpy dtype) for scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_STRING_MIN_BYTES = 8                       # its u64 length
_KV_MIN_BYTES = _STRING_MIN_BYTES + 4 + 1   # key, type, the smallest value
_TENSOR_INFO_MIN_BYTES = _STRING_MIN_BYTES + 4 + 4 + 8  # name, n_dims, type, offset
_HEADER_BYTES = 4 + 4 + 8 + 8
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: innermost (row length) first
    ggml_type: GGMLQuantizationType
    offset: int            # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFContents:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    data_offset: int
    mapping: mmap.mmap
    identity: tuple[int, ...]  # (device, inode, size, mtime_ns) of the file when it was mapped


class _Cursor:
    def __init__(self, buf: mmap.mmap, name: str):
        self.buf, self.pos, self.name = buf, 0, name

    @property
    def remaining(self) -> int:
        return len(self.buf) - self.pos

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.name}: {what}")

    def take(self, n: int) -> memoryview:
        if n > self.remaining:
            raise self.fail(f"file is truncated inside its header/metadata (needs byte "
                            f"{self.pos + n:,}, file has {len(self.buf):,})")
        view = memoryview(self.buf)[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError:
            # Byte-level vocabularies are valid UTF-8; anything else is kept, not fatal.
            return str(raw, "utf-8", errors="surrogateescape")

    def _strings(self, count: int) -> list[str]:
        """`count` strings, as `string` reads them one by one: a vocabulary array holds
        hundreds of thousands, and a method call and a memoryview each took half of opening
        a 200k-token GGUF (0.35 s)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length_at = _U64.unpack_from
        out = []
        for _ in range(count):
            n = length_at(buf, pos)[0] if pos + 8 <= end else -1
            if not 0 <= n <= end - pos - 8:   # the file ends inside its length or its bytes
                self.pos = pos
                return out + [self.string()]   # raises, naming the truncation
            pos += 8
            # Valid UTF-8 decodes the same either way; anything else is kept as `string` keeps it.
            out.append(str(buf[pos:pos + n], "utf-8", errors="surrogateescape"))
            pos += n
        self.pos = pos
        return out

    def value(self, key: str, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        if vtype == _STRING:
            return self.string()
        if vtype != _ARRAY:
            raise self.fail(f"key {untrusted(key)} has unknown value type {vtype}")
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1])
            self._check_count(key, count, dtype.itemsize)
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        if etype == _STRING:
            self._check_count(key, count, _STRING_MIN_BYTES)
            return self._strings(count)
        if etype == _ARRAY:
            raise self.fail(f"key {untrusted(key)} is an array of arrays, which GGUF readers "
                            "(llama.cpp included) do not accept")
        raise self.fail(f"key {untrusted(key)} is an array of unknown value type {etype}")

    def _check_count(self, key: str, count: int, min_bytes: int) -> None:
        if count * min_bytes > self.remaining:
            raise self.fail(f"key {untrusted(key)} claims {count:,} array elements, more than "
                            f"the {self.remaining:,} bytes left in the file can hold (truncated "
                            "or corrupt file?)")


def read_gguf(path: str, name: str) -> GGUFContents:
    """Parse a GGUF file's header, metadata and tensor directory; tensor bytes stay mapped."""
    try:
        with open(path, "rb") as fh:
            try:
                mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:
                raise GGUFError(f"{name}: file is empty") from None
            identity = file_identity(os.fstat(fh.fileno()))
    except OSError as exc:
        raise GGUFError(f"{name}: cannot read the file: {exc.strerror or exc}") from None
    cur = _Cursor(mapping, name)
    if bytes(cur.take(4)) != MAGIC:
        raise GGUFError(f"{name}: not a GGUF file (expected magic b'GGUF')")
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"{name}: GGUF version {version} is not supported (2 and 3 are)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    if n_kv * _KV_MIN_BYTES + n_tensors * _TENSOR_INFO_MIN_BYTES > cur.remaining:
        raise GGUFError(f"{name}: the header claims {n_tensors:,} tensors and {n_kv:,} keys, "
                        f"more than the file's {len(mapping):,} bytes can hold (truncated or "
                        "corrupt file?)")
    metadata = _read_metadata(cur, n_kv)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{name}: general.alignment {alignment} is not a power of two")
    infos = [_read_tensor_info(cur) for _ in range(n_tensors)]
    data_offset = -(-cur.pos // alignment) * alignment
    tensors = _place_tensors(infos, data_offset, alignment, len(mapping), name)
    return GGUFContents(version, metadata, tensors, data_offset, mapping, identity)


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is rewritten, truncated or replaced."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _read_metadata(cur: _Cursor, n_kv: int) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        if key in metadata:
            raise cur.fail(f"key {untrusted(key)} appears twice")
        vtype = cur.scalar("<I")
        if key == "general.alignment" and vtype != _UINT32:
            # llama.cpp reads it with gguf_get_val_u32, which aborts on any other type.
            raise cur.fail(f"general.alignment has value type {vtype}; it must be a uint32 (4)")
        metadata[key] = cur.value(key, vtype)
    return metadata


def _read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    tname = cur.string()
    if len(tname.encode("utf-8", "surrogateescape")) >= MAX_NAME:
        raise cur.fail(f"tensor name {untrusted(tname)} is {len(tname):,} characters long; "
                       f"GGUF names are shorter than {MAX_NAME} bytes")
    n_dims = cur.scalar("<I")
    if n_dims > MAX_DIMS:
        raise cur.fail(f"tensor {untrusted(tname)} claims {n_dims:,} dimensions; GGUF allows at "
                       f"most {MAX_DIMS}")
    dims = tuple(cur.scalar("<q") for _ in range(n_dims))
    if any(d < 0 for d in dims):
        raise cur.fail(f"tensor {untrusted(tname)} has a negative dimension in {dims}")
    return tname, dims, cur.scalar("<i"), cur.scalar("<Q")


def _place_tensors(infos: list[tuple[str, tuple[int, ...], int, int]], data_offset: int,
                   alignment: int, file_size: int, name: str) -> list[TensorInfo]:
    """Check each tensor's type, size and offset; offsets follow llama.cpp's rule."""
    tensors: list[TensorInfo] = []
    seen: set[str] = set()
    expected = 0
    for tname, dims, gtype, offset in infos:
        label = f"{name}: tensor {untrusted(tname)}"
        if tname in seen:
            raise GGUFError(f"{label} appears twice")
        seen.add(tname)
        try:
            qtype = GGMLQuantizationType(gtype)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFError(f"{label} has unknown ggml type {gtype}") from None
        numel = 1
        for d in dims:
            numel *= d
        if numel > MAX_ELEMENTS:
            raise GGUFError(f"{label} has shape {dims} of {numel:,} elements, more than any "
                            "tensor can hold")
        row = dims[0] if dims else 1
        if row % block:
            raise GGUFError(f"{label} rows of {row} are not a multiple of the {qtype.name} "
                            f"block size {block}")
        nbytes = numel // block * type_size
        if offset != expected:
            raise GGUFError(f"{label} has offset {offset:,}, expected {expected:,} (tensor data "
                            f"must follow the directory order, each padded to {alignment} bytes)")
        start = data_offset + offset
        if start + nbytes > file_size:
            raise GGUFError(f"{name}: file is truncated: tensor {untrusted(tname)} ends at byte "
                            f"{start + nbytes:,} but the file has {file_size:,} bytes")
        tensors.append(TensorInfo(tname, dims, qtype, start, nbytes))
        expected = offset + -(-nbytes // alignment) * alignment
    return tensors
