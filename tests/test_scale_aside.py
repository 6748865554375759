"""The residual scale decided beside the build (shards/scale_aside.py, issue 33 item 7): the
calibration runs in a child process (shards/calibration_process.py: forked on Linux, spawned
elsewhere), and the build folds its shards at the k it can assume meanwhile, again if the
decision differs; what it writes is what the serial order writes: same k, same calibration
record, same package contents."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import blake3
import pytest
import torch

from ane_spec.cli import main
from ane_spec.errors import BuildError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.activation_range import CalibrationStopped
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards import build as build_module
from ane_spec.shards import calibration_process, scale_aside
from ane_spec.shards.build import BuildRequest, build, describe_functions
from ane_spec.shards.programs import MAX_T, layer_program
from ane_spec.shards.scale_decision import STREAMS_PAST_FP16, assumed_log2
from tests.gguf_edit import gguf_layout

S = 64
REQUEST = BuildRequest(topology="1,1", max_seq=S, head_chunks=2)


@pytest.fixture(scope="module")
def overflowing_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers whose stream peaks near 2e5 (test_residual_scale.py): auto picks k < 0, so
    the fold after the conversion has something to scale, and the packages made at the
    assumed 2^0 must be made again."""
    spec = preset("tiny", num_layers=2, embed_std=1.0, branch_scale=3e4, seed=3)
    return write_synthetic_gguf(tmp_path_factory.mktemp("aside") / "overflow.gguf", spec)


def _package_contents(out: Path) -> dict[str, str]:
    """sha256 of every file of every package except Manifest.json, whose item identifiers
    are fresh UUIDs on each save (coremltools' ModelPackage)."""
    found = {}
    for f in sorted(out.rglob("*")):
        if f.is_file() and ".mlpackage/" in f.as_posix() and f.name != "Manifest.json":
            found[f.relative_to(out).as_posix()] = hashlib.sha256(f.read_bytes()).hexdigest()
    return found


def _record(out: Path) -> dict:
    rs = json.loads((out / "manifest.json").read_text())["residual_scale"]
    rs["calibration"].pop("seconds")
    return rs


def _embeddings(out: Path) -> dict:
    """The manifest's embeddings entry (each file's size and digest)."""
    return json.loads((out / "manifest.json").read_text())["embeddings"]


class _Children:
    """Every calibration child the test's builds start, to see that none outlives its build."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.procs: list = []
        real_init = calibration_process.CalibrationChild.__init__

        def init(child, *args, **kwargs):
            real_init(child, *args, **kwargs)
            self.procs.append(child._proc)

        monkeypatch.setattr(calibration_process.CalibrationChild, "__init__", init)

    def all_ended(self) -> bool:
        return all(p.poll() is not None for p in self.procs)


def _serial(gguf: Path, out: Path, request: BuildRequest = REQUEST) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        build(gguf, out, request, calibrate_aside=False)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_the_child_builds_what_the_serial_order_builds(overflowing_gguf: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        method: str) -> None:
    """Same k, same calibration maxima (bit for bit, although the serial run uses two torch
    threads and the child a single one), same package contents; the shards were made at the
    assumed 2^0 before the decision came, then again at its k < 0, and said so. Both ways of
    starting the child: forked (Linux) and spawned (macOS)."""
    monkeypatch.setattr(calibration_process, "START_METHOD", method)
    _serial(overflowing_gguf, tmp_path / "serial")
    children = _Children(monkeypatch)
    said: list[str] = []
    # The decision is held back until both shards are made (a slow calibration's order).
    real_done = calibration_process.CalibrationChild.done
    monkeypatch.setattr(calibration_process.CalibrationChild, "done", lambda child: (
        len([m for m in said if m.startswith("shard ")]) >= 2 and real_done(child)))
    build(overflowing_gguf, tmp_path / "aside", REQUEST, calibrate_aside=True,
          progress=said.append)

    aside = _record(tmp_path / "aside")
    assert aside == _record(tmp_path / "serial") and aside["log2_factor"] < 0
    assert _package_contents(tmp_path / "aside") == _package_contents(tmp_path / "serial")
    assert len(_package_contents(tmp_path / "aside")) >= 6   # 2 shards + head, 2 files each
    # The embeddings, first written at 2^0 too, were written again at k.
    assert _embeddings(tmp_path / "aside") == _embeddings(tmp_path / "serial")
    assert said[0] == ("calibrating activations in a child process, beside the build "
                       "(shards folded at 2^0 until it decides)")
    # The file's hashes were taken beside it too (nothing to reuse): the same ones.
    assert said[1] == f"hashing {overflowing_gguf.name} beside the conversion"
    source = [json.loads((tmp_path / d / "manifest.json").read_text())["source"]["blake3"]
              for d in ("aside", "serial")]
    assert source[0] == source[1] == blake3.blake3(overflowing_gguf.read_bytes()).hexdigest()
    k = aside["log2_factor"]
    remade = said.index(f"residual scale: the calibration chose 2^{k}; building the 2 shard(s) "
                        "folded at the assumed 2^0 again")
    shard_lines = [i for i, m in enumerate(said) if m.startswith("shard ")]
    assert len(shard_lines) == 4 and shard_lines[1] < remade < shard_lines[2]
    assert all(said[i].endswith("; folded at 2^0 until decided") for i in shard_lines[:2])
    assert not any(said[i].endswith("until decided") for i in shard_lines[2:])
    assert any(m.startswith("calibrating activations: 5 prompts") for m in said)
    assert len(children.procs) == 1 and children.all_ended()


def test_an_assumption_the_calibration_confirms_is_built_once(tiny_gguf: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A model whose stream stays within fp16 (k = 0, the assumption): each package is made
    once, before the decision, and is the serial order's."""
    request = BuildRequest(topology="2,1", max_seq=S, head_chunks=2)
    _serial(tiny_gguf, tmp_path / "serial", request)
    children = _Children(monkeypatch)
    said: list[str] = []
    build(tiny_gguf, tmp_path / "aside", request, calibrate_aside=True, progress=said.append)
    assert _record(tmp_path / "aside") == _record(tmp_path / "serial")
    assert _record(tmp_path / "aside")["log2_factor"] == 0
    assert _package_contents(tmp_path / "aside") == _package_contents(tmp_path / "serial")
    assert len([m for m in said if m.startswith("shard ")]) == 2
    assert not any("building them again" in m for m in said)
    assert children.all_ended()


def test_what_a_build_may_assume() -> None:
    """`2^K` and `off` are their own decision; `auto` assumes 2^0 except where streams are
    known to pass fp16's range, where the build waits."""
    assert assumed_log2("2^-3", "llama") == -3 and assumed_log2("off", "gemma3") == 0
    assert assumed_log2("auto", "phi3") == 0 and assumed_log2("auto", "qwen2") == 0
    assert "gemma3" in STREAMS_PAST_FP16 and assumed_log2("auto", "gemma3") is None


def test_with_no_assumption_the_build_waits_and_builds_once(overflowing_gguf: Path,
                                                            tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """An architecture the build makes no assumption for (as Gemma under auto): it waits for
    the decision before its first package, and makes each once."""
    from ane_spec.model.gguf_file import open_gguf

    arch = open_gguf(overflowing_gguf).config.arch
    monkeypatch.setattr("ane_spec.shards.scale_decision.STREAMS_PAST_FP16", frozenset({arch}))
    said: list[str] = []
    build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True,
          progress=said.append)
    assert said[0] == "calibrating activations in a child process, beside the build"
    assert len([m for m in said if m.startswith("shard ")]) == 2
    assert not any("until decided" in m or "building them again" in m for m in said)
    scale = next(i for i, m in enumerate(said) if m.startswith("residual scale:"))
    assert scale < min(i for i, m in enumerate(said) if m.startswith("shard "))


def test_progress_is_only_said_by_the_building_thread(overflowing_gguf: Path,
                                                       tmp_path: Path) -> None:
    """The child's lines are relayed, never said from a reader thread: a caller's progress
    callback need not be thread-safe."""
    callers: set[str] = set()
    said: list[str] = []

    def progress(message: str) -> None:
        callers.add(threading.current_thread().name)
        said.append(message)

    build(overflowing_gguf, tmp_path / "out", REQUEST, calibrate_aside=True, progress=progress)
    assert callers == {threading.current_thread().name}
    assert any(m.startswith("calibrating activations: 5 prompts") for m in said)


def test_the_child_stops_when_its_build_has_gone() -> None:
    """The child's checkpoint returns while the parent holds its end of the pipe (and writes
    nothing to it), and raises CalibrationStopped once that end is closed."""
    read_end, write_end = os.pipe()
    watch = calibration_process._ParentWatch(read_end)
    watch.checkpoint()
    watch.checkpoint()
    os.close(write_end)
    with pytest.raises(CalibrationStopped):
        watch.checkpoint()
    os.close(read_end)


def test_a_killed_build_leaves_no_calibrating_child(overflowing_gguf: Path, tmp_path: Path
                                                    ) -> None:
    """A build SIGKILLed while its child calibrates: the child sees its pipe close and ends by
    itself (nothing else could end it)."""
    script = (
        "import sys, time\n"
        "from ane_spec.model.gguf_file import open_gguf\n"
        "from ane_spec.shards.calibration_process import CalibrationChild\n"
        "child = CalibrationChild(open_gguf(sys.argv[1]), 'auto')\n"
        "print(child._proc.pid, flush=True)\n"
        "time.sleep(60)\n")
    build_proc = subprocess.Popen([sys.executable, "-c", script, str(overflowing_gguf)],
                                  stdout=subprocess.PIPE, text=True)
    child_pid = int(build_proc.stdout.readline())
    build_proc.kill()
    build_proc.wait()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and _alive(child_pid):
        time.sleep(0.1)
    assert not _alive(child_pid)


def test_the_forked_child_holds_none_of_the_builds_files(overflowing_gguf: Path,
                                                          tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The fork closes what it inherited but its pipes: above all the build's flock()ed lock
    file, which a child's copy of the descriptor would keep locked after a killed build."""
    monkeypatch.setattr(calibration_process, "START_METHOD", "fork")
    children = _Children(monkeypatch)
    real_calibrate = calibration_process._calibrate

    def slow(*args: object) -> int:   # still running when shard 1 is made
        time.sleep(3)
        return real_calibrate(*args)

    monkeypatch.setattr(calibration_process, "_calibrate", slow)
    seen: list[list[str]] = []

    def progress(message: str) -> None:
        if message.startswith("shard 1/2") and not seen:
            fds = Path(f"/proc/{children.procs[0].pid}/fd")
            seen.append(sorted(os.readlink(fd) for fd in fds.iterdir() if int(fd.name) > 2))

    out = tmp_path / "art"
    build(overflowing_gguf, out, REQUEST, calibrate_aside=True, progress=progress)
    assert seen and all(link.startswith("pipe:") for link in seen[0]), seen
    assert len(seen[0]) == 3   # its stdin-like end, its output, its stderr


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for a reaper that is gone counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_child_that_fails_is_replaced_by_the_calibration_here(overflowing_gguf: Path,
                                                                 tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 method: str) -> None:
    """A child that crashed (here: its calibration raises, or the spawned interpreter exits 1
    with a line on stderr) gives no ranges; the build calibrates in its own process, says why,
    and builds what the serial order does."""
    _serial(overflowing_gguf, tmp_path / "serial")
    monkeypatch.setattr(calibration_process, "START_METHOD", method)

    def crash(*args: object) -> int:
        raise RuntimeError("Segmentation fault")

    monkeypatch.setattr(calibration_process, "_calibrate", crash)   # the fork's
    monkeypatch.setattr(calibration_process, "_child_command", lambda path, setting: [
        sys.executable, "-c", "import sys; print('RuntimeError: Segmentation fault', "
        "file=sys.stderr); sys.exit(1)"])   # the spawned one's
    said: list[str] = []
    build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True,
          progress=said.append)
    assert ("calibrating activations here (the calibration process is unusable: it failed "
            "(RuntimeError: Segmentation fault))") in said
    assert _record(tmp_path / "art") == _record(tmp_path / "serial")
    assert _package_contents(tmp_path / "art") == _package_contents(tmp_path / "serial")


def test_a_stuck_child_is_abandoned(overflowing_gguf: Path, tmp_path: Path,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked child that stops using CPU while the build waits for it (here: it sleeps, as
    one deadlocked on a lock inherited from another thread would) is killed after
    STALLED_SECONDS, and the build calibrates itself instead of waiting for ever."""
    monkeypatch.setattr(calibration_process, "START_METHOD", "fork")
    monkeypatch.setattr(scale_aside, "STALLED_SECONDS", 1.0)
    monkeypatch.setattr(calibration_process, "_calibrate", lambda *args: time.sleep(600))
    children = _Children(monkeypatch)
    said: list[str] = []
    started = time.monotonic()
    build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True,
          progress=said.append)
    assert time.monotonic() - started < 120
    assert ("calibrating activations here (the calibration process is unusable: it made no "
            "progress for 1 s)") in said
    assert [p.returncode for p in children.procs] == [-signal.SIGKILL]
    assert load_manifest(tmp_path / "art").manifest.residual_scale.log2_factor < 0


def test_a_child_that_read_another_file_is_not_believed(overflowing_gguf: Path,
                                                        tiny_gguf: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """The spawned child reports the identity of the file it read: ranges of another file
    (here: it is handed another path) are refused, and the build calibrates its own."""
    monkeypatch.setattr(calibration_process, "START_METHOD", "spawn")
    real = calibration_process._child_command
    monkeypatch.setattr(calibration_process, "_child_command",
                        lambda path, setting: real(os.fspath(tiny_gguf), setting))
    said: list[str] = []
    build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True,
          progress=said.append)
    assert ("calibrating activations here (the calibration process is unusable: the file it "
            "read is not the one the build opened)") in said
    assert load_manifest(tmp_path / "art").manifest.residual_scale.log2_factor < 0


def _poisoned_copy(src: Path, dst: Path, tensor: str) -> Path:
    """`src` with the fp16 scale of `tensor`'s first Q8_0 block set to NaN."""
    data = bytearray(src.read_bytes())
    offset, _, gtype = gguf_layout(bytes(data)).tensor_data[tensor]
    assert gtype == 8  # Q8_0
    data[offset:offset + 2] = struct.pack("<H", 0x7E00)
    dst.write_bytes(bytes(data))
    return dst


def test_a_failed_calibration_fails_the_build_in_one_line(overflowing_gguf: Path,
                                                          tmp_path: Path, capsys,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A NaN in layer 1: shard 1 (layer 0) is made while the child's calibration finds it; the
    build then fails with the calibration's own line, naming the tensor, and leaves nothing."""
    bad = _poisoned_copy(overflowing_gguf, tmp_path / "bad.gguf", "blk.1.ffn_down.weight")
    monkeypatch.setattr(scale_aside, "ASIDE_MIN_PARAMETERS", 0)  # what a 3.8B model gets
    out = tmp_path / "art"
    rc = main(["build", str(bad), "--out", str(out), "--topology", "1,1", "--max-seq", str(S)])
    err = capsys.readouterr().err.splitlines()
    errors = [ln for ln in err if not ln.startswith("[build]")]
    assert rc == 2 and errors == [
        "ane-spec build: error: tensor 'blk.1.ffn_down.weight' (Q8_0 scales) holds NaN or "
        "infinite values (first at row 0); the GGUF file is corrupt"], err
    assert ("[build] calibrating activations in a child process, beside the build (shards "
            "folded at 2^0 until it decides)") in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_failed_conversion_stops_the_calibration(overflowing_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The build fails while the child still calibrates (slowed here, so that it surely does):
    the child is killed, not left to run on (it would hold a core and the file until it
    finished), and nothing is left behind."""
    children = _Children(monkeypatch)
    real_calibrate = calibration_process._calibrate

    def slow(*args: object) -> int:
        time.sleep(60)
        return real_calibrate(*args)

    monkeypatch.setattr(calibration_process, "_calibrate", slow)

    def failing(*args, **kwargs):
        raise BuildError("conversion failed here")

    monkeypatch.setattr(build_module, "layer_weights", failing)
    with pytest.raises(BuildError, match="conversion failed here"):
        build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True)
    assert [p.returncode for p in children.procs] == [-signal.SIGKILL]
    assert not [t for t in threading.enumerate() if t.name.startswith("calibration-child")]
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_rebuild_reuses_under_the_decided_scale(overflowing_gguf: Path, tmp_path: Path) -> None:
    """Fingerprints hold k: a rebuild whose shards the previous build matches waits for the
    decision and reuses them; one whose previous build had another k converts meanwhile and
    rebuilds them."""
    out = tmp_path / "art"
    build(overflowing_gguf, out, REQUEST, calibrate_aside=True)
    again = build(overflowing_gguf, out, REQUEST.model_copy(update={"head_chunks": 3}),
                  force=True, calibrate_aside=True)
    assert sorted(again.reused) == ["shards/layers_00_01.mlpackage",
                                    "shards/layers_01_02.mlpackage"]
    k = load_manifest(out).manifest.residual_scale.log2_factor
    build(overflowing_gguf, out, REQUEST.model_copy(update={"residual_scale": "off"}),
          force=True, calibrate_aside=True)
    said: list[str] = []
    last = build(overflowing_gguf, out, REQUEST, force=True, calibrate_aside=True,
                 progress=said.append)
    assert last.reused == [] and load_manifest(out).manifest.residual_scale.log2_factor == k
    assert said[0].startswith("calibrating activations in a child process")


def test_small_models_calibrate_first(tiny_gguf: Path, tmp_path: Path) -> None:
    """Below ASIDE_MIN_PARAMETERS the calibration runs before the conversion, as before: a
    thread would gain nothing on a second-long calibration."""
    said: list[str] = []
    build(tiny_gguf, tmp_path / "art", BuildRequest(topology="3", max_seq=S), progress=said.append)
    assert said[0].startswith("hashing") and said[1].startswith("calibrating activations: 5")


def test_the_shard_line_names_each_function_and_its_token_counts(tiny_gguf: Path,
                                                                 tmp_path: Path) -> None:
    """The hook for a second function (a fixed-T prefill): `describe_functions` reads the
    token axis from `main`'s flexible input and each other function's size there."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import Function, types

    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.shards.layer_weights import layer_weights
    from ane_spec.shards.programs import HIDDEN_IN, OPSET

    said: list[str] = []
    build(tiny_gguf, tmp_path / "art", BuildRequest(topology="3", max_seq=S), progress=said.append)
    assert [m.split(", ")[2] for m in said if m.startswith("shard 1/1")] == [
        f"functions main (T 1..{MAX_T})"]

    model = open_gguf(tiny_gguf)
    prog = layer_program(0, [layer_weights(model, 0, "int8-channel", {})], model.config, S,
                         "BCT1")
    fixed = {HIDDEN_IN: mb.TensorSpec((1, model.config.hidden_size, 64, 1), dtype=types.fp16)}
    with Function(fixed, opset_version=OPSET) as prefill:
        prefill.set_outputs([mb.identity(x=prefill.inputs[HIDDEN_IN])])
    prog.add_function("prefill", prefill)
    assert describe_functions(prog) == f"main (T 1..{MAX_T}), prefill (T 64)"


def test_hashing_aside_gives_the_serial_hashes_and_stops_when_told(tiny_gguf: Path) -> None:
    from ane_spec.model.gguf_file import HashingStopped, open_gguf
    from ane_spec.shards.hash_aside import HashAside

    model = open_gguf(tiny_gguf)
    with HashAside(model) as aside:
        assert aside.result() == model.content_hashes()
    stop = threading.Event()
    stop.set()
    with pytest.raises(HashingStopped):
        model.content_hashes(stop=stop)
