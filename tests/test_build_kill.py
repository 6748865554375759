"""Builds killed, raced, starved and pulled from under: the previous or the new build survives
whole, the next build leaves no litter, and every failure is one line.

Build processes of a 1-layer model are SIGKILLed at random moments (seeded) after they report
their first step, with and without a previous build, and between the two steps of the swap
through the build's fault hook (ANE_SPEC_BUILD_FAULT). Most are forked from this process and run
the CLI's `main(["build", ...])` (importing coremltools takes ~5-10 s, a fork nothing); the
SIGBUS case starts a fresh interpreter. Every build sees a temp folder of the test's, so
coremltools' temporary packages leaking there would be seen.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from ane_spec.cli import main
from ane_spec.errors import BuildError, GGUFError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards.build import BuildRequest, build

REPO = Path(__file__).resolve().parent.parent
RNG = random.Random(14)
REQUEST = BuildRequest(max_seq=64, head_chunks=2)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("kill") / "m.gguf",
                                preset("tiny", num_layers=1))


@pytest.fixture
def system_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The temp folder every build in the test sees, in-process and in subprocesses."""
    folder = tmp_path / "system-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def litter(out: Path, system_tmp: Path) -> list[str]:
    siblings = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return siblings + [p.name for p in system_tmp.iterdir()]


class ForkedBuild:
    """`ane-spec build ARGS` in a forked child: its stderr is a pipe, its temp folder ours."""

    def __init__(self, argv: list[str], system_tmp: Path, fault: str = ""):
        read_end, write_end = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child never returns into pytest
            try:
                os.dup2(write_end, 2)
                os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                sys.stdout = open(os.devnull, "w")
                os.environ["ANE_SPEC_BUILD_FAULT"] = fault
                tempfile.tempdir = str(system_tmp)
                os._exit(main(["build", *argv]))
            finally:
                os._exit(99)
        os.close(write_end)
        self.stderr = os.fdopen(read_end, "r")

    def wait_for(self, prefix: str) -> None:
        for line in self.stderr:
            if line.startswith(prefix):
                return
        raise AssertionError(f"the build ended (status {self.wait()}) before {prefix!r}")

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        self.stderr.close()
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def kill_randomly(gguf: Path, out: Path, system_tmp: Path, *extra: str) -> float:
    proc = ForkedBuild([str(gguf), "--out", str(out), "--max-seq", "64", *extra], system_tmp)
    proc.wait_for("[build] hashing")
    # The rest of this build takes 1-3 s here: the kill lands anywhere from hashing to the swap
    # (or after the end, which must be harmless too).
    delay = RNG.uniform(0.0, 2.5)
    time.sleep(delay)
    proc.kill()
    assert proc.wait() in (-signal.SIGKILL, 0)
    return delay


def test_killed_without_a_previous_build(gguf: Path, tmp_path: Path, system_tmp: Path) -> None:
    out = tmp_path / "art"
    for _ in range(2):
        delay = kill_randomly(gguf, out, system_tmp)
        if out.exists():  # killed after the swap: the new build, whole
            load_manifest(out, verify=True)
            build(gguf, out, REQUEST, force=True)
        else:
            build(gguf, out, REQUEST)
        assert litter(out, system_tmp) == [], f"kill after {delay:.2f}s"
        load_manifest(out, verify=True)
        shutil.rmtree(out)


def test_killed_with_a_previous_build(gguf: Path, tmp_path: Path, system_tmp: Path) -> None:
    out = tmp_path / "art"
    build(gguf, out, REQUEST)
    previous = (out / "manifest.json").read_text()
    for _ in range(2):
        delay = kill_randomly(gguf, out, system_tmp, "--force", "--head-chunks", "3")
        now = load_manifest(out, verify=True).manifest
        assert now.build.head_chunks in (2, 3), delay
        if now.build.head_chunks == 2:
            assert (out / "manifest.json").read_text() == previous, delay
        build(gguf, out, REQUEST, force=True)  # the next build cleans up
        assert litter(out, system_tmp) == [], f"kill after {delay:.2f}s"
        load_manifest(out, verify=True)
        previous = (out / "manifest.json").read_text()


@pytest.mark.parametrize("fault", ["kill-mid-swap", "no-exchange,kill-mid-swap"])
def test_killed_between_the_two_steps_of_the_swap(gguf: Path, tmp_path: Path, system_tmp: Path,
                                                  fault: str) -> None:
    out = tmp_path / "art"
    build(gguf, out, REQUEST)
    proc = ForkedBuild([str(gguf), "--out", str(out), "--max-seq", "64", "--force",
                        "--head-chunks", "3"], system_tmp, fault=fault)
    assert proc.wait() == -signal.SIGKILL
    left = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir() if p.name.startswith("."))
    if fault == "kill-mid-swap":
        # One atomic exchange: OUT is already the new build; the old one waits to be deleted.
        assert load_manifest(out, verify=True).manifest.build.head_chunks == 3
        assert left == [".art.building", ".art.lock"]
    else:
        # Two renames: OUT is missing until the next build puts the complete new one there.
        assert not out.exists() and left == [".art.building", ".art.lock", ".art.old"]
    result = build(gguf, out, REQUEST.model_copy(update={"head_chunks": 3}), force=True)
    assert sorted(result.reused) == ["head.mlpackage", "shards/layers_00_01.mlpackage"]
    assert litter(out, system_tmp) == []
    assert load_manifest(out, verify=True).manifest.build.head_chunks == 3


def test_killed_while_calibrating_beside_the_conversion(gguf: Path, tmp_path: Path,
                                                      system_tmp: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A build calibrating in its child process (scale_aside.py, as a 3.8B model's build does)
    killed while it calibrates and converts (the first time with no previous build, then with
    one): the next build cleans up and leaves nothing behind (the child ends by itself once
    its build is gone: test_scale_aside.py)."""
    from ane_spec.shards import scale_aside

    monkeypatch.setattr(scale_aside, "ASIDE_MIN_PARAMETERS", 0)   # the fork inherits it
    out = tmp_path / "art"
    for _ in range(2):
        proc = ForkedBuild([str(gguf), "--out", str(out), "--max-seq", "64", "--force"],
                           system_tmp)
        proc.wait_for("[build] calibrating activations in a child process")
        time.sleep(RNG.uniform(0.0, 1.5))
        proc.kill()
        assert proc.wait() in (-signal.SIGKILL, 0)
        build(gguf, out, REQUEST, force=True)
        assert litter(out, system_tmp) == []
        load_manifest(out, verify=True)


def test_second_build_into_the_same_new_output_is_refused(gguf: Path, tmp_path: Path,
                                                          system_tmp: Path) -> None:
    out = tmp_path / "art"
    proc = ForkedBuild([str(gguf), "--out", str(out), "--max-seq", "64"], system_tmp)
    proc.wait_for("[build] hashing")
    with pytest.raises(BuildError, match=rf"another build \(PID {proc.pid}\) is writing"):
        build(gguf, out, REQUEST)
    assert proc.wait() == 0
    load_manifest(out, verify=True)
    assert litter(out, system_tmp) == []


SHRINK_DURING_BUILD = """
import os, sys
from ane_spec.shards import scale_aside
from ane_spec.shards.build import BuildRequest, build
path, out, aside = sys.argv[1], sys.argv[2], sys.argv[3] == "aside"
if aside:  # what a large model gets: calibration in a child process, hashing in a thread
    scale_aside.ASIDE_MIN_PARAMETERS = 0
def progress(msg):
    if msg.startswith("hashing"):
        os.truncate(path, os.path.getsize(path) // 2)
build(path, out, BuildRequest(max_seq=64), progress=progress)
"""


@pytest.mark.parametrize("order", ["serial", "aside"])
def test_gguf_shrinking_under_the_build_is_one_line(gguf: Path, tmp_path: Path,
                                                    order: str) -> None:
    """The reads fault (SIGBUS) on the memory map: one line, status 2, nothing left; also when
    the faulting read is the hashing thread's beside the build, or the calibrating child's
    (which ends, and the build calibrates and faults itself)."""
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(gguf.read_bytes())
    out = tmp_path / "art"
    done = subprocess.run([sys.executable, "-c", SHRINK_DURING_BUILD, str(victim), str(out),
                           order],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("ane-spec build: error:")]
    assert errors == [f"ane-spec build: error: victim.gguf changed during the build (it shrank "
                      f"while being read); {out} was left as it was"]
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["victim.gguf"]


def test_gguf_rewritten_during_the_build_is_refused(gguf: Path, tmp_path: Path,
                                                    system_tmp: Path) -> None:
    """A change that does not fault (same size, new mtime) is caught between steps."""
    victim = tmp_path / "victim.gguf"
    victim.write_bytes(gguf.read_bytes())
    out = tmp_path / "art"
    build(victim, out, REQUEST)
    before = (out / "manifest.json").read_text()

    def touch(msg: str) -> None:
        if msg.startswith("shard"):
            st = victim.stat()
            os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))

    with pytest.raises(GGUFError, match="victim.gguf changed during the build"):
        build(victim, out, REQUEST.model_copy(update={"head_chunks": 3}), force=True,
              progress=touch)
    assert (out / "manifest.json").read_text() == before
    assert litter(out, system_tmp) == []


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                          capture_output=True)
    return done.returncode == 0


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0,
                    reason="a small tmpfs needs root on Linux")
# 300k fills up while blob_file.py writes the weights (an OSError), 500k while coremltools' C++
# package writer copies the spec into the package (its RuntimeError), 700k while the embeddings
# are written (an OSError: written through a memory map, as they were until 2026-12-02, it was
# a SIGBUS that ended the process); a whole build needs ~0.9 MB here. Read-only fails at the
# lock.
@pytest.mark.parametrize("options", ["size=300k", "size=500k", "size=700k", "size=2m,ro"])
def test_full_or_read_only_disk_is_one_line(gguf: Path, tmp_path: Path, system_tmp: Path,
                                            options: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, options):
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        rc = main(["build", str(gguf), "--out", str(disk / "art"), "--max-seq", "64"])
        err = [ln for ln in capsys.readouterr().err.splitlines()
               if not ln.startswith("[build]")]
        assert rc == 2 and len(err) == 1, err
        expected = "Read-only file system" if "ro" in options else \
            "No space left on device|MiB free where the build is written"
        assert err[0].startswith("ane-spec build: error: ")
        assert re.search(expected, err[0]), err[0]
        assert os.listdir(disk) == [] and os.listdir(system_tmp) == []
    finally:
        subprocess.run(["umount", str(disk)], check=True)
