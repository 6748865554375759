"""The MIL passes a package's conversion runs: the two of coremltools' default pipeline that
change anything in the programs this compiler writes.

`ct.convert` runs its main pass pipeline (95 passes in coremltools 9.0: fusions, constant
folding, transpose and cast optimisation, ...) over every program before serialising it, and
`Program.validate` after each pass. That is Python walking every op ~100 times: on a Phi-4-mini
build it cost 2.4x the weights' dequantization and requantization, the largest part of the
build after the calibration, and it is paid again for every function a package holds. But the
programs here are written op by op in fp16 (programs.py, layer_graph.py): almost nothing in
them is left to fuse, fold or eliminate. Of the default pipeline, these passes change them:

- `common::fuse_conv_bias` makes the q|k|v conv and the add of its bias (qwen2) one conv with
  a bias, and `common::dead_code_elimination` then drops the add and its constant before the
  weights are laid out (left to the backend's own elimination, they are written to the weight
  file in another order);
- `common::canonicalize_inplace_pattern` moves each `coreml_update_state` right after the op
  that computes its value (the KV writes);
- `common::topological_reorder` moves each `transpose` next to its first use.

Running those, in the default pipeline's order, gives the package the default pipeline gives,
byte for byte (every file but the package's Manifest.json, whose item identifiers are
fresh UUIDs on every save). tests/test_conversion_passes.py checks it on the build's programs:
every architecture, layout, weight format, mask form, KV ring, split reduction and split head,
scaled and unscaled. Should a program change so that another pass matters, or a coremltools
release change what the default pipeline does, that test fails; CONVERSION_PASSES = None falls
back to the default pipeline. The backend pipeline (name sanitising, unused inputs, ...) runs
either way: `pass_pipeline` replaces only the main one.

More costs of `ct.convert` that buy a build nothing, removed by what `save_package` passes
and wraps it in (`convert_options`, `finish_package`, `weights_written_once`):

- it writes the package into a temporary folder and `MLModel.save` then copies it, a whole
  shard's weights (1.7 GB on Phi-4-mini) written and read once more; `package_dir` makes it
  write the package where it belongs. `ct.convert` records its metadata (coremltools' version,
  the source, the date) in the model after writing the package, and `save` writes the model's
  spec again after copying: `finish_package` writes that spec, a few hundred kB, so the package
  is the one `save` made;
- even so, the weight file is written in a temporary folder (converter.py's `weights_dir`) and
  copied into the package (`ModelPackage::addItem` is a `std::filesystem::copy`), and each
  weight array is copied by `flatten()` before it is written (backend/mil/helper.py's
  `_get_offset_by_writing_data`): on Phi-4-mini 3.3 GB of fresh memory, then 3.3 GB read and
  written again, 15-25 s of a 50-75 s build. `weights_written_once` writes each array from a
  view of itself and moves the file into the package: the same bytes, written once, and past
  the page cache (blob_file.py says why that matters here).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import coremltools as ct
import numpy as np
from coremltools.converters.mil.mil import types

from ane_spec.shards.blob_file import BLOB_TYPES, BlobFileWriter

# In the order coremltools' default pipeline runs them. None: the whole default pipeline.
CONVERSION_PASSES: tuple[str, ...] | None = (
    "common::fuse_conv_bias",
    "common::dead_code_elimination",
    "common::canonicalize_inplace_pattern",
    "common::topological_reorder",
)


def conversion_pipeline() -> ct.PassPipeline | None:
    """`pass_pipeline` for ct.convert: the passes above, or None for coremltools' default."""
    if CONVERSION_PASSES is None:
        return None
    return ct.PassPipeline(pass_names=list(CONVERSION_PASSES), pipeline_name="ane-spec")


def convert_options(path: Path) -> dict[str, object]:
    """ct.convert's keyword arguments for a package at `path`: the pipeline above, and the
    package written at `path` itself (then there is nothing for MLModel.save to copy). Makes
    `path`'s folder, as MLModel.save's copy did: coremltools' package writer makes only the
    package's own."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return {"pass_pipeline": conversion_pipeline(), "package_dir": os.fspath(path)}


# The MIL dtypes whose values coremltools packs below a byte before writing: left to it.
_PACKED_DTYPES = ("int4", "uint1", "uint2", "uint3", "uint4", "uint6")
# The blob writer's method for each stored numpy dtype (helper.py's dispatch; fp16 goes as bits).
_WRITE_METHOD = {
    np.dtype(np.float32): "write_float_data",
    np.dtype(np.float16): "write_fp16_data",
    np.dtype(np.uint8): "write_uint8_data",
    np.dtype(np.int8): "write_int8_data",
    np.dtype(np.uint16): "write_uint16_data",
    np.dtype(np.int16): "write_int16_data",
    np.dtype(np.int32): "write_int32_data",
    np.dtype(np.uint32): "write_uint32_data",
}


@dataclass
class PendingWeights:
    """A package's weight file still being written by its writer's thread (`finish_later`):
    where it lies now, how long it will be, and the future that ends when it is whole."""

    path: Path
    bytes: int
    done: Future[None]
    writer: BlobFileWriter

    def discard(self) -> None:
        """Stop writing it (a build that failed): returns once its thread has let go."""
        self.writer.discard()


def wait_whole(writing: Sequence[PendingWeights],
               failed: Callable[[BaseException], BaseException]) -> None:
    """Wait until every file `writing` is whole; what one failed with is raised as
    `failed(error)`, the others stopped first."""
    for w in writing:
        try:
            w.done.result()
        except BaseException as exc:
            for other in writing:
                other.discard()
            raise failed(exc) from None


@contextlib.contextmanager
def weights_written_once(finish_later: list[PendingWeights] | None = None) -> Iterator[None]:
    """While converting: the weight file is written by blob_file.BlobFileWriter (coremltools'
    layout, past the page cache), each weight handed to it as a view of its own array (the
    bytes `flatten()`'s copy would hold), and moved into the package instead of copied (a
    rename: both lie in the build's folder). tests/test_conversion_passes.py checks that the
    packages are coremltools' own, byte for byte.

    With `finish_later`, the package is written without waiting for its weight file's last
    writes: each such file is appended there, still being finished, and is its caller's to
    wait for or discard (the weights it is written from stay alive until then)."""
    from coremltools.converters.mil.backend.mil import helper, load
    from coremltools.models import model as ct_model

    write_original = helper.__dict__["_get_offset_by_writing_data"]
    package_original = ct_model.__dict__["_create_mlpackage"]
    writer_original = load.__dict__["BlobWriter"]
    writers: list[BlobFileWriter] = []

    def open_writer(file_name: str, truncate_file: bool = True) -> BlobFileWriter:
        writers.append(BlobFileWriter(file_name, truncate_file))
        return writers[-1]

    def write(output_var, blob_writer) -> int:
        val = output_var.val
        method = _WRITE_METHOD.get(getattr(val, "dtype", None))
        if (method is None or not isinstance(val, np.ndarray)
                or types.builtin_to_string(output_var.dtype) in _PACKED_DTYPES):
            return write_original(output_var, blob_writer)
        as_dtype = BLOB_TYPES[method][0]
        return getattr(blob_writer, method)(np.ascontiguousarray(val).reshape(-1).view(as_dtype))

    def create_package(proto_spec, weights_dir=None, package_path=None) -> str:
        # The proto is whole: every weight has been queued. A writer whose file moves with
        # the folder is handed over to the caller at once (so a failure below discards it);
        # the others are finished here.
        moving = weights_dir is not None and package_path is not None
        handed: dict[str, PendingWeights] = {}
        for w in list(writers):
            writers.remove(w)
            if finish_later is not None and moving:
                handed[os.path.abspath(w.path)] = p = PendingWeights(
                    Path(w.path), w.size, w.finish_later(), w)
                finish_later.append(p)
            else:
                w.close()
        if not moving:
            return package_original(proto_spec, weights_dir, package_path)
        with tempfile.TemporaryDirectory(dir=Path(weights_dir).parent) as empty:
            path = package_original(proto_spec, empty, package_path)
        into = Path(path, *SPEC_IN_PACKAGE).parent / WEIGHTS_IN_PACKAGE
        for item in sorted(os.listdir(weights_dir)):
            source = os.path.abspath(os.path.join(weights_dir, item))
            if source in handed:   # a rename: its writer goes on through its descriptor
                os.rename(source, into / item)
                handed.pop(source).path = into / item
            else:
                shutil.move(source, into / item)
        for p in handed.values():   # not in the folder moved (never so): finished here
            p.done.result()
        return path

    helper._get_offset_by_writing_data = write
    ct_model._create_mlpackage = create_package
    load.BlobWriter = open_writer
    try:
        yield
    except BaseException:
        for p in finish_later or ():
            p.discard()
        raise
    finally:
        helper._get_offset_by_writing_data = write_original
        ct_model._create_mlpackage = package_original
        load.BlobWriter = writer_original
        for w in writers:   # a conversion that failed part-way: its file descriptors
            w.discard()


# Where a package keeps its spec: coremltools' models/utils.py `_get_model_spec_path`.
SPEC_IN_PACKAGE = ("Data", "com.apple.CoreML", "model.mlmodel")
# The weights' folder beside it: utils.py's `_WEIGHTS_DIR_NAME` (the item `_create_mlpackage` adds).
WEIGHTS_IN_PACKAGE = "weights"


def finish_package(model: ct.models.MLModel, path: Path) -> None:
    """Write `model`'s spec into its package at `path` (made with `convert_options`), as
    MLModel.save does after its copy: the metadata ct.convert recorded after writing it.
    The model's own spec, as `save` serialises it: `get_spec()`'s deep copy serialises its
    map fields (each op's inputs) in another order, the same program in other bytes."""
    Path(path, *SPEC_IN_PACKAGE).write_bytes(model._spec.SerializeToString(deterministic=True))
