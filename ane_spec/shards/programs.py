"""Whole MIL programs (layer shards, LM head) and their conversion to `.mlpackage`.

Programs are written in fp16 by hand, every op of them (the LM head's argmax indices are int32).
They are converted with `compute_precision=FLOAT32`, which for a program with no fp32 value in it
changes nothing: that setting adds no casts (FLOAT16 would run the fp16 cast pass, which could
also silently erase an fp32 op someone wrote, as it erased the fp32 softmax of the torch model
ane-book converted). So the dtypes in the package are exactly the ones written here, and
`static_checks` refuses a package with any fp32 value in it.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, Var, get_new_symbol, types
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

from ane_spec.model.config import ModelConfig
from ane_spec.shards import weight_sharing  # noqa: F401 - registers ane_spec::share_weights_across_functions
from ane_spec.shards.conversion_passes import (
    PendingWeights,
    convert_options,
    finish_package,
    weights_written_once,
)
from ane_spec.shards.frozen_heap import frozen_heap
from ane_spec.shards.reshape_shapes import solved_once
from ane_spec.shards.layer_graph import (
    CORRECT,
    BlockInputs,
    GraphVariant,
    LayerWeights,
    Layout,
    SlotWindow,
    conv_in_chunks,
    hidden_shape,
    decoder_layer,
    rms_norm,
)
from ane_spec.shards.weights import ConvWeight

MAX_T = 4
# A layer package's functions (`ane-spec build --prefill-t P`): the decode/verify program with
# the RangeDim(1..4) token axis, Core ML's default function; and, unless P is 0, the same
# layers at a fixed T = P for prompts, in the same package, its weights stored once.
DECODE_FUNCTION = "main"
PREFILL_FUNCTION = "prefill"
DEFAULT_PREFILL_T = 64
# The T each input's RangeDim defaults to. Apple's guidance for range-flexible inputs: the ANE is
# assured only at the default shape, and MLComputePlan plans that one shape; the fixed decode
# shape runs every pass at T=4, so residency must be planned (and proven) at 4, not 1.
DEFAULT_T = MAX_T
OPSET = ct.target.iOS18

# Interface names: the manifest records them, the runtime reads them from there.
HIDDEN_IN, HIDDEN_OUT = "x", "hidden"
COS, SIN, ATTN_MASK, KV_WRITE_MASK = "rope_cos", "rope_sin", "attn_mask", "kv_write_mask"
# The slice form's int32 input (`--kv-write slice`): each window's first slot, repeated in every
# row (`kv_write_window`'s docstring says why it has the token axis).
KV_WRITE_START = "kv_write_start"
# How layers write their K/V rows (layer_graph.write_rows; manifest build.kv_write).
KVWrite = Literal["scatter", "slice"]
KV_WRITES: tuple[KVWrite, ...] = ("scatter", "slice")
# How the LM head lays out each chunk's logits (manifest build.head_layout): "channels", the
# hidden layout's [1, V_i, T, 1] (or [1, V_i, 1, T]), one row's logits T apart; or
# "vocab-last", [1, T, V_i], each row's logits contiguous, as Anemll's heads emit them (a
# squeeze and a transpose after the conv). Which one the ANE runs faster is for `ane-spec tune`.
HeadLayout = Literal["channels", "vocab-last"]
HEAD_LAYOUTS: tuple[HeadLayout, ...] = ("channels", "vocab-last")


def kv_write_window(tokens: int | None) -> int:
    """The slots of one slice-form window: MAX_T for the decode program (whatever T a pass has),
    T for a fixed-T program (the prefill function's P, always wider than MAX_T).

    A window's first slot comes in `kv_write_start` [T, windows] int32, the same value in every
    row. A fixed-shape input in a stateful program whose other inputs have a RangeDim crashes
    Core ML (coremltools #2548: "a mixture of enumerated and range shape flexibility"; the
    residency lint's `mixed-fixed-range`), so it carries the token axis like every other input."""
    return MAX_T if tokens is None else max(tokens, MAX_T)


def state_names(layer: int) -> tuple[str, str]:
    return f"layer_{layer}_k", f"layer_{layer}_v"


def layer_program(first_layer: int, layers: Sequence[LayerWeights], c: ModelConfig,
                  max_seq: int, layout: Layout, variant: GraphVariant = CORRECT,
                  ring: int = 0, tokens: int | None = None,
                  kv_write: KVWrite = "scatter") -> Program:
    """A shard of consecutive layers: x, rope, masks in; hidden out; K/V states per layer.

    `tokens`: None builds the decode program, whose token axis T is symbolic (the RangeDim
    save_package gives it); an int builds the same layers at that fixed T (the prefill
    function). Both declare the same states, so one state serves both.

    `ring` > 0 (models with sliding-window layers): each local layer's K/V state is a ring of
    `ring` slots (model/swa_ring.py) instead of max_seq. Its visibility and write masks then
    ride after the global ones along the slot axis: attn_mask [1, 1, T, S + R], kv_write_mask
    [1, 1, S + R, T] (host_inputs.py), sliced once per shard like the stacked RoPE tables.

    `kv_write="slice"`: the layers write only windows of `kv_write_window(tokens)` slots
    (layer_graph.window_rows): kv_write_mask is then [1, 1, n * width, T], one [width, T]
    one-hot per window, and kv_write_start [T, n] int32 their first slots; n = 1, or 3 with
    rings (the global layers' window, then the ring's two: a block that wraps spans both)."""
    if kv_write not in KV_WRITES:
        raise ValueError(f"kv_write {kv_write!r} is not one of {', '.join(KV_WRITES)}")
    t = get_new_symbol() if tokens is None else tokens
    fp16 = types.fp16
    kv_shape = (1, c.num_kv_heads, max_seq, c.head_dim)
    ring_shape = (1, c.num_kv_heads, ring, c.head_dim)
    if ring and not c.has_local_layers:
        raise ValueError("a KV ring is for models with sliding-window layers")
    specs: dict[str, object] = {
        HIDDEN_IN: mb.TensorSpec(hidden_shape(c.hidden_size, t, layout), dtype=fp16),
        COS: mb.TensorSpec((t, c.rope_dims // 2), dtype=fp16),
        SIN: mb.TensorSpec((t, c.rope_dims // 2), dtype=fp16),
        ATTN_MASK: mb.TensorSpec((1, 1, t, max_seq), dtype=fp16),
        KV_WRITE_MASK: mb.TensorSpec((1, 1, max_seq, t), dtype=fp16),
    }
    if c.has_local_layers:
        # Sliding-window models (gemma3): the local layers' tables and mask travel in the same
        # inputs, after the global ones (cos/sin [T, rot], mask [1, 2, T, S]; host_inputs.py).
        # One input set for every shard: Core ML refuses an input a program does not declare
        # and coremltools adds an `identity` for one it declares but does not use, so separate
        # inputs would differ between an all-local shard and the others.
        half = c.rope_dims // 2
        specs |= {COS: mb.TensorSpec((t, 2 * half), dtype=fp16),
                  SIN: mb.TensorSpec((t, 2 * half), dtype=fp16),
                  ATTN_MASK: mb.TensorSpec((1, 2, t, max_seq), dtype=fp16)}
        if ring:
            specs |= {ATTN_MASK: mb.TensorSpec((1, 1, t, max_seq + ring), dtype=fp16),
                      KV_WRITE_MASK: mb.TensorSpec((1, 1, max_seq + ring, t), dtype=fp16)}
    width = kv_write_window(tokens) if kv_write == "slice" else 0
    if width:
        windows = 3 if ring else 1
        specs |= {KV_WRITE_MASK: mb.TensorSpec((1, 1, windows * width, t), dtype=fp16),
                  KV_WRITE_START: mb.TensorSpec((t, windows), dtype=types.int32)}
    for n in range(len(layers)):
        shape = ring_shape if ring and c.is_local(first_layer + n) else kv_shape
        for name in state_names(first_layer + n):
            specs[name] = mb.StateTensorSpec(shape, dtype=fp16)

    def body(inputs: dict) -> list:
        additive = variant.mask_form == "additive"
        local = [c.is_local(first_layer + n) for n in range(len(layers))]
        if ring:
            io = _split_ring_inputs(inputs, c, max_seq, ring, local, additive, width)
        else:
            write, keep, windows = _full_length_write(inputs, width)
            if c.has_local_layers:
                io = _split_local_inputs(inputs, write, keep, windows, c, local, additive)
            else:
                # The host marks hidden slots with a negative value (host_inputs.MASK_VALUE),
                # visible ones with 0; the select form selects on it, the additive form adds
                # it (and has no greater_equal: it is made only of ops peers ran on the ANE).
                visible = None if additive else mb.greater_equal(
                    x=inputs[ATTN_MASK], y=np.float16(0.0), name="attn_visible")
                io = BlockInputs(cos=inputs[COS], sin=inputs[SIN], attn_mask=inputs[ATTN_MASK],
                                 visible=visible, write=write, keep=keep, windows=windows)
        x = inputs[HIDDEN_IN]
        for n, w in enumerate(layers):
            i = first_layer + n
            k_name, v_name = state_names(i)
            last = n == len(layers) - 1
            x = decoder_layer(x, i, w, io, inputs[k_name], inputs[v_name], c, layout, variant,
                           out_name=HIDDEN_OUT if last else None)
        return [x]

    return _program(specs, body)


Writes = tuple[Var | None, Var | None, tuple[SlotWindow, ...]]  # scatter mask, keep; windows


def _full_length_write(inputs: dict, width: int) -> Writes:
    """How full-length states are written: the scatter's mask and its keep, or (slice form,
    `width` > 0) one window."""
    if width:
        return None, None, _slot_windows(inputs, width, range(1), total=1, suffix="")
    write = inputs[KV_WRITE_MASK]
    keep = mb.sub(x=np.float16(1.0), y=mb.reduce_sum(x=write, axes=[3], keep_dims=True),
                  name="kv_keep")
    return write, keep, ()


def _slot_windows(inputs: dict, width: int, which: range, total: int,
                  suffix: str) -> tuple[SlotWindow, ...]:
    """Windows `which` of the `total` the slice form's inputs describe: window n's first slot is
    column n of kv_write_start, its one-hot rows n * width.. of kv_write_mask. The int32 begin
    and end are computed once per shard, like the masks."""
    windows = []
    for n in which:
        tag = f"{suffix}_{n}"
        start = mb.slice_by_index(x=inputs[KV_WRITE_START], begin=[0, n], end=[1, n + 1],
                                  squeeze_mask=[True, False], name="kv_write_start" + tag)
        begin = mb.concat(values=[np.zeros(2, np.int32), start, np.zeros(1, np.int32)], axis=0,
                          name="kv_window_begin" + tag)
        end = mb.add(x=begin, y=np.array([0, 0, width, 0], np.int32), name="kv_window_end" + tag)
        write = inputs[KV_WRITE_MASK] if total == 1 else mb.slice_by_index(
            x=inputs[KV_WRITE_MASK], begin=[0, 0, n * width, 0], end=[0, 0, (n + 1) * width, 0],
            begin_mask=[True, True, False, True], end_mask=[True, True, False, True],
            name="kv_write_mask" + tag)
        keep = mb.sub(x=np.float16(1.0), y=mb.reduce_sum(x=write, axes=[3], keep_dims=True),
                      name="kv_keep" + tag)
        windows.append(SlotWindow(begin=begin, end=end, write=write, keep=keep))
    return tuple(windows)


def _split_local_inputs(inputs: dict, write: Var | None, keep: Var | None,
                        windows: tuple[SlotWindow, ...], c: ModelConfig, local: list[bool],
                        additive: bool) -> BlockInputs:
    """Full-length local states: the global and local masks stacked on axis 1, one write."""
    def masks(kind: int, suffix: str) -> tuple[Var, Writes]:
        mask = mb.slice_by_index(x=inputs[ATTN_MASK], begin=[0, kind, 0, 0],
                                 end=[0, kind + 1, 0, 0], begin_mask=[True, False, True, True],
                                 end_mask=[True, False, True, True], name="attn_mask" + suffix)
        return mask, (write, keep, windows)

    return _split_inputs(inputs, c, local, additive, masks)


def _split_ring_inputs(inputs: dict, c: ModelConfig, max_seq: int, ring: int,
                       local: list[bool], additive: bool, width: int = 0) -> BlockInputs:
    """Ring states: the global mask and write columns/rows 0..S, the ring's S..S+R, each kind
    with its own keep = 1 - rowsum(write). Slice form (`width` > 0): the global layers' window
    0, the ring's windows 1 and 2."""
    def masks(kind: int, suffix: str) -> tuple[Var, Writes]:
        lo, hi = (0, max_seq) if kind == 0 else (max_seq, max_seq + ring)
        mask = mb.slice_by_index(x=inputs[ATTN_MASK], begin=[0, 0, 0, lo], end=[0, 0, 0, hi],
                                 begin_mask=[True, True, True, False],
                                 end_mask=[True, True, True, False], name="attn_mask" + suffix)
        if width:
            which = range(1) if kind == 0 else range(1, 3)
            return mask, (None, None, _slot_windows(inputs, width, which, 3, suffix))
        write = mb.slice_by_index(x=inputs[KV_WRITE_MASK], begin=[0, 0, lo, 0],
                                  end=[0, 0, hi, 0], begin_mask=[True, True, False, True],
                                  end_mask=[True, True, False, True],
                                  name="kv_write_mask" + suffix)
        keep = mb.sub(x=np.float16(1.0), y=mb.reduce_sum(x=write, axes=[3], keep_dims=True),
                      name="kv_keep" + suffix)
        return mask, (write, keep, ())

    return _split_inputs(inputs, c, local, additive, masks)


def _split_inputs(inputs: dict, c: ModelConfig, local: list[bool], additive: bool,
                  masks: Callable[[int, str], tuple[Var, Writes]]) -> BlockInputs:
    """The global (kind 0) and local (kind 1) inputs of a shard with sliding-window layers,
    sliced once per shard: RoPE columns from the stacked tables, and `masks(kind, suffix)`'s
    mask and write (scatter mask and keep, or windows); only the kinds some layer of the shard
    reads (an all-local shard has no global slice)."""
    half = c.rope_dims // 2

    def part(kind: int, suffix: str) -> BlockInputs:
        mask, (write, keep, windows) = masks(kind, suffix)

        def cols(x: Var, name: str) -> Var:
            return mb.slice_by_index(x=x, begin=[0, kind * half], end=[0, (kind + 1) * half],
                                     begin_mask=[True, False], end_mask=[True, False],
                                     name=name + suffix)

        return BlockInputs(cos=cols(inputs[COS], "rope_cos"), sin=cols(inputs[SIN], "rope_sin"),
                           attn_mask=mask, write=write, keep=keep, windows=windows,
                           visible=None if additive else mb.greater_equal(
                               x=mask, y=np.float16(0.0), name="attn_visible" + suffix))

    local_io = part(1, "_local") if any(local) else None
    if all(local):  # no global layer reads the top-level fields: they may be the local ones
        return replace(local_io, local=local_io)
    io = part(0, "_global")
    io.local = local_io
    return io


def head_program(norm: np.ndarray, chunks: Sequence[ConvWeight], c: ModelConfig, layout: Layout,
                 argmax: bool, first_chunk: int = 0, eps: float | None = None,
                 head_layout: HeadLayout = "channels") -> Program:
    """Final RMSNorm + LM head split into vocab chunks. `eps`: the norm's, when the residual
    stream is scaled (residual_scale.py); None: the model's rms_eps.

    Outputs per chunk `logits_{i}` [1, V_i, T, 1] (or [1, V_i, 1, T]; with `head_layout`
    vocab-last [1, T, V_i]: a reshape dropping the unit axis, in either hidden layout, and a
    transpose, as Anemll's squeeze and transpose; values moved, none computed, so the same
    bits; reshape rather than squeeze keeps the head within the compiler's op set), or
    with `argmax` the chunk's `max_{i}` (fp16) and `argmax_{i}` (int32, index within the
    chunk), [1, 1, T, 1].
    `i` counts the whole head's chunks: a head split into several packages (`first_chunk`: this
    package's first) has each package compute the same norm and the same per-chunk ops in the
    same shapes as the one-package head, under the same output names, so the runtime merges the
    packages' outputs into what one package would have returned.
    """
    if argmax and head_layout != "channels":
        raise ValueError("the vocab-last head layout is for logits heads; an argmax head "
                         "emits one value per row")
    t = get_new_symbol()
    specs = {HIDDEN_IN: mb.TensorSpec(hidden_shape(c.hidden_size, t, layout), dtype=types.fp16)}

    def body(inputs: dict) -> list:
        h = rms_norm(inputs[HIDDEN_IN], norm, c.rms_eps if eps is None else eps, c.hidden_size,
                     "output_norm")
        outs = []
        for i, w in enumerate(chunks, start=first_chunk):
            moved = argmax or head_layout == "vocab-last"
            logits = conv_in_chunks(h, w, f"head_{i}",
                                    out_name=f"chunk_{i}" if moved else f"logits_{i}")
            if argmax:
                outs.append(mb.reduce_max(x=logits, axes=[1], keep_dims=True, name=f"max_{i}"))
                outs.append(mb.reduce_argmax(x=logits, axis=1, keep_dims=True,
                                             name=f"argmax_{i}"))
            elif head_layout == "vocab-last":
                rows = mb.reshape(x=logits, shape=[1, w.shape[0], -1], name=f"head_{i}_rows")
                outs.append(mb.transpose(x=rows, perm=[0, 2, 1], name=f"logits_{i}"))
            else:
                outs.append(logits)
        return outs

    return _program(specs, body)


def _program(specs: dict[str, object], body: Callable[[dict], list]) -> Program:
    # An op given no name is named from a per-op-type counter that is global to the process
    # (Builder.name_count) and cleared only when a ct.convert ends: a program built after some
    # other, unconverted one (a probe, a lint, a test) would get other names, so the same
    # model another package. Counting from zero in every function makes the package depend on
    # the model alone. A package's two functions may repeat names: each is its own scope, as
    # in the functions ct.utils.save_multifunction merges from separate conversions.
    mb.name_count.clear()
    with solved_once(), Function(specs, opset_version=OPSET) as func:
        func.set_outputs(body(func.inputs))
    prog = Program()
    prog.add_function(DECODE_FUNCTION, func)
    return prog


def with_prefill(decode: Program, prefill: Program) -> Program:
    """One program of two functions: `decode`'s as the default (`main`), `prefill`'s as
    PREFILL_FUNCTION. Both were built from the same weight arrays; save_package stores each
    weight once for both (coremltools' cross-function const deduplication, the pass
    `save_multifunction` runs, sets one blob per distinct value)."""
    both = Program()
    both.add_function(DECODE_FUNCTION, decode.functions[DECODE_FUNCTION])
    both.add_function(PREFILL_FUNCTION, prefill.functions[DECODE_FUNCTION])
    both.default_function_name = DECODE_FUNCTION
    both.export_as_multifunction = True
    return both


def save_package(prog: Program, path: Path, tmp_dir: Path | None = None,
                 finish_later: list[PendingWeights] | None = None) -> None:
    """Convert to an ML program package. Every tensor input of the default function gets the one
    RangeDim(1, 4) T axis, defaulting to DEFAULT_T (a MIL-built program needs the flexible
    shapes passed here, coremltools #2500); a program made by `with_prefill` keeps its prefill
    function's fixed shapes and is saved as one multifunction package.

    ct.convert first writes the weights and a whole `tmpXXXX.mlpackage` through `tempfile`
    (converter.py's weights_dir, utils.py's _create_mlpackage); with `tmp_dir` those go there
    instead of the system temp folder, where a killed build would leave them behind.

    `finish_later`: the weight file may still be being written when this returns; it is
    appended there, for the caller to wait for (conversion_passes.weights_written_once)."""
    func = prog.functions[DECODE_FUNCTION]
    inputs = []
    for name, var in func.inputs.items():
        if types.is_state(var.sym_type):
            continue
        shape = tuple(ct.RangeDim(1, MAX_T, default=DEFAULT_T) if not isinstance(s, (int, np.integer))
                      else int(s) for s in var.shape)
        dtype = np.int32 if var.dtype == types.int32 else np.float16  # kv_write_start
        inputs.append(ct.TensorType(name=name, shape=shape, dtype=dtype))
    options = convert_options(path)
    if len(prog.functions) > 1:
        options["pass_pipeline"] = with_weight_sharing(options["pass_pipeline"])
    with _quiet_pass_pipeline(), _validate_once(), _tempfile_dir(tmp_dir), frozen_heap(), \
            weights_written_once(finish_later), _no_final_collection():
        model = ct.convert(prog, inputs=inputs, minimum_deployment_target=OPSET,
                           compute_precision=ct.precision.FLOAT32, skip_model_load=True,
                           convert_to="mlprogram", **options)
        finish_package(model, path)


def with_weight_sharing(pipeline: ct.PassPipeline | None) -> ct.PassPipeline:
    """`pipeline` (None: coremltools' default) ending with the pass that stores the weights
    the functions of a multifunction program share once."""
    pipeline = ct.PassPipeline.DEFAULT if pipeline is None else pipeline
    pipeline.append_pass("ane_spec::share_weights_across_functions")
    return pipeline


@contextlib.contextmanager
def _no_final_collection() -> Iterator[None]:
    """`ct.convert` without the full collection it ends with (`_converters_entry.convert`'s
    `gc.collect()`): the program is still alive then, so it frees only the conversion's
    temporaries, and walks the heap for them (0.03-0.12 s a package on Phi-4-mini). The
    build collects once the program is dropped (`build._save_checked`), which frees both;
    anyone else's automatic collections get the temporaries."""
    from coremltools.converters import _converters_entry as entry

    real = entry.gc
    entry.gc = _NoCollection()   # type: ignore[assignment]
    try:
        yield
    finally:
        entry.gc = real


class _NoCollection:
    """The `gc` module as `_converters_entry` uses it (only `collect`), collecting nothing."""

    @staticmethod
    def collect(generation: int = 2) -> int:
        return 0


@contextlib.contextmanager
def _tempfile_dir(folder: Path | None) -> Iterator[None]:
    if folder is None:
        yield
        return
    folder.mkdir(parents=True, exist_ok=True)
    previous = tempfile.tempdir
    tempfile.tempdir = os.fspath(folder)
    try:
        yield
    finally:
        tempfile.tempdir = previous


@contextlib.contextmanager
def _validate_once() -> Iterator[None]:
    """Run coremltools' pass pipelines as it does (the same passes, in order, with their
    options), validating the program once before and once after each pipeline instead of after
    every one of its ~100 passes, and without formatting the whole program as text twice per
    pipeline for a debug log line that is not shown (`PassPipelineManager.apply_pipeline` builds
    the f-string whatever the log level). Those two were ~60% of converting a layer shard
    (profiled on tiny-code: validate 8.5 s and to_str 1.5 s of 16.8 s). `Program.validate`
    only checks, it never changes the program, so the package written is the same; the final
    validation still fails the build if any pass left the program invalid (with the essential-
    scope check where the pipeline ran dead-code elimination, as coremltools does).

    Nor is a program validated again before a pipeline when the last thing done to it was the
    previous pipeline's final validation: `mil_convert_to_proto` runs its frontend pipeline
    (empty for a MIL program), the main one and the backend one back to back, so "before" the
    second and third is "after" the first and second, and an empty pipeline changes nothing.
    That is 3 validations per package where there were 6."""
    from coremltools.converters.mil.mil.passes.pass_pipeline import PassPipelineManager

    original = PassPipelineManager.__dict__["apply_pipeline"]
    validated: list[Program] = []   # the program a pipeline validated last, untouched since

    def apply_pipeline(prog: Program, pass_pipeline: object) -> None:
        if pass_pipeline is None:
            raise ValueError("The pass_pipeline cannot be None.")
        pass_pipeline.validate()  # type: ignore[attr-defined]
        if not (validated and validated[0] is prog):
            prog.validate()
        validated.clear()
        passes = list(pass_pipeline.passes)  # type: ignore[attr-defined]
        for pass_name in passes:
            graph_pass = PASS_REGISTRY[pass_name]
            graph_pass.set_options(pass_pipeline.get_options(pass_name))  # type: ignore[attr-defined]
            graph_pass(prog)
        if passes:
            prog.validate(check_essential_scope="common::dead_code_elimination" in passes)
        validated.append(prog)

    PassPipelineManager.apply_pipeline = staticmethod(apply_pipeline)
    try:
        yield
    finally:
        PassPipelineManager.apply_pipeline = original


@contextlib.contextmanager
def _quiet_pass_pipeline() -> Iterator[None]:
    """coremltools draws a progress bar per pass pipeline, three per package, with no switch to
    turn it off; the build reports progress per shard instead."""
    from coremltools.converters.mil.mil.passes import pass_pipeline

    original = pass_pipeline.tqdm
    pass_pipeline.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        pass_pipeline.tqdm = original
