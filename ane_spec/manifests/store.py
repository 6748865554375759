"""Reading, verifying and writing manifests and the artifacts they name.

Everything a manifest names must stay inside the build folder. Each artifact path is walked one
component at a time with lstat: a symlink anywhere, a '..', or a final entry that is neither a
regular file nor a folder (a FIFO would hang the first read, a device would never end) is refused
by name before anything is opened, and files are opened with O_NOFOLLOW | O_NONBLOCK and checked
again with fstat, so swapping one in after the check gains nothing.
"""

from __future__ import annotations

import errno
import io
import json
import math
import mmap
import os
import stat
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np
from pydantic import ValidationError

from ane_spec.content_digest import DIGEST, Digest, Hasher, new_hasher
from ane_spec.errors import ManifestError, TokenizerError, untrusted
from ane_spec.manifests.schema import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    EmbeddingsEntry,
    FileRef,
    GateResult,
    Manifest,
)
from ane_spec.model.direct_io import set_direct_io

if TYPE_CHECKING:
    from ane_spec.model.tokenizer_data import TokenizerData

_CHUNK = 1 << 22
# A direct read is one request to the disk, with no read-ahead: larger ones read faster here
# (a 1.4 GB package: 1.8 s at 4 MB, 1.6 s at 16 MB, hashing included).
_DIRECT_CHUNKS = 4
# A real manifest is tens of KB (RoPE factors, interfaces, gate figures).
MAX_MANIFEST_BYTES = 4 << 20
# A real .mlpackage holds about five files; a folder with more is not one of ours.
MAX_PACKAGE_FILES = 10_000
_NPY_HEADER_MAX = 16 + 10_000  # magic, version, length, and numpy's own header size limit
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISLNK, "a symlink"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file or folder"


def open_regular(path: Path, *, follow: bool = False) -> BinaryIO:
    """Open a regular file for reading without blocking on a FIFO and (unless `follow`, for
    paths the user typed) without following a final symlink; anything but a regular file is
    refused (ManifestError)."""
    flags = _OPEN_FLAGS & ~getattr(os, "O_NOFOLLOW", 0) if follow else _OPEN_FLAGS
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        raise ManifestError(f"{path}: cannot open: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise ManifestError(f"{path}: is {_kind(mode)}, not a regular file")
    return os.fdopen(fd, "rb")


def _walk_files(root: Path) -> list[tuple[tuple[str, ...], Path]]:
    """(relative parts, path) of every file under `root`, without recursion or symlinks."""
    files: list[tuple[tuple[str, ...], Path]] = []
    stack: list[tuple[tuple[str, ...], Path]] = [((), root)]
    while stack:
        parts, folder = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = (*parts, entry.name)
                if entry.is_dir(follow_symlinks=False):
                    stack.append((rel, Path(entry.path)))
                elif entry.is_file(follow_symlinks=False):
                    files.append((rel, Path(entry.path)))
                else:
                    mode = entry.stat(follow_symlinks=False).st_mode
                    raise ManifestError(f"{entry.path}: is {_kind(mode)} inside a package "
                                        "folder; only regular files and folders are accepted")
                if len(files) + len(stack) > MAX_PACKAGE_FILES:
                    raise ManifestError(f"{root}: holds more than {MAX_PACKAGE_FILES:,} entries;"
                                        " not a package this project built")
    # Sorted by path components: the order Path objects sort in, which earlier builds hashed in.
    return sorted(files)


def hash_path(path: Path, *, algorithm: Digest = DIGEST, threads: bool = False,
              uncached: bool = False, known: Mapping[str, Callable[[Hasher], int]] | None = None
              ) -> tuple[int, str]:
    """(bytes, hex digest) of a file, or of a folder (an .mlpackage) as its sorted relative
    paths and contents, so renaming or editing any file inside changes the hash.

    `uncached`: read past the page cache where the OS allows it (O_DIRECT), for files just
    written past it that nothing else will read here (the build's packages, blob_file.py).
    `known`: files (by absolute path) whose contents a function feeds to the hash instead, and
    counts (a weight file hashed from the memory it is being written from)."""
    h = new_hasher(algorithm, threads=threads)
    total = 0
    if stat.S_ISDIR(os.lstat(path).st_mode):
        files = [("/".join(parts).encode() + b"\0", f) for parts, f in _walk_files(path)]
    else:
        files = [(b"", path)]
    # page-aligned, as O_DIRECT needs; two, to read one while the other is hashed
    size = _CHUNK * _DIRECT_CHUNKS
    buffers = (mmap.mmap(-1, size), mmap.mmap(-1, size)) if uncached else None
    try:
        for name, f in files:
            h.update(name)
            feed = (known or {}).get(os.path.abspath(f))
            if feed is not None:
                total += feed(h)
                continue
            with open_regular(f) as fh:
                if buffers is not None and set_direct_io(fh.fileno(), True):
                    total += _hash_direct(fh.fileno(), buffers, h)
                    continue
                while block := fh.read(_CHUNK):
                    h.update(block)
                    total += len(block)
    finally:
        for buffer in buffers or ():
            buffer.close()
    return total, h.hexdigest()


def _hash_direct(fd: int, buffers: tuple[mmap.mmap, mmap.mmap], h: Hasher) -> int:
    """Hash the rest of `fd` (opened with O_DIRECT), reading the next chunk into one buffer
    while the other is hashed. A direct read has no read-ahead: one at a time, the disk and
    the hash (sha256 then) took turns (a 1.4 GB package: 2.1 s, 1.1 of it CPU). Both release
    the GIL.
    Returns the bytes."""
    total, k = 0, 0
    with ThreadPoolExecutor(1, thread_name_prefix="hash-read") as reader:
        n = _read_direct(fd, buffers[k])
        while n:
            ahead = reader.submit(_read_direct, fd, buffers[1 - k])
            with memoryview(buffers[k]) as view:
                h.update(view[:n])
            total += n
            n, k = ahead.result(), 1 - k
    return total


def _read_direct(fd: int, buffer: mmap.mmap) -> int:
    """One read of `fd` into `buffer`; a filesystem that took O_DIRECT but refuses its reads
    (EINVAL) is read on through the cache."""
    while True:
        try:
            return os.readv(fd, [buffer])
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            set_direct_io(fd, False)


def file_ref(root: Path, path: Path, *, uncached: bool = False,
             known: Mapping[str, Callable[[Hasher], int]] | None = None) -> FileRef:
    size, digest = hash_path(path, uncached=uncached, known=known)
    return FileRef(path=path.relative_to(root).as_posix(), bytes=size, **{DIGEST: digest})


def resolve_artifact(root: Path, rel: str, where: Path) -> Path:
    """`root/rel`, checked component by component: it must exist, pass through no symlink,
    and end at a regular file or a folder. `rel` is already a plain relative path (schema)."""
    path = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = path / part
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            raise ManifestError(f"{where}: artifact {untrusted(rel)} is missing") from None
        except OSError as exc:
            raise ManifestError(f"{where}: artifact {untrusted(rel)}: "
                                f"{exc.strerror or exc}") from None
        last = i == len(parts) - 1
        if stat.S_ISDIR(mode) or (last and stat.S_ISREG(mode)):
            continue
        raise ManifestError(f"{where}: artifact {untrusted(rel)} is refused: "
                            f"{untrusted('/'.join(parts[:i + 1]))} is {_kind(mode)}")
    return path


@dataclass
class LoadedManifest:
    manifest: Manifest
    root: Path
    _tokenizer: "TokenizerData | None" = field(default=None, repr=False)

    def path(self, ref: FileRef) -> Path:
        return self.root / ref.path

    @property
    def file(self) -> Path:
        return self.root / MANIFEST_NAME

    def tokenizer_data(self) -> "TokenizerData":
        """The build's tokenizer.json, validated (ManifestError if it is not a valid one)."""
        if self._tokenizer is None:
            from ane_spec.model.tokenizer_data import TokenizerData

            path = self.path(self.manifest.tokenizer)
            with open_regular(path) as fh:
                raw = fh.read()
            try:
                self._tokenizer = TokenizerData.model_validate_json(raw)
            except ValidationError as exc:
                raise ManifestError(f"{path}: not a valid tokenizer: {_first(exc)}") from None
            except TokenizerError as exc:
                raise ManifestError(f"{path}: {exc}") from None
        return self._tokenizer


def manifest_path(location: str | os.PathLike[str]) -> Path:
    p = Path(location)
    return p / MANIFEST_NAME if p.is_dir() else p


def all_file_refs(m: Manifest) -> list[FileRef]:
    refs = [m.tokenizer, *(h.file for h in m.heads), *(s.file for s in m.shards)]
    return refs + list(m.embeddings.files.values())


def load_manifest(location: str | os.PathLike[str], *, verify: bool = True) -> LoadedManifest:
    """Load `manifest.json` (or the folder holding it); with `verify`, check every named file's
    size and hash so a tampered or half-copied artifact is refused before anything runs, and
    parse the tokenizer. Paths, file kinds and the embeddings' .npy headers are always checked."""
    path = manifest_path(location)
    if not path.is_file():
        raise ManifestError(f"{path}: no manifest here (build one with `ane-spec build`)")
    with open_regular(path, follow=True) as fh:
        text = fh.read(MAX_MANIFEST_BYTES + 1)
    if len(text) > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path}: larger than {MAX_MANIFEST_BYTES >> 20} MB; not a manifest")
    manifest = parse_manifest(text, path)
    loaded = LoadedManifest(manifest, path.parent)
    targets = {id(ref): resolve_artifact(loaded.root, ref.path, path)
               for ref in all_file_refs(manifest)}
    _check_embeddings(manifest.embeddings, loaded, path)
    if verify:
        for ref in all_file_refs(manifest):
            size, digest = hash_path(targets[id(ref)], algorithm=ref.algorithm, threads=True)
            if size != ref.bytes:
                raise ManifestError(f"{path}: artifact {untrusted(ref.path)} has {size:,} bytes, "
                                    f"the manifest records {ref.bytes:,} (incomplete copy?)")
            if digest != ref.digest:
                raise ManifestError(f"{path}: artifact {untrusted(ref.path)} does not match its "
                                    f"recorded {ref.algorithm} (modified after the build?)")
        loaded.tokenizer_data()
    return loaded


def parse_manifest(text: bytes | str, where: Path) -> Manifest:
    """JSON text -> a validated Manifest, or ManifestError naming the field and the problem."""
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not a number a manifest may hold")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise ValueError(f"{literal[:20]} overflows a float")
        return value

    try:
        raw = json.loads(text, parse_constant=no_constants, parse_float=finite)
    except RecursionError:
        raise ManifestError(f"{where}: not valid JSON: nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, our hooks, oversized integers
        raise ManifestError(f"{where}: not valid JSON: {untrusted(str(exc), 200)}") from None
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version != SCHEMA_VERSION:
        raise ManifestError(f"{where}: schema_version {untrusted(version)} is not supported "
                            f"(this ane-spec reads version {SCHEMA_VERSION}); rebuild the "
                            "artifacts")
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"{where}: invalid manifest: {_first(exc)}") from None
    except TokenizerError as exc:  # not expected from the schema, but never a traceback
        raise ManifestError(f"{where}: invalid manifest: {exc}") from None


def _first(exc: ValidationError) -> str:
    """The first problem as "at 'field.path': message" (the path may hold the file's keys)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    return f"at {untrusted(where)}: {msg}" if where else msg


def _check_embeddings(e: EmbeddingsEntry, loaded: LoadedManifest, where: Path) -> None:
    """The .npy headers must describe exactly the table the manifest records, and the files
    must hold exactly that many bytes: the runtime memory-maps them as described."""
    d = e.dim
    expected = {"qs": ("int8", (e.vocab_size, d)), "scales": ("float16", (e.vocab_size, d // 32)),
                "table": ("float16", (e.vocab_size, d))}
    if e.format == "q8_0" and d % 32:
        raise ManifestError(f"{where}: q8_0 embeddings need a dim divisible by 32, got {d}")
    for role, ref in e.files.items():
        path = loaded.path(ref)
        dtype, shape = expected[role]
        with open_regular(path) as fh:
            # Parsed from a bounded prefix: a v2 header may claim a 4 GB length, and numpy
            # reads that many bytes from a file before checking its limit of 10,000.
            head = io.BytesIO(fh.read(_NPY_HEADER_MAX))
            size = os.fstat(fh.fileno()).st_size
        try:
            version = np.lib.format.read_magic(head)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                      np.lib.format.read_array_header_2_0)(head)
        except (ValueError, TypeError, SyntaxError, OverflowError) as exc:
            raise ManifestError(f"{where}: {untrusted(ref.path)} is not a valid .npy file: "
                                f"{untrusted(str(exc), 120)}") from None
        data_start = head.tell()
        got_shape, fortran, got_dtype = header
        if (got_dtype != np.dtype(dtype) or fortran or tuple(got_shape) != shape
                or size != data_start + math.prod(shape) * np.dtype(dtype).itemsize):
            raise ManifestError(f"{where}: {untrusted(ref.path)} holds {got_dtype} "
                                f"{untrusted(tuple(got_shape))} ({size:,} bytes); the manifest "
                                f"needs {dtype} {shape}")


def write_manifest(manifest: Manifest, folder: Path) -> Path:
    """Write atomically: a reader sees the old manifest or the new one, never half of one.
    The text is parsed back first, so nothing the loader would refuse is ever written."""
    path = folder / MANIFEST_NAME
    text = manifest.model_dump_json(indent=2) + "\n"
    try:
        parse_manifest(text, path)
    except ManifestError as exc:
        raise ManifestError(f"refusing to write a manifest the loader would refuse ({exc})") \
            from None
    tmp = folder / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def record_gate(location: str | os.PathLike[str], name: str, result: GateResult) -> None:
    """Store a gate's verdict in the manifest (read without re-hashing the artifacts)."""
    loaded = load_manifest(location, verify=False)
    loaded.manifest.gates[name] = result
    write_manifest(loaded.manifest, loaded.root)


def record_drift(location: str | os.PathLike[str], key: str, drift: float) -> None:
    """Store a backend's measured T=4-vs-T=1 logit drift for the exactness guard."""
    if not (isinstance(drift, (int, float)) and math.isfinite(drift) and drift >= 0):
        raise ManifestError(f"the measured {key} drift is {drift!r}, not a finite number >= 0; "
                            "not recorded (the guard cannot use it)")
    loaded = load_manifest(location, verify=False)
    loaded.manifest.drift[key] = float(drift)
    write_manifest(loaded.manifest, loaded.root)
