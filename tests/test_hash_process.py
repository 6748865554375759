"""The GGUF's hashes taken by a child process while `ane-spec build` imports (model/hash_process.py,
issue 33's build cost): the same hashes the build takes itself, used only for the file the build
holds open, and never a reason for a build to fail or for hashing to outlive it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import blake3
import pytest

from ane_spec.cli import main
from ane_spec.model import hash_process
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.hash_process import HashesAhead


def test_the_child_gives_the_hashes_the_build_takes(tiny_gguf: Path) -> None:
    model = open_gguf(tiny_gguf)
    with HashesAhead(tiny_gguf) as ahead:
        got = ahead.result(model.identity)
    assert got == model.content_hashes()
    assert got[0] == blake3.blake3(tiny_gguf.read_bytes()).hexdigest()


def test_hashes_of_another_file_are_not_used(tiny_gguf: Path, tmp_path: Path) -> None:
    """Same bytes, another file (as when the path is replaced between the child's start and the
    build's open): the build hashes the file it holds, and says why."""
    other = tmp_path / "copy.gguf"
    shutil.copyfile(tiny_gguf, other)
    model = open_gguf(other)
    said: list[str] = []
    with HashesAhead(tiny_gguf) as ahead:
        assert ahead.hashes_for(model, said.append) == model.content_hashes()
        assert ahead.why_not == "the file it hashed is not the one the build opened"
    assert said == ["hashing copy.gguf (the hashes taken ahead are unusable: the file it hashed "
                    "is not the one the build opened)"]


def test_a_child_that_fails_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with HashesAhead(bad) as ahead:
        assert ahead.result((0, 0, 0, 0)) is None
    assert ahead.why_not.startswith("it failed (GGUFError: bad.gguf"), ahead.why_not


def test_a_closed_child_gives_nothing(tiny_gguf: Path) -> None:
    ahead = HashesAhead(tiny_gguf)
    child = ahead._child
    ahead.close()
    assert child is not None and child.returncode is not None   # killed or done, and reaped
    assert ahead.result(open_gguf(tiny_gguf).identity) is None
    assert ahead.why_not == "it was stopped"


def test_a_child_whose_build_is_gone_stops(tiny_gguf: Path) -> None:
    """The child stops at its first block once its parent is not the build that started it
    (a killed build's orphan is re-parented): here, a parent it never had."""
    not_parent = 1 if os.getppid() != 1 else 2
    child = subprocess.run([sys.executable, "-m", "ane_spec.model.hash_process", str(tiny_gguf),
                            str(not_parent)], capture_output=True, text=True, timeout=120)
    assert child.returncode == 1 and child.stdout == ""
    assert child.stderr.startswith("HashingStopped: hashing tiny.gguf stopped"), child.stderr


@pytest.mark.parametrize("output", [b"", b"{}", b"not json",
                                    json.dumps({"identity": [1, 2, 3, 4], "digest": "x" * 64,
                                                "tensors": {}}).encode()])
def test_output_that_is_not_hashes_is_not_used(output: bytes, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "child.py"
    script.write_text(f"import sys; sys.stdout.buffer.write({output!r})")
    monkeypatch.setattr(hash_process, "_child_command", lambda path: [sys.executable, path])
    ahead = HashesAhead(script)
    assert ahead.result((1, 2, 3, 4)) is None
    assert ahead.why_not.startswith("its output is not what it should be"), ahead.why_not


def test_the_cli_build_uses_the_child_s_hashes(tiny_gguf: Path, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """A build whose hashes came from the child fingerprints its packages as a build that
    hashed in its own process: a forced rebuild over it reuses every package."""
    out = tmp_path / "art"
    args = ["build", str(tiny_gguf), "--out", str(out), "--max-seq", "64"]
    monkeypatch.setattr(hash_process, "AHEAD_MIN_BYTES", 1 << 62)
    assert main(args) == 0
    first = json.loads((out / "manifest.json").read_text())
    capsys.readouterr()

    used: list[str] = []
    hashes_for = HashesAhead.hashes_for

    def spy(self: HashesAhead, model, say):
        got = hashes_for(self, model, say)
        used.append(self.why_not)
        return got

    monkeypatch.setattr(hash_process, "AHEAD_MIN_BYTES", 0)
    monkeypatch.setattr(HashesAhead, "hashes_for", spy)
    assert main([*args, "--force"]) == 0
    assert used == [""]   # asked once, and its hashes were usable
    printed = capsys.readouterr()
    built = len(first["shards"]) + len(first["heads"])
    assert f"built 0 and reused {built} packages" in printed.out
    assert "hashing" not in printed.err
    second = json.loads((out / "manifest.json").read_text())
    assert second["source"]["blake3"] == first["source"]["blake3"] == blake3.blake3(
        tiny_gguf.read_bytes()).hexdigest()
