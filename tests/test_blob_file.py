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
    monkeypatch.setattr(os, "readv", readv)
    assert store.hash_path(f, uncached=True) == plain
    assert len(refused) == 1
