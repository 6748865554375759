"""The residual scale decided beside the conversion (shards/scale_aside.py, issue 33 item 7): the
calibration runs in a helper thread while the first shard's weights convert, and the build is
the one the serial order makes: same k, same calibration record, same package contents."""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from pathlib import Path

import blake3
import pytest
import torch

from ane_spec.cli import main
from ane_spec.errors import BuildError
from ane_spec.manifests.store import load_manifest
from ane_spec.model import reference
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards import build as build_module
from ane_spec.shards import scale_aside
from ane_spec.shards.build import BuildRequest, build, describe_functions
from ane_spec.shards.programs import MAX_T, layer_program
from tests.gguf_edit import gguf_layout

S = 64
REQUEST = BuildRequest(topology="1,1", max_seq=S, head_chunks=2)


@pytest.fixture(scope="module")
def overflowing_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers whose stream peaks near 2e5 (test_residual_scale.py): auto picks k < 0, so
    the fold after the conversion has something to scale."""
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


def test_aside_builds_what_the_serial_order_builds(overflowing_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Same k, same calibration maxima (bit for bit, although the serial run uses two torch
    threads and the aside one a single thread), same package contents; and the calibration
    really ran while layer 0 was converting (it waits here until that has started: in the
    serial order it would wait in vain and the build would be refused)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        build(overflowing_gguf, tmp_path / "serial", REQUEST, calibrate_aside=False)
    finally:
        torch.set_num_threads(threads)

    converting = threading.Event()
    real_layer_weights = build_module.layer_weights
    real_calibrate = scale_aside.calibrate

    def layer_weights(*args, **kwargs):
        converting.set()
        return real_layer_weights(*args, **kwargs)

    def calibrate(*args, **kwargs):
        if not converting.wait(30):
            raise BuildError("the calibration did not overlap the conversion")
        return real_calibrate(*args, **kwargs)

    monkeypatch.setattr(build_module, "layer_weights", layer_weights)
    monkeypatch.setattr(scale_aside, "calibrate", calibrate)
    said: list[str] = []
    build(overflowing_gguf, tmp_path / "aside", REQUEST, calibrate_aside=True,
          progress=said.append)

    aside = _record(tmp_path / "aside")
    assert aside == _record(tmp_path / "serial") and aside["log2_factor"] < 0
    assert _package_contents(tmp_path / "aside") == _package_contents(tmp_path / "serial")
    assert len(_package_contents(tmp_path / "aside")) >= 6   # 2 shards + head, 2 files each
    assert said[0] == "calibrating activations beside the conversion (second core)"
    # The file's hashes were taken beside it too (nothing to reuse): the same ones.
    assert said[1] == f"hashing {overflowing_gguf.name} beside the conversion"
    source = [json.loads((tmp_path / d / "manifest.json").read_text())["source"]["blake3"]
              for d in ("aside", "serial")]
    assert source[0] == source[1] == blake3.blake3(overflowing_gguf.read_bytes()).hexdigest()
    # k is said once, after the calibration's own lines and before any shard's.
    scale = next(i for i, m in enumerate(said) if m.startswith("residual scale:"))
    assert scale > max(i for i, m in enumerate(said) if m.startswith("calibrating"))
    assert scale < min(i for i, m in enumerate(said) if m.startswith("shard "))
    assert not [t for t in threading.enumerate() if t.name == "calibrate-activations"]


def test_progress_is_only_said_by_the_building_thread(overflowing_gguf: Path,
                                                       tmp_path: Path) -> None:
    """The calibration's lines are relayed, never said from its own thread: a caller's
    progress callback need not be thread-safe."""
    callers: set[str] = set()
    said: list[str] = []

    def progress(message: str) -> None:
        callers.add(threading.current_thread().name)
        said.append(message)

    build(overflowing_gguf, tmp_path / "out", REQUEST, calibrate_aside=True, progress=progress)
    assert callers == {threading.current_thread().name}
    assert any(m.startswith("calibrating activations: 5 prompts") for m in said)


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
    """A NaN in layer 1: shard 1 (layer 0) converts while the calibration finds it; the build
    then fails with the calibration's own line, naming the tensor, and leaves nothing."""
    bad = _poisoned_copy(overflowing_gguf, tmp_path / "bad.gguf", "blk.1.ffn_down.weight")
    monkeypatch.setattr(scale_aside, "ASIDE_MIN_PARAMETERS", 0)  # what a 3.8B model gets
    out = tmp_path / "art"
    rc = main(["build", str(bad), "--out", str(out), "--topology", "1,1", "--max-seq", str(S)])
    err = capsys.readouterr().err.splitlines()
    errors = [ln for ln in err if not ln.startswith("[build]")]
    assert rc == 2 and errors == [
        "ane-spec build: error: tensor 'blk.1.ffn_down.weight' (Q8_0 scales) holds NaN or "
        "infinite values (first at row 0); the GGUF file is corrupt"], err
    assert "[build] calibrating activations beside the conversion (second core)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


def test_a_failed_conversion_stops_the_calibration(overflowing_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The build fails while the calibration still runs: the calibration stops at its next
    layer instead of running on (it would hold a core and the file until it finished)."""
    layers_run = []
    real_layer = reference.ReferenceModel._layer_rows

    def slow_layer(self, i, *args, **kwargs):
        layers_run.append(i)
        time.sleep(0.5)
        return real_layer(self, i, *args, **kwargs)

    def failing(*args, **kwargs):
        raise BuildError("conversion failed here")

    monkeypatch.setattr(reference.ReferenceModel, "_layer_rows", slow_layer)
    monkeypatch.setattr(build_module, "layer_weights", failing)
    with pytest.raises(BuildError, match="conversion failed here"):
        build(overflowing_gguf, tmp_path / "art", REQUEST, calibrate_aside=True)
    assert not [t for t in threading.enumerate()
                if t.name in ("calibrate-activations", "hash-gguf")]
    # A whole calibration runs both layers (all prompts' rows at once); it stopped within one.
    assert len(layers_run) < 2
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
    assert said[0].startswith("calibrating activations beside")


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
