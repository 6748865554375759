"""The compiled-model cache: where it lives, atomic publishing, and two processes compiling one
package at once. The compiler is injected (only macOS has Core ML's); everything else is real."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ane_spec.errors import AneSpecError
from ane_spec.runtime import compiled_cache
from ane_spec.runtime.compiled_cache import CACHE_ENV, cache_root, cached_path, compile_cached

SHA = "0123456789abcdef" * 4
ROOT = Path(__file__).parents[1]


def fake_compile(log: list[str]):
    def compile_to(src: Path, dst: Path) -> None:
        assert dst.name.endswith(".mlmodelc") and not dst.exists()
        log.append(src.name)
        dst.mkdir()
        (dst / "model.mil").write_text(f"compiled from {src.name}")
    return compile_to


def test_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert cache_root() == tmp_path / "c"
    assert cached_path(SHA) == tmp_path / "c" / "compiled" / f"{SHA}.mlmodelc"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.setattr(sys, "platform", "darwin")
    assert cache_root() == Path.home() / "Library" / "Caches" / "ane-spec"
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "ane-spec"


@pytest.mark.parametrize("key", ["../../etc", "ABC", SHA[:-1], SHA + "0", "/" + SHA[1:]])
def test_a_key_is_a_hash_never_a_path(key: str, tmp_path: Path) -> None:
    with pytest.raises(AneSpecError, match="not 64 hex digits"):
        cached_path(key, tmp_path)


def test_compiles_once_and_reuses_by_hash(tmp_path: Path) -> None:
    log: list[str] = []
    first = compile_cached(tmp_path / "a.mlpackage", SHA, fake_compile(log), tmp_path)
    assert first == tmp_path / "compiled" / f"{SHA}.mlmodelc"
    # Another package file with the same bytes (a rebuilt or copied build): no recompile.
    again = compile_cached(tmp_path / "copy.mlpackage", SHA, fake_compile(log), tmp_path)
    assert again == first and log == ["a.mlpackage"]
    assert (first / "model.mil").read_text() == "compiled from a.mlpackage"
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == [f"{SHA}.mlmodelc"]


def test_a_failed_compile_publishes_nothing(tmp_path: Path) -> None:
    def broken(src: Path, dst: Path) -> None:
        dst.mkdir()
        (dst / "half").write_text("x")
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="crashed"):
        compile_cached(tmp_path / "a.mlpackage", SHA, broken, tmp_path)
    assert list((tmp_path / "compiled").iterdir()) == []
    with pytest.raises(AneSpecError, match="no .mlmodelc"):
        compile_cached(tmp_path / "a.mlpackage", SHA, lambda s, d: None, tmp_path)
    assert list((tmp_path / "compiled").iterdir()) == []


def test_stale_temporary_folders_are_swept(tmp_path: Path) -> None:
    folder = tmp_path / "compiled"
    old, live = folder / ".compiling-dead", folder / ".compiling-live"
    for p in (old, live):
        p.mkdir(parents=True)
    past = time.time() - compiled_cache.STALE_TEMP_SECONDS - 60
    os.utime(old, (past, past))
    compile_cached(tmp_path / "a.mlpackage", SHA, fake_compile([]), tmp_path)
    assert not old.exists() and live.exists()


RACER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from ane_spec.runtime.compiled_cache import compile_cached

    root, sha, me = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    go = root / "go"

    def slow_compile(src, dst):
        (root / f"started-{me}").touch()
        while not go.exists():              # both compiles are under way before either ends
            time.sleep(0.01)
        dst.mkdir()
        for i in range(50):                 # a folder of many files, written over a while
            (dst / f"part{i}").write_text(me)
            time.sleep(0.002)

    out = compile_cached(Path(f"{me}.mlpackage"), sha, slow_compile, root)
    files = sorted(p.name for p in out.iterdir())
    owners = {p.read_text() for p in out.iterdir()}
    print(out, len(files), ",".join(sorted(owners)))
""")


def test_two_processes_compiling_one_package_both_end_with_a_valid_cache(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(tmp_path), SHA, name],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
              for name in ("p1", "p2")]
    deadline = time.time() + 60
    while not all((tmp_path / f"started-{n}").exists() for n in ("p1", "p2")):
        assert time.time() < deadline and all(r.poll() is None for r in racers), \
            [r.communicate() for r in racers]
        time.sleep(0.01)
    (tmp_path / "go").touch()
    results = [r.communicate(timeout=60) for r in racers]
    assert [r.returncode for r in racers] == [0, 0], results
    target = tmp_path / "compiled" / f"{SHA}.mlmodelc"
    lines = [out.split() for out, _ in results]
    # Both got the one published folder, complete (50 files) and from a single compile.
    assert [line[0] for line in lines] == [str(target)] * 2
    assert [line[1] for line in lines] == ["50", "50"]
    assert lines[0][2] == lines[1][2] in ("p1", "p2")
    assert sorted(p.name for p in (tmp_path / "compiled").iterdir()) == [target.name]
