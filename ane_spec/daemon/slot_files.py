"""`--slot-save-path` files: one conversation's tokens and K/V rows, tied to the build that made
them and to their own content hash.

Layout: MAGIC, an 8-byte little-endian header length, the header (JSON), then the arrays' bytes in
`StateLayout` order. The header names the build (model, context, every shard package's content
hash), the backend, precision and decode shape the K/V were computed with, the tokens, and the
sha256 of everything else in the file. K/V from another build or another backend would not be what
this server computes for the same tokens, so such a file is refused, with a message saying which:
"stale" (an earlier build of the same model), "foreign" (another model or context), or computed
elsewhere. Every size comes from this server's own layout, never from the file, and only names
matching NAME_PATTERN inside the save directory are read or written.

The folder is treated as hostile too: files are opened with O_NOFOLLOW | O_NONBLOCK and read
only when fstat says they are regular files (a symlink is refused, a FIFO cannot block the
worker); a save writes a temp file made with mkstemp (O_CREAT | O_EXCL, a random name, mode
0600) and renames it over a regular file or nothing, within a quota of files and bytes; K/V
that are not finite (a NaN would spread through attention into later requests) are refused.
Messages name files, never the folder's path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from ane_spec.daemon.kv_state import StateLayout
from ane_spec.errors import AneSpecError

MAGIC = b"ANE-SPEC-SLOT-1\n"
SUFFIX = ".slot"
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_HEADER_SLACK = 1 << 16  # JSON around the tokens


class SlotFileError(AneSpecError):
    """A slot file cannot be used: not one, corrupt, stale, foreign, or a bad name."""


class SlotQuotaError(SlotFileError):
    """The save folder holds as many slot files, or bytes, as --slot-save-max-* allow."""


@dataclass(frozen=True)
class SlotQuota:
    max_files: int
    max_bytes: int


class BuildIdentity(BaseModel):
    # strict: a number is a JSON integer, never `true` or `1.0` (the hash has no key, so
    # anyone can write a file that passes it)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    model: str
    max_seq: int
    packages: tuple[str, ...]
    backend: str
    precision: str | None
    decode_shape: str


class SlotHeader(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    build: BuildIdentity
    dtype: str
    tokens: list[int]
    scope: str | None = None  # the --draft-memory scope (a hash, never a key) it belongs to
    # A build with KV rings: the position each ring slot holds (kv_state.ring_positions).
    ring: list[int] | None = None
    content_sha256: str


class SlotContents(NamedTuple):
    tokens: list[int]
    arrays: list[np.ndarray]
    scope: str | None
    ring: list[int] | None = None  # a ring build's per-slot positions


def build_identity(layout: StateLayout) -> BuildIdentity:
    p = layout.pipeline
    return BuildIdentity(model=p.manifest.name, max_seq=p.max_seq,
                         packages=tuple(s.file.digest for s in p.manifest.shards),
                         backend=p.backend.name, precision=p.backend.precision,
                         decode_shape=p.decode_shape)


def slot_path(directory: Path, name: str) -> Path:
    """DIR/NAME.slot for a plain name; anything that could leave DIR is refused."""
    stem = name.removesuffix(SUFFIX)
    if not NAME_PATTERN.fullmatch(stem):
        raise SlotFileError(f"bad slot file name {name!r}: use 1-64 letters, digits, '.', '_' "
                            "or '-', starting with a letter or digit")
    return directory / f"{stem}{SUFFIX}"


def saved_files(directory: Path) -> dict[str, os.stat_result]:
    """The folder's slot files that are regular files (links and devices left out), by name."""
    out = {}
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                out[entry.name] = entry.stat(follow_symlinks=False)
    return out


def save_slot(path: Path, layout: StateLayout, tokens: list[int], arrays: list[np.ndarray],
              scope: str | None = None, quota: SlotQuota | None = None,
              ring: list[int] | None = None) -> int:
    """Write atomically (a temp file renamed into place) within `quota`; returns the size."""
    payload = b"".join(np.ascontiguousarray(a, dtype=layout.dtype).tobytes() for a in arrays)
    if len(payload) != layout.nbytes(len(tokens)):
        raise SlotFileError("the captured state does not match this build's layout")
    header = {"build": build_identity(layout).model_dump(mode="json"),
              "dtype": layout.dtype.name, "tokens": [int(t) for t in tokens], "scope": scope}
    if ring is not None:  # absent otherwise: files without rings stay byte for byte the same
        header["ring"] = [int(q) for q in ring]
    header["content_sha256"] = _content_hash(header, payload)
    head = json.dumps(header, separators=(",", ":")).encode()
    size = len(MAGIC) + 8 + len(head) + len(payload)
    try:
        there = os.lstat(path)
    except FileNotFoundError:
        there = None
    if there is not None and not stat.S_ISREG(there.st_mode):
        raise SlotFileError(f"{path.name} exists and is not a regular file (a folder, link or "
                            "device); choose another name")
    if quota is not None:
        _check_quota(path, size, quota)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(MAGIC + struct.pack("<Q", len(head)) + head + payload)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return size


def _check_quota(path: Path, size: int, quota: SlotQuota) -> None:
    files = saved_files(path.parent)
    replaced = files.pop(path.name, None)
    used = sum(f.st_size for f in files.values())
    if len(files) + 1 > quota.max_files:
        raise SlotQuotaError(
            f"the slot folder is full: it holds {len(files)} slot files, the most "
            f"--slot-save-max-files allows; overwrite one of them instead "
            f"({'replacing' if replaced else 'adding'} {path.name})")
    if used + size > quota.max_bytes:
        raise SlotQuotaError(
            f"the slot folder is full: {used} bytes of slot files plus this {size}-byte one "
            f"would pass --slot-save-max-mb ({quota.max_bytes} bytes)")


def _open_slot_file(path: Path) -> BinaryIO:
    """`path` opened for reading if it is a regular file: O_NOFOLLOW refuses a symlink and
    O_NONBLOCK keeps a FIFO from blocking the open; fstat then refuses anything irregular."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        if os.path.islink(path):
            raise SlotFileError(f"{path.name} is a symbolic link; slot files must be plain "
                                "files") from None
        raise SlotFileError(f"cannot read slot file {path.name}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SlotFileError(f"{path.name} is not a regular file (a FIFO, device or folder)")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def load_slot(path: Path, layout: StateLayout) -> SlotContents:
    """The tokens, K/V rows and scope of a slot file made by this build on this backend, or
    SlotFileError."""
    where = path.name
    try:
        with _open_slot_file(path) as fh:
            size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(len(MAGIC) + 8)
            if len(prefix) < len(MAGIC) + 8 or not prefix.startswith(MAGIC):
                raise SlotFileError(f"{where}: not an ane-spec slot file")
            (head_len,) = struct.unpack("<Q", prefix[len(MAGIC):])
            if head_len > _HEADER_SLACK + 12 * (layout.max_seq + layout.ring):
                raise SlotFileError(f"{where}: corrupt (a {head_len}-byte header)")
            raw = fh.read(head_len)
            header = _parse_header(where, raw)
            _check_build(where, header.build, build_identity(layout))
            if header.dtype != layout.dtype.name:
                raise SlotFileError(f"{where}: holds {header.dtype} states; this server keeps "
                                    f"{layout.dtype.name}")
            n = len(header.tokens)
            if not 0 < n <= layout.max_seq:
                raise SlotFileError(f"{where}: {n} tokens for a {layout.max_seq}-token context")
            vocab = layout.pipeline.config.vocab_size
            if any(not 0 <= t < vocab for t in header.tokens):
                raise SlotFileError(f"{where}: token ids outside the vocabulary 0..{vocab - 1}")
            want = layout.nbytes(n)
            if size != len(prefix) + head_len + want:
                raise SlotFileError(f"{where}: corrupt (the file is {size} bytes; "
                                    f"{len(prefix) + head_len + want} expected)")
            payload = fh.read(want)
    except OSError as exc:
        raise SlotFileError(f"cannot read slot file {where}: {exc.strerror}") from None
    unsigned = header.model_dump(mode="json", exclude={"content_sha256"}
                                 | ({"ring"} if header.ring is None else set()))
    if _content_hash(unsigned, payload) != header.content_sha256:
        raise SlotFileError(f"{where}: corrupt (its content hash does not match: edited or "
                            "damaged)")
    arrays, offset = [], 0
    for e in layout.entries:
        shape = layout.shape(e, n)
        count = int(np.prod(shape))
        rows = np.frombuffer(payload, dtype=layout.dtype, count=count, offset=offset)
        if not np.isfinite(rows).all():  # the hash has no key: anyone can re-sign a file
            raise SlotFileError(f"{where}: holds K/V that are not finite (NaN or Inf); refused")
        arrays.append(rows.reshape(shape).copy())
        offset += count * layout.dtype.itemsize
    _check_ring(where, header.ring, n, layout)
    return SlotContents(header.tokens, arrays, header.scope, header.ring)


def _check_ring(where: str, ring: list[int] | None, n: int, layout: StateLayout) -> None:
    """A ring build's saved positions are what `ring_positions` of n tokens gives: one per ring
    slot, each -1 (none) or one of the n positions. Checked here, before numpy sees them: an
    int past int64 (2**70) raised OverflowError where only ValueError was caught, and the
    worker thread died with the restore unanswered."""
    if ring is not None and layout.ring:  # (ring positions for a ring-less build: make_ring)
        if len(ring) != layout.ring:
            raise SlotFileError(f"{where}: its KV ring does not fit this build: {len(ring)} "
                                f"ring positions for a ring of {layout.ring} slots")
        if any(not -1 <= q < n for q in ring):
            raise SlotFileError(f"{where}: its KV ring does not fit this build: a ring "
                                f"position outside -1..{n - 1} (none, or one of its {n} "
                                "tokens)")
    try:
        layout.make_ring(ring, n)
    except (ValueError, OverflowError, TypeError) as exc:
        raise SlotFileError(f"{where}: its KV ring does not fit this build: {exc}") from None


def _content_hash(header: dict, payload: bytes) -> str:
    unsigned = {k: v for k, v in header.items() if k != "content_sha256"}
    h = hashlib.sha256(json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode())
    h.update(payload)
    return h.hexdigest()


def _parse_header(where: str, raw: bytes) -> SlotHeader:
    try:
        return SlotHeader.model_validate_json(raw)
    except ValidationError:
        raise SlotFileError(f"{where}: corrupt (unreadable header)") from None


def _check_build(where: str, saved: BuildIdentity, mine: BuildIdentity) -> None:
    if (saved.model, saved.max_seq) != (mine.model, mine.max_seq):
        raise SlotFileError(
            f"{where}: foreign: saved by model {saved.model!r} with a {saved.max_seq}-token "
            f"context; this server runs {mine.model!r} with {mine.max_seq}")
    if saved.packages != mine.packages:
        raise SlotFileError(
            f"{where}: stale: saved from another build of {mine.model!r} (its shard package "
            "hashes differ from this build's); delete it, or save the slot again")
    ran, runs = ((s.backend, s.precision, s.decode_shape) for s in (saved, mine))
    if ran != runs:
        raise SlotFileError(
            f"{where}: computed on {' '.join(str(x) for x in ran if x)}; this server runs "
            f"{' '.join(str(x) for x in runs if x)}, whose K/V for the same tokens differ")
