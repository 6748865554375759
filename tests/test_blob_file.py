"""blob_file.BlobFileWriter writes the files coremltools' own blob writer writes, byte for byte
(the real `libmilstoragepython` writer runs here), whether its writes go past the page cache or
through it, across its staging buffer's edges, and refuses what it does not write."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from coremltools.libmilstoragepython import _BlobStorageReader, _BlobStorageWriter

from ane_spec.shards import direct_file
from ane_spec.shards.blob_file import BLOB_TYPES, BlobFileWriter


def _arrays(stage: int) -> list[tuple[str, np.ndarray]]:
    """Blobs of every byte-sized type, odd sizes among them, and some over the staging
    buffer (`stage` bytes) or ending right at its edge."""
    rng = np.random.default_rng(8)
    out: list[tuple[str, np.ndarray]] = []
    for method, (dtype, _) in BLOB_TYPES.items():
        for n in (1, 7, 64, 1000):
            if dtype.kind == "f":
                a = rng.standard_normal(n).astype(dtype)
            else:
                info = np.iinfo(dtype)
                a = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
            out.append((method, a))
    big = rng.integers(-128, 127, size=3 * stage + 13, dtype=np.int8)
    out.append(("write_int8_data", big))
    # 64 header + 64 metadata + data ending exactly at the second stage's end
    out.append(("write_uint8_data", np.ones(stage - 64, np.uint8)))
    out.append(("write_fp16_data", rng.standard_normal(stage // 2 + 1).astype(np.float16)
                .view(np.uint16)))
    return out


def _takes_direct_writes(folder: Path) -> bool:
    import mmap
    import os

    probe = folder / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except (OSError, AttributeError):
        return False
    try:
        with mmap.mmap(-1, 4096) as block:
            os.write(fd, block)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("direct", [True, False])
def test_the_file_is_coremltools_own(direct: bool, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    stage = 1 << 16   # small, so the blobs cross it many times
    monkeypatch.setattr(direct_file, "STAGE_BYTES", stage)
    blobs = _arrays(stage)
    theirs = _BlobStorageWriter(str(tmp_path / "theirs.bin"))
    expected = [getattr(theirs, method)(a) for method, a in blobs]
    del theirs
    ours = BlobFileWriter(str(tmp_path / "ours.bin"), direct=direct)
    offsets = [getattr(ours, method)(a) for method, a in blobs]
    ours.close()
    ours.close()   # a second close changes nothing
    if direct:   # past the cache wherever this filesystem takes direct writes
        assert ours.direct == _takes_direct_writes(tmp_path)
    assert offsets == expected
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
    # and coremltools' reader reads it back
    reader = _BlobStorageReader(str(tmp_path / "ours.bin"))
    method, big = blobs[-3]
    assert (reader.read_int8_data(offsets[-3]) == big).all()


def test_what_it_does_not_write_is_refused(tmp_path: Path) -> None:
    w = BlobFileWriter(str(tmp_path / "w.bin"))
    with pytest.raises(TypeError, match="int8"):
        w.write_int8_data(np.zeros(3, np.uint8))
    with pytest.raises(NotImplementedError, match="sub-byte"):
        w.write_int4_data(np.zeros(3, np.int8))
    with pytest.raises(ValueError, match="new files"):
        BlobFileWriter(str(tmp_path / "x.bin"), truncate_file=False)
    w.close()
    with pytest.raises(ValueError, match="closed"):
        w.write_int8_data(np.zeros(3, np.int8))
    # an empty file is the header alone, as coremltools writes it
    theirs = _BlobStorageWriter(str(tmp_path / "theirs.bin"))
    del theirs
    assert (tmp_path / "w.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()


def test_a_discarded_writer_closes_its_file(tmp_path: Path) -> None:
    import os

    w = BlobFileWriter(str(tmp_path / "w.bin"))
    w.write_int8_data(np.ones(10, np.int8))
    fd = w._file._fd
    w.discard()
    with pytest.raises(OSError):
        os.fstat(fd)
    w.close()   # nothing left to finish


def test_hashing_past_the_page_cache_hashes_the_same(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """store.hash_path(uncached=True), which the build hashes its packages with, gives the
    hash and size the plain reads give: a folder of odd-sized, empty and multi-chunk files,
    one of them written past the cache and never synced, and a lone file."""
    from ane_spec.manifests import store

    monkeypatch.setattr(store, "_CHUNK", 1 << 16)
    monkeypatch.setattr(store, "_DIRECT_CHUNKS", 1)   # files of many direct reads, too
    pkg = tmp_path / "p.mlpackage"
    (pkg / "Data" / "weights").mkdir(parents=True)
    rng = np.random.default_rng(2)
    (pkg / "Manifest.json").write_bytes(b'{"a": 1}')
    (pkg / "Data" / "empty").write_bytes(b"")
    (pkg / "Data" / "odd.bin").write_bytes(rng.bytes(3 * (1 << 16) + 5))
    w = BlobFileWriter(str(pkg / "Data" / "weights" / "weight.bin"))
    w.write_int8_data(rng.integers(-9, 9, size=200_001, dtype=np.int8))
    w.close()
    plain = store.hash_path(pkg)
    assert store.hash_path(pkg, uncached=True) == plain
    assert plain[0] == sum(f.stat().st_size for f in pkg.rglob("*") if f.is_file())
    lone = pkg / "Data" / "odd.bin"
    assert store.hash_path(lone, uncached=True) == store.hash_path(lone)
    lone.write_bytes(lone.read_bytes()[:-1] + b"\0")   # and it does read the bytes
    assert store.hash_path(pkg, uncached=True) != plain


@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_filesystem_without_direct_io_gets_buffered_writes(
        refused_at: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where O_DIRECT is refused (EINVAL, as some filesystems answer at open and some only at
    the first write), the writer goes on buffered and the file is the same."""
    import errno
    import fcntl
    import os

    if refused_at == "write" and not _takes_direct_writes(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT at open: no direct write to refuse")
    real_open, real_write = os.open, os.write
    refused: list[str] = []

    def open_(path, flags, *args):
        if refused_at == "open" and flags & os.O_DIRECT:
            refused.append("open")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def write(fd, data):
        if refused_at == "write" and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append("write")
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    stage = 1 << 16
    monkeypatch.setattr(direct_file, "STAGE_BYTES", stage)
    blobs = _arrays(stage)
    theirs = _BlobStorageWriter(str(tmp_path / "theirs.bin"))
    expected = [getattr(theirs, method)(a) for method, a in blobs]
    del theirs
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "write", write)
    ours = BlobFileWriter(str(tmp_path / "ours.bin"))
    offsets = [getattr(ours, method)(a) for method, a in blobs]
    ours.close()
    monkeypatch.undo()
    assert refused == [refused_at] and not ours.direct
    assert offsets == expected
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()


def test_hashing_goes_on_through_the_cache_where_direct_reads_are_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem may take O_DIRECT at open and refuse the reads (EINVAL): the hash is read
    on through the cache, the same hash."""
    import errno
    import fcntl
    import os

    from ane_spec.manifests import store

    if not _takes_direct_writes(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT: no direct read to refuse")
    f = tmp_path / "w.bin"
    f.write_bytes(np.random.default_rng(4).bytes(3 * (1 << 16) + 9))
    plain = store.hash_path(f)
    real_readv = os.readv
    refused: list[int] = []

    def readv(fd, buffers):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(fd)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_readv(fd, buffers)

    monkeypatch.setattr(store, "_CHUNK", 1 << 16)
    monkeypatch.setattr(store, "_DIRECT_CHUNKS", 1)
    monkeypatch.setattr(os, "readv", readv)
    assert store.hash_path(f, uncached=True) == plain
    assert len(refused) == 1


def _held_writes(monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[int]]:
    """DirectFile's writes wait for the returned event; the list gets each write's length."""
    import threading

    go = threading.Event()
    lengths: list[int] = []
    real = direct_file.DirectFile._write_stage

    def held(self, length: int) -> None:
        go.wait(30)
        lengths.append(length)
        real(self, length)

    monkeypatch.setattr(direct_file.DirectFile, "_write_stage", held)
    return go, lengths


def test_borrowed_bytes_are_written_while_the_caller_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`append(borrowed=True)` queues the caller's own bytes and returns before they reach
    the disk; `close()` waits for them. The file is what was appended, in order."""
    monkeypatch.setattr(direct_file, "STAGE_BYTES", 1 << 16)
    go, lengths = _held_writes(monkeypatch)
    rng = np.random.default_rng(5)
    parts = [rng.bytes(n) for n in (100, 3 << 16, 7, (1 << 16) - 107, 12345)]
    f = direct_file.DirectFile(tmp_path / "f.bin")
    for p in parts:
        f.append(np.frombuffer(p, np.uint8), borrowed=p is parts[1])
    assert f.size == sum(map(len, parts)) and lengths == []   # nothing written yet
    go.set()
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == b"".join(parts)
    assert len(lengths) >= 5


def test_copied_bytes_ahead_of_the_disk_are_bounded(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer faster than the disk waits once OWNED_BYTES_AHEAD copied bytes are queued,
    rather than holding everything it made."""
    import threading

    monkeypatch.setattr(direct_file, "STAGE_BYTES", 4096)
    monkeypatch.setattr(direct_file, "OWNED_BYTES_AHEAD", 3 * 4096)
    go, _ = _held_writes(monkeypatch)
    f = direct_file.DirectFile(tmp_path / "f.bin")
    appended: list[int] = []

    def produce() -> None:
        for i in range(40):
            f.append(bytes([i]) * 4096)
            appended.append(i)

    producer = threading.Thread(target=produce)
    producer.start()
    producer.join(1.0)
    assert producer.is_alive() and len(appended) <= 6   # the limit, one item over, the stage
    go.set()
    producer.join(30)
    f.close()
    assert (tmp_path / "f.bin").read_bytes() == b"".join(bytes([i]) * 4096 for i in range(40))


def test_a_failed_write_is_raised_by_the_writers_caller(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """What the writer thread fails with (a full disk) comes out of the next `append` or of
    `close()`, once; the file is closed either way."""
    import errno
    import os
    import time

    monkeypatch.setattr(direct_file, "STAGE_BYTES", 4096)

    def full(self, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.path)

    monkeypatch.setattr(direct_file.DirectFile, "_write_stage", full)
    f = direct_file.DirectFile(tmp_path / "f.bin")
    f.append(bytes(3 * 4096))
    deadline = time.monotonic() + 30
    while f._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left"):
        f.append(b"more")
    fd = f._fd
    with pytest.raises(OSError, match="No space left"):
        f.close()
    assert f.closed
    with pytest.raises(OSError):
        os.fstat(fd)
    g = direct_file.DirectFile(tmp_path / "g.bin")   # a failure first seen at close()
    g.append(bytes(10))
    with pytest.raises(OSError, match="No space left"):
        g.close()
    assert g.closed


def test_a_weight_file_finished_later_may_move_meanwhile(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`finish_later` returns while the writes go on; the file can be renamed in the meantime
    (the package's weights folder is moved into place), and it is coremltools' own file once
    the future ends: the header's blob count is written through a descriptor of its own."""
    import os

    stage = 1 << 16
    monkeypatch.setattr(direct_file, "STAGE_BYTES", stage)
    go, _ = _held_writes(monkeypatch)
    blobs = _arrays(stage)
    theirs = _BlobStorageWriter(str(tmp_path / "theirs.bin"))
    expected = [getattr(theirs, method)(a) for method, a in blobs]
    del theirs
    ours = BlobFileWriter(str(tmp_path / "ours.bin"))
    offsets = [getattr(ours, method)(a) for method, a in blobs]
    done = ours.finish_later()
    assert not done.done() and ours.size == (tmp_path / "theirs.bin").stat().st_size
    os.rename(tmp_path / "ours.bin", tmp_path / "moved.bin")
    go.set()
    done.result(30)
    assert offsets == expected
    assert (tmp_path / "moved.bin").read_bytes() == (tmp_path / "theirs.bin").read_bytes()
    ours.close()   # finished already: nothing more


def test_a_file_discarded_while_finishing_stops_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build that fails stops the weight files still being written: the writer ends at its
    next stage, the finish fails, and the descriptors are closed."""
    import os
    import threading

    monkeypatch.setattr(direct_file, "STAGE_BYTES", 4096)
    go, lengths = _held_writes(monkeypatch)
    w = BlobFileWriter(str(tmp_path / "w.bin"))
    w.write_int8_data(np.ones(10 * 4096, np.int8))
    done = w.finish_later()
    fd = w._file._fd
    threading.Timer(0.2, go.set).start()   # the write under way ends; no other starts
    w.discard()
    with pytest.raises(ValueError, match="discarded"):
        done.result(30)
    assert len(lengths) <= 1
    with pytest.raises(OSError):
        os.fstat(fd)


def test_the_file_hashed_from_memory_is_the_file_on_disk(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """hash_into feeds the hash the finished file's bytes (the header with its final count
    first) without reading it, lets go of the views as it goes, and is asked once, after
    finish_later; store.hash_path takes it in place of the file's read."""
    from ane_spec.content_digest import DIGEST, new_hasher
    from ane_spec.manifests.store import hash_path

    stage = 1 << 16
    monkeypatch.setattr(direct_file, "STAGE_BYTES", stage)
    path = tmp_path / "pkg" / "weights" / "weight.bin"
    path.parent.mkdir(parents=True)
    (tmp_path / "pkg" / "model.mlmodel").write_bytes(b"spec")
    ours = BlobFileWriter(str(path))
    blobs = _arrays(stage)
    for method, a in blobs:
        getattr(ours, method)(a)
    with pytest.raises(ValueError, match="needs a finishing file"):
        ours.hash_into(new_hasher(DIGEST))
    done = ours.finish_later()
    known = {str(path.resolve()): ours.hash_into}
    got = hash_path(tmp_path / "pkg", known=known)
    done.result()
    assert got == hash_path(tmp_path / "pkg") == hash_path(tmp_path / "pkg", uncached=True)
    h = new_hasher(DIGEST)
    with pytest.raises(ValueError, match="once"):
        ours.hash_into(h)
    alone = BlobFileWriter(str(tmp_path / "alone.bin"))
    for method, a in blobs:
        getattr(alone, method)(a)
    done = alone.finish_later()
    n = alone.hash_into(h)
    done.result()
    assert (n, h.hexdigest()) == hash_path(tmp_path / "alone.bin")
