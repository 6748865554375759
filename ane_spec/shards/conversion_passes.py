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

Two more costs of `ct.convert` that buy a build nothing, removed by what `save_package` passes
and wraps it in (`convert_options`, `finish_package`, `program_text_skipped`):

- it writes the package into a temporary folder and `MLModel.save` then copies it, a whole
  shard's weights (1.7 GB on Phi-4-mini) written and read once more; `package_dir` makes it
  write the package where it belongs. `ct.convert` records its metadata (coremltools' version,
  the source, the date) in the model after writing the package, and `save` writes the model's
  spec again after copying: `finish_package` writes that spec, a few hundred kB, so the package
  is the one `save` made;
- each pass pipeline logs the whole program as text before and after it runs, in an f-string
  that is formatted even when debug logging is off: six renderings of every op per package,
  a sixth of the conversion once the main pipeline is reduced.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import coremltools as ct
from coremltools.converters.mil.mil import Program
from coremltools.converters.mil.mil.passes import pass_pipeline

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


@contextlib.contextmanager
def program_text_skipped() -> Iterator[None]:
    """While converting: a MIL program's text is one short line, unless coremltools' debug
    logging is on (the only reader of the text the pass pipelines format, pass_pipeline.py's
    `logger.debug(f"Program before ... {prog}")`)."""
    if pass_pipeline.logger.isEnabledFor(logging.DEBUG):
        yield
        return
    original = Program.__str__
    Program.__str__ = lambda self: "<MIL program: text not rendered during ane-spec's conversion>"
    try:
        yield
    finally:
        Program.__str__ = original


# Where a package keeps its spec: coremltools' models/utils.py `_get_model_spec_path`.
SPEC_IN_PACKAGE = ("Data", "com.apple.CoreML", "model.mlmodel")


def finish_package(model: ct.models.MLModel, path: Path) -> None:
    """Write `model`'s spec into its package at `path` (made with `convert_options`), as
    MLModel.save does after its copy: the metadata ct.convert recorded after writing it.
    The model's own spec, as `save` serialises it: `get_spec()`'s deep copy serialises its
    map fields (each op's inputs) in another order, the same program in other bytes."""
    Path(path, *SPEC_IN_PACKAGE).write_bytes(model._spec.SerializeToString(deterministic=True))
