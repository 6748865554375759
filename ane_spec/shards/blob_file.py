"""A package's weight file (`weights/weight.bin`) written as coremltools' blob writer lays it
out, byte for byte, but past the page cache where the OS allows it (direct_file.py says why).

The layout is MILBlob's (coremltools mlmodel/src/MILBlob/Blob/StorageFormat.hpp,
StorageWriter.cpp, FileWriter.cpp): a 64-byte header (blob count, version 2, reserved zeros);
then per blob, at the next multiple of 64 past the file's end (the gap reads as zeros), a 64-byte
metadata record (sentinel 0xDEADBEEF, data type, size in bytes, the data's offset, unused bits,
reserved zeros) and the data right after it. Each write returns the metadata's offset, which the
program's proto records. The header's count is known only at the end: it is written last, in
place, through the cache.
"""

from __future__ import annotations

import os
import struct
from concurrent.futures import Future
from typing import TYPE_CHECKING

import numpy as np

from ane_spec.shards.direct_file import DirectFile

if TYPE_CHECKING:
    from ane_spec.content_digest import Hasher

ALIGNMENT = 64   # DefaultStorageAlignment
_SENTINEL = 0xDEADBEEF
_VERSION = 2
_HEADER = struct.Struct("<II7Q")       # storage_header: count, version, reserved_0..6
_METADATA = struct.Struct("<IIQQQ4Q")  # blob_metadata: sentinel, mil_dtype, sizeInBytes,
#                                        offset, padding_size_in_bits, reserved_1..4
# The writer methods coremltools' backend calls (helper.py `_get_offset_by_writing_data`), the
# array dtype each is handed (fp16 arrives as its bits) and BlobDataType.hpp's code for it.
BLOB_TYPES: dict[str, tuple[np.dtype, int]] = {
    "write_fp16_data": (np.dtype(np.uint16), 1),
    "write_float_data": (np.dtype(np.float32), 2),
    "write_uint8_data": (np.dtype(np.uint8), 3),
    "write_int8_data": (np.dtype(np.int8), 4),
    "write_int16_data": (np.dtype(np.int16), 6),
    "write_uint16_data": (np.dtype(np.uint16), 7),
    "write_int32_data": (np.dtype(np.int32), 14),
    "write_uint32_data": (np.dtype(np.uint32), 15),
}


class BlobFileWriter:
    """Stands in for coremltools' `libmilstoragepython._BlobStorageWriter` (same constructor,
    same write_*_data methods and offsets) for the byte-sized types; `close()` or
    `finish_later()` must be called to finish the file (the C++ writer finishes on
    destruction)."""

    def __init__(self, file_name: str, truncate_file: bool = True, *, direct: bool = True):
        if not truncate_file:
            raise ValueError("the blob file writer only writes new files (truncate_file=True)")
        self.path = file_name
        self._file = DirectFile(file_name, direct=direct)
        self._count = 0
        self._file.append(_HEADER.pack(0, _VERSION, *[0] * 7))   # its count: at the finish
        # What follows the header, in file order (the data as the views written from), so the
        # file's hash needs no read of it: `hash_into`.
        self._pieces: list[bytes | memoryview] | None = []
        self._header: bytes | None = None   # the finished file's, once `finish_later` made it

    @property
    def direct(self) -> bool:
        return self._file.direct

    def write(self, method: str, data: np.ndarray) -> int:
        """Append one blob; return the offset of its metadata (what the proto records). The
        data is written from where it lies, after this returns (direct_file.py: borrowed), so
        it stays unchanged until `close()`: coremltools' exporter hands the program's own
        constants, which nothing changes."""
        dtype, code = BLOB_TYPES[method]
        if data.dtype != dtype:
            raise TypeError(f"{method} takes {dtype} values, not {data.dtype}")
        flat = np.ascontiguousarray(data).reshape(-1)
        end = self._file.size
        metadata_at = -(-end // ALIGNMENT) * ALIGNMENT
        pieces = (bytes(metadata_at - end),
                  _METADATA.pack(_SENTINEL, code, flat.nbytes, metadata_at + _METADATA.size, 0,
                                 *[0] * 4))
        for piece in pieces:
            self._file.append(piece)
        self._file.append(memoryview(flat), borrowed=True)
        if self._pieces is not None:
            self._pieces += [*pieces, memoryview(flat)]
        self._count += 1
        return metadata_at

    def __getattr__(self, name: str):
        if name in BLOB_TYPES:
            return lambda data: self.write(name, data)
        if name.startswith("write_") and name.endswith("_data"):
            raise NotImplementedError(f"{name}: sub-byte blobs are left to coremltools' writer; "
                                      "no program this project builds has them")
        raise AttributeError(name)

    @property
    def size(self) -> int:
        """The file's length once finished."""
        return self._file.size

    def close(self) -> None:
        """Finish the file (what is queued, then the header with the blob count) and wait."""
        if not self._file.closed:
            self.finish_later().result()

    def finish_later(self) -> Future[None]:
        """Finish the file in the writer's thread: what is queued, then the header with the
        blob count, written through a descriptor of its own, so the file may be renamed or
        moved within its filesystem meanwhile. The future ends when the file is whole."""
        header = self._header = _HEADER.pack(self._count, _VERSION, *[0] * 7)
        fd = os.open(self.path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            done = self._file.finish_later(lambda: _write_all_at(fd, header, 0))
        except BaseException:
            os.close(fd)
            raise
        done.add_done_callback(lambda _: os.close(fd))
        return done

    def hash_into(self, h: "Hasher") -> int:
        """Feed the finished file's bytes to `h` from the memory they are written from, not
        from the disk; returns their count. Once `finish_later` has been called (the header's
        count is final), and once only: the views are let go of here, so the weights they
        show can be freed as soon as their writes are done too."""
        if self._header is None or self._pieces is None:
            raise ValueError(f"{self.path}: hash_into needs a finishing file, once")
        pieces, self._pieces = self._pieces, None
        h.update(self._header)
        total = len(self._header)
        # In file order, each let go of once hashed: the next shard's conversion, which asks
        # for buffers in about that order, gets them back as soon as they are written too.
        pieces.reverse()
        while pieces:
            piece = pieces.pop()
            h.update(piece)
            total += len(piece) if isinstance(piece, bytes) else piece.nbytes
            del piece
        if total != self._file.size:   # every append is a piece: a bug, never the disk
            raise AssertionError(f"{self.path}: {total} bytes hashed of {self._file.size}")
        return total

    def discard(self) -> None:
        """Close without finishing the file (a conversion that failed part-way)."""
        self._pieces = None
        self._file.discard()


def _write_all_at(fd: int, data: bytes, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
