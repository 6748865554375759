"""The conversion's reduced pass pipeline (shards/conversion_passes.py) writes the packages
coremltools' default pipeline writes, byte for byte, for every kind of program the build makes.

Each case is built twice through the real build and save_package, once with `pass_pipeline`
forced to the default (None) and once to CONVERSION_PASSES; every file of every package must be
equal except Manifest.json (fresh UUIDs on every save). A program change that makes another
default pass matter, or a coremltools release whose default pipeline does more, fails here."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from pathlib import Path

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.backend.mil import load as backend_load
from coremltools.converters.mil.mil import Program, types
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY
from gguf import GGMLQuantizationType
from gguf import dequantize as gguf_dequantize
from gguf import quantize as gguf_quantize

from ane_spec.manifests.store import load_manifest
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards import conversion_passes, programs
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.conversion_passes import CONVERSION_PASSES, conversion_pipeline
from tests.gguf_edit import rewrite_gguf

OFF = {"residual_scale": "off"}   # the calibration is not what is compared here
CASES = {
    # q8-block weights, the BC1T layout, an argmax head, the additive mask form
    "phi3": ("tiny", {"num_layers": 2},
             dict(OFF, topology="1,1", layout="BC1T", weights="q8-block", head_argmax=True,
                  mask_form="additive")),
    # fp16 weights, a scaled stream (eps * s^2), a head split over packages
    "phi3-scaled": ("tiny", {"num_layers": 1},
                    dict(residual_scale="2^-1", weights="fp16", head_chunks=4,
                         max_head_mb=0.1)),
    "llama": ("tiny", {"arch": "llama", "num_layers": 1}, OFF),      # NORM RoPE reordering
    "qwen2": ("tiny", {"arch": "qwen2", "num_layers": 1}, OFF),      # q|k|v bias: fused
    "qwen3": ("tiny", {"arch": "qwen3", "num_layers": 1}, OFF),      # per-head q/k norms
    "gemma3-ring": ("gemma3-tiny", {"seed": 11}, dict(OFF, max_seq=512)),
    "gemma3-full": ("gemma3-tiny", {"seed": 11}, dict(OFF, max_seq=512, swa_ring=False)),
    # a down projection over more than the ANE's 16,384 inputs: a sum of two convs
    "deep-ffn": ("tiny", {"hidden_size": 64, "num_layers": 1, "num_heads": 2,
                          "num_kv_heads": 1, "ffn_size": 16416, "vocab_size": 512,
                          "rope_dims": 24}, OFF),
}


def _contents(out: Path) -> dict[str, str]:
    return {f.relative_to(out).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*"))
            if f.is_file() and ".mlpackage/" in f.as_posix() and f.name != "Manifest.json"}


def _build_with(gguf: Path, out: Path, request: BuildRequest, pipeline,
                monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    convert = ct.convert

    def forced(*args, **kwargs):
        # a fresh pipeline per package; a layer package's two functions keep their weights'
        # sharing pass, which both sides run last
        shared = "ane_spec::share_weights_across_functions" in kwargs["pass_pipeline"].passes
        kwargs["pass_pipeline"] = pipeline()
        if shared:
            kwargs["pass_pipeline"] = programs.with_weight_sharing(kwargs["pass_pipeline"])
        return convert(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(programs.ct, "convert", forced)
        build(gguf, out, request)
    return _contents(out)


def _same_packages(gguf: Path, tmp_path: Path, request: BuildRequest,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    default = _build_with(gguf, tmp_path / "default", request,
                          lambda: ct.PassPipeline.DEFAULT, monkeypatch)
    reduced = _build_with(gguf, tmp_path / "reduced", request, conversion_pipeline,
                          monkeypatch)
    assert len(default) >= 4 and reduced == default


@pytest.mark.parametrize("case", sorted(CASES))
def test_reduced_pipeline_writes_the_default_pipelines_packages(
        case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    name, spec, options = CASES[case]
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset(name, **spec))
    _same_packages(gguf, tmp_path, BuildRequest(**{"max_seq": 64, **options}), monkeypatch)


def test_reduced_pipeline_with_lut8_weights(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """auto weights where int8 falls short: lut8 tables, F16 and Q5_0 sources."""
    gguf = _outlier_gguf(tmp_path)
    request = BuildRequest(max_seq=64, weights="auto", residual_scale="off")
    _same_packages(gguf, tmp_path, request, monkeypatch)
    shard = load_manifest(tmp_path / "reduced").manifest.shards[0]
    assert "lut8" in {t.format for t in shard.quant.tensors.values()}


def test_the_pipeline_is_the_passes_named() -> None:
    assert conversion_pipeline().passes == list(CONVERSION_PASSES)


def test_package_written_in_place_is_the_saved_one(tiny_gguf: Path, tmp_path: Path) -> None:
    """`convert_options`' package_dir, `weights_written_once` and `finish_package` write the
    package MLModel.save would have copied there from a temporary folder, byte for byte (but
    Manifest.json's UUIDs): the spec with the metadata ct.convert records after writing its
    package, the weights coremltools' writer lays out from its own copies."""
    import tempfile

    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.shards.conversion_passes import (
        convert_options,
        finish_package,
        weights_written_once,
    )
    from ane_spec.shards.layer_weights import layer_weights

    model = open_gguf(tiny_gguf)
    layers = [layer_weights(model, i, "int8-channel", {}) for i in range(2)]
    inputs = None

    def convert(**options):
        nonlocal inputs
        prog = programs.layer_program(0, layers, model.config, 64, "BCT1")
        if inputs is None:
            inputs = [ct.TensorType(name=n, shape=tuple(
                ct.RangeDim(1, programs.MAX_T, default=programs.DEFAULT_T)
                if not isinstance(d, (int, np.integer)) else int(d) for d in v.shape),
                dtype=np.float16) for n, v in prog.functions["main"].inputs.items()
                if not ct.converters.mil.mil.types.is_state(v.sym_type)]
        return ct.convert(prog, inputs=inputs, minimum_deployment_target=programs.OPSET,
                          compute_precision=ct.precision.FLOAT32, skip_model_load=True,
                          convert_to="mlprogram", **options)

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    saved_at, in_place = tmp_path / "saved" / "p.mlpackage", tmp_path / "in-place" / "p.mlpackage"
    previous, tempfile.tempdir = tempfile.tempdir, str(scratch)
    try:
        convert(pass_pipeline=conversion_pipeline()).save(str(saved_at))
        with weights_written_once():
            finish_package(convert(**convert_options(in_place)), in_place)
    finally:
        tempfile.tempdir = previous
    # The weights byte for byte; the spec as a message: finish_package serialises it with its
    # map fields in key order (deterministic=True: two builds of one program write one file),
    # MLModel.save in whatever order the maps hold, which can differ between two conversions
    in_place_files, saved_files = _contents(in_place.parent), _contents(saved_at.parent)
    assert len(in_place_files) == 2 and in_place_files.keys() == saved_files.keys()
    weights = "p.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    assert in_place_files[weights] == saved_files[weights]
    from coremltools.proto import Model_pb2

    from ane_spec.shards.conversion_passes import SPEC_IN_PACKAGE
    read = [Model_pb2.Model.FromString(Path(p, *SPEC_IN_PACKAGE).read_bytes())
            for p in (in_place, saved_at)]
    assert read[0] == read[1]


def _outlier_gguf(tmp_path: Path) -> Path:
    """A file where int8 falls short under auto weights (an outlier column): lut8 tables, F16
    and Q5_0 sources (test_weight_formats.py's file)."""
    spec = preset("tiny", arch="llama", hidden_size=512, num_heads=8, num_kv_heads=2,
                  ffn_size=1024, num_layers=1, embed_std=1.0, branch_scale=1.0, seed=3)
    src = write_synthetic_gguf(tmp_path / "plain.gguf", spec)

    def outliers(name: str, data: np.ndarray, qtype: GGMLQuantizationType):
        if name not in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight"):
            return None
        w = gguf_dequantize(data, qtype).copy()
        w[:, 130] *= 100
        if "attn" in name:
            return w.astype(np.float16), GGMLQuantizationType.F16
        return gguf_quantize(w, GGMLQuantizationType.Q5_0), GGMLQuantizationType.Q5_0

    return rewrite_gguf(src, tmp_path / "outliers.gguf", arch="llama", tensor_override=outliers)


@pytest.mark.parametrize("case", ["lut8", "phi3", "phi3-scaled", "qwen2"])
def test_weights_written_once_are_coremltools_own(case: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole build's packages with `weights_written_once` and with coremltools' own
    flatten-and-copy, byte for byte: int8 and uint8 (lut8 indices) weights, fp16 weights,
    scales, tables and biases, an argmax head's int32."""
    if case == "lut8":
        gguf = _outlier_gguf(tmp_path)
        request = BuildRequest(max_seq=64, weights="auto", residual_scale="off")
    else:
        name, spec, options = CASES[case]
        gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset(name, **spec))
        request = BuildRequest(**{"max_seq": 64, **options})
    once = build(gguf, tmp_path / "once", request)
    with monkeypatch.context() as m:
        m.setattr(programs, "weights_written_once", contextlib.nullcontext)
        build(gguf, tmp_path / "copied", request)
    once_files, copied_files = _contents(tmp_path / "once"), _contents(tmp_path / "copied")
    assert once_files == copied_files and len(once_files) >= 2 * len(once.built)
    if case == "lut8":
        shard = load_manifest(tmp_path / "once").manifest.shards[0]
        assert "lut8" in {t.format for t in shard.quant.tensors.values()}


@pytest.mark.parametrize("dtype", ["float32", "float16", "uint8", "int8", "uint16", "int16",
                                   "int32", "uint32"])
def test_each_weight_dtype_is_written_as_coremltools_writes_it(dtype: str,
                                                               tmp_path: Path) -> None:
    """Consts of each byte-sized dtype coremltools' blob writer takes, one non-contiguous,
    through its own `_get_offset_by_writing_data` and writer, and through what
    `weights_written_once` puts in their place: the same offsets, the same file."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.backend.mil import helper, load
    from coremltools.converters.mil.mil import types as mil_types
    from coremltools.libmilstoragepython import _BlobStorageWriter

    from ane_spec.shards.blob_file import BlobFileWriter
    from ane_spec.shards.conversion_passes import weights_written_once

    rng = np.random.default_rng(5)
    if dtype.startswith("float"):
        values = [rng.standard_normal((6, 10)).astype(dtype)]
    else:
        info = np.iinfo(dtype)
        values = [rng.integers(max(info.min, -1000), min(info.max, 1000),
                               size=(6, 10)).astype(dtype)]
    values += [values[0].T, values[0][:5, :7]]   # not C-contiguous; not a multiple of 64 bytes
    consts = []

    @mb.program(input_specs=[mb.TensorSpec((1,), dtype=mil_types.fp16)],
                opset_version=ct.target.iOS18)
    def prog(x):
        consts.extend(mb.const(val=v) for v in values)
        return x

    original = helper._get_offset_by_writing_data
    path = tmp_path / "coremltools.bin"
    writer = _BlobStorageWriter(str(path))
    expected = [original(c, writer) for c in consts]
    del writer   # the C++ writer finishes its file when destroyed
    with weights_written_once():
        writer = load.BlobWriter(str(tmp_path / "once.bin"))
        assert isinstance(writer, BlobFileWriter)
        offsets = [helper._get_offset_by_writing_data(c, writer) for c in consts]
        writer.close()
    assert helper._get_offset_by_writing_data is original and load.BlobWriter is not BlobFileWriter
    assert offsets == expected
    assert (tmp_path / "once.bin").read_bytes() == path.read_bytes()


def _small_program():
    @mb.program(input_specs=[mb.TensorSpec((1, 8), dtype=types.fp16)],
                opset_version=programs.OPSET)
    def prog(x):
        return mb.mul(x=mb.add(x=x, y=np.float16(1)), y=np.float16(2), name="y")

    return prog


def _on_backend_writer(monkeypatch: pytest.MonkeyPatch, record: Callable[[], object]) -> list:
    """What `record()` says each time coremltools' backend writer (load.py) is entered."""
    records: list = []
    load = backend_load.load

    def entered(*args, **kwargs):
        records.append(record())
        return load(*args, **kwargs)

    monkeypatch.setattr(backend_load, "load", entered)
    return records


def test_each_state_of_a_program_is_validated_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """save_package validates the program as built, after the main pipeline and after the
    backend one: not again before a pipeline when nothing touched it since the last check."""
    seen: list[int] = []
    validate = Program.validate

    def counted(self, *args, **kwargs):
        seen.append(id(self))
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(Program, "validate", counted)
    # the backend's writer (load.py) validates on its own afterwards: not counted here
    at_backend = _on_backend_writer(monkeypatch, lambda: len(seen))
    programs.save_package(_small_program(), tmp_path / "p.mlpackage")
    assert at_backend == [3]


class _UnlinkAConsumer(AbstractGraphPass):
    """Leaves a var believing an op consumes it twice: what Program.validate exists to catch."""

    def apply(self, prog: Program) -> None:
        op = prog.functions["main"].operations[-1]
        op.inputs["x"].add_child_op(op)


def test_a_pass_that_leaves_the_program_invalid_fails_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The main pipeline's last pass breaks the program: its final validation says so (the
    backend pipeline then starts without validating the same program again)."""
    # registered for this test only: the module is imported twice in a run (as a test module
    # and by test_build), and the registry refuses a second registration
    monkeypatch.setitem(PASS_REGISTRY.passes, "ane_spec_test::unlink_a_consumer",
                        _UnlinkAConsumer())
    monkeypatch.setattr(conversion_passes, "CONVERSION_PASSES",
                        (*CONVERSION_PASSES, "ane_spec_test::unlink_a_consumer"))
    # coremltools' backend writer validates again on its own
    reached = _on_backend_writer(monkeypatch, lambda: True)
    with pytest.raises(Exception, match="should be consumed"):
        programs.save_package(_small_program(), tmp_path / "p.mlpackage")
    assert not reached
