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

import coremltools as ct
import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import Function, Program, Var, get_new_symbol, types

from ane_spec.model.config import ModelConfig
from ane_spec.shards.layer_graph import (
    CORRECT,
    BlockInputs,
    GraphVariant,
    LayerWeights,
    Layout,
    conv_in_chunks,
    hidden_shape,
    decoder_layer,
    rms_norm,
)
from ane_spec.shards.weights import ConvWeight

MAX_T = 4
# The T each input's RangeDim defaults to. Apple's guidance for range-flexible inputs: the ANE is
# assured only at the default shape, and MLComputePlan plans that one shape; the fixed decode
# shape runs every pass at T=4, so residency must be planned (and proven) at 4, not 1.
DEFAULT_T = MAX_T
OPSET = ct.target.iOS18

# Interface names: the manifest records them, the runtime reads them from there.
HIDDEN_IN, HIDDEN_OUT = "x", "hidden"
COS, SIN, ATTN_MASK, KV_WRITE_MASK = "rope_cos", "rope_sin", "attn_mask", "kv_write_mask"


def state_names(layer: int) -> tuple[str, str]:
    return f"layer_{layer}_k", f"layer_{layer}_v"


def layer_program(first_layer: int, layers: Sequence[LayerWeights], c: ModelConfig,
                  max_seq: int, layout: Layout, variant: GraphVariant = CORRECT,
                  ring: int = 0) -> Program:
    """A shard of consecutive layers: x, rope, masks in; hidden out; K/V states per layer.

    `ring` > 0 (models with sliding-window layers): each local layer's K/V state is a ring of
    `ring` slots (model/swa_ring.py) instead of max_seq. Its visibility and write masks then
    ride after the global ones along the slot axis: attn_mask [1, 1, T, S + R], kv_write_mask
    [1, 1, S + R, T] (host_inputs.py), sliced once per shard like the stacked RoPE tables."""
    t = get_new_symbol()
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
    for n in range(len(layers)):
        shape = ring_shape if ring and c.is_local(first_layer + n) else kv_shape
        for name in state_names(first_layer + n):
            specs[name] = mb.StateTensorSpec(shape, dtype=fp16)

    def body(inputs: dict) -> list:
        additive = variant.mask_form == "additive"
        local = [c.is_local(first_layer + n) for n in range(len(layers))]
        if ring:
            io = _split_ring_inputs(inputs, c, max_seq, ring, local, additive)
        else:
            write = inputs[KV_WRITE_MASK]
            keep = mb.sub(x=np.float16(1.0), y=mb.reduce_sum(x=write, axes=[3], keep_dims=True),
                          name="kv_keep")
            if c.has_local_layers:
                io = _split_local_inputs(inputs, write, keep, c, local, additive)
            else:
                # The host marks hidden slots with a negative value (host_inputs.MASK_VALUE),
                # visible ones with 0; the select form selects on it, the additive form adds
                # it (and has no greater_equal: it is made only of ops peers ran on the ANE).
                visible = None if additive else mb.greater_equal(
                    x=inputs[ATTN_MASK], y=np.float16(0.0), name="attn_visible")
                io = BlockInputs(cos=inputs[COS], sin=inputs[SIN], attn_mask=inputs[ATTN_MASK],
                                 visible=visible, write=write, keep=keep)
        x = inputs[HIDDEN_IN]
        for n, w in enumerate(layers):
            i = first_layer + n
            k_name, v_name = state_names(i)
            last = n == len(layers) - 1
            x = decoder_layer(x, i, w, io, inputs[k_name], inputs[v_name], c, layout, variant,
                           out_name=HIDDEN_OUT if last else None)
        return [x]

    return _program(specs, body)


def _split_local_inputs(inputs: dict, write: Var, keep: Var, c: ModelConfig,
                        local: list[bool], additive: bool) -> BlockInputs:
    """Full-length local states: the global and local masks stacked on axis 1, one write mask."""
    def masks(kind: int, suffix: str) -> tuple[Var, Var, Var]:
        mask = mb.slice_by_index(x=inputs[ATTN_MASK], begin=[0, kind, 0, 0],
                                 end=[0, kind + 1, 0, 0], begin_mask=[True, False, True, True],
                                 end_mask=[True, False, True, True], name="attn_mask" + suffix)
        return mask, write, keep

    return _split_inputs(inputs, c, local, additive, masks)


def _split_ring_inputs(inputs: dict, c: ModelConfig, max_seq: int, ring: int,
                       local: list[bool], additive: bool) -> BlockInputs:
    """Ring states: the global mask and write columns/rows 0..S, the ring's S..S+R, each kind
    with its own keep = 1 - rowsum(write)."""
    def masks(kind: int, suffix: str) -> tuple[Var, Var, Var]:
        lo, hi = (0, max_seq) if kind == 0 else (max_seq, max_seq + ring)
        mask = mb.slice_by_index(x=inputs[ATTN_MASK], begin=[0, 0, 0, lo], end=[0, 0, 0, hi],
                                 begin_mask=[True, True, True, False],
                                 end_mask=[True, True, True, False], name="attn_mask" + suffix)
        write = mb.slice_by_index(x=inputs[KV_WRITE_MASK], begin=[0, 0, lo, 0],
                                  end=[0, 0, hi, 0], begin_mask=[True, True, False, True],
                                  end_mask=[True, True, False, True],
                                  name="kv_write_mask" + suffix)
        keep = mb.sub(x=np.float16(1.0), y=mb.reduce_sum(x=write, axes=[3], keep_dims=True),
                      name="kv_keep" + suffix)
        return mask, write, keep

    return _split_inputs(inputs, c, local, additive, masks)


def _split_inputs(inputs: dict, c: ModelConfig, local: list[bool], additive: bool,
                  masks: Callable[[int, str], tuple[Var, Var, Var]]) -> BlockInputs:
    """The global (kind 0) and local (kind 1) inputs of a shard with sliding-window layers,
    sliced once per shard: RoPE columns from the stacked tables, and `masks(kind, suffix)`'s
    mask, write mask and keep; only the kinds some layer of the shard reads (an all-local shard
    has no global slice)."""
    half = c.rope_dims // 2

    def part(kind: int, suffix: str) -> BlockInputs:
        mask, write, keep = masks(kind, suffix)

        def cols(x: Var, name: str) -> Var:
            return mb.slice_by_index(x=x, begin=[0, kind * half], end=[0, (kind + 1) * half],
                                     begin_mask=[True, False], end_mask=[True, False],
                                     name=name + suffix)

        return BlockInputs(cos=cols(inputs[COS], "rope_cos"), sin=cols(inputs[SIN], "rope_sin"),
                           attn_mask=mask, write=write, keep=keep,
                           visible=None if additive else mb.greater_equal(
                               x=mask, y=np.float16(0.0), name="attn_visible" + suffix))

    local_io = part(1, "_local") if any(local) else None
    if all(local):  # no global layer reads the top-level fields: they may be the local ones
        return replace(local_io, local=local_io)
    io = part(0, "_global")
    io.local = local_io
    return io


def head_program(norm: np.ndarray, chunks: Sequence[ConvWeight], c: ModelConfig, layout: Layout,
                 argmax: bool, first_chunk: int = 0, eps: float | None = None) -> Program:
    """Final RMSNorm + LM head split into vocab chunks. `eps`: the norm's, when the residual
    stream is scaled (residual_scale.py); None: the model's rms_eps.

    Outputs per chunk `logits_{i}` [1, V_i, T, 1] (or [1, V_i, 1, T]), or with `argmax` the
    chunk's `max_{i}` (fp16) and `argmax_{i}` (int32, index within the chunk), [1, 1, T, 1].
    `i` counts the whole head's chunks: a head split into several packages (`first_chunk`: this
    package's first) has each package compute the same norm and the same per-chunk ops in the
    same shapes as the one-package head, under the same output names, so the runtime merges the
    packages' outputs into what one package would have returned.
    """
    t = get_new_symbol()
    specs = {HIDDEN_IN: mb.TensorSpec(hidden_shape(c.hidden_size, t, layout), dtype=types.fp16)}

    def body(inputs: dict) -> list:
        h = rms_norm(inputs[HIDDEN_IN], norm, c.rms_eps if eps is None else eps, c.hidden_size,
                     "output_norm")
        outs = []
        for i, w in enumerate(chunks, start=first_chunk):
            logits = conv_in_chunks(h, w, f"head_{i}",
                                    out_name=f"chunk_{i}" if argmax else f"logits_{i}")
            if argmax:
                outs.append(mb.reduce_max(x=logits, axes=[1], keep_dims=True, name=f"max_{i}"))
                outs.append(mb.reduce_argmax(x=logits, axis=1, keep_dims=True,
                                             name=f"argmax_{i}"))
            else:
                outs.append(logits)
        return outs

    return _program(specs, body)


def _program(specs: dict[str, object], body: Callable[[dict], list]) -> Program:
    with Function(specs, opset_version=OPSET) as func:
        func.set_outputs(body(func.inputs))
    prog = Program()
    prog.add_function("main", func)
    return prog


def save_package(prog: Program, path: Path, tmp_dir: Path | None = None) -> None:
    """Convert to an ML program package. Every tensor input gets the one RangeDim(1, 4) T axis,
    defaulting to DEFAULT_T (a MIL-built program needs the flexible shapes passed here,
    coremltools #2500).

    ct.convert first writes the weights and a whole `tmpXXXX.mlpackage` through `tempfile`
    (converter.py's weights_dir, utils.py's _create_mlpackage); with `tmp_dir` those go there
    instead of the system temp folder, where a killed build would leave them behind."""
    func = prog.functions["main"]
    inputs = []
    for name, var in func.inputs.items():
        if types.is_state(var.sym_type):
            continue
        shape = tuple(ct.RangeDim(1, MAX_T, default=DEFAULT_T) if not isinstance(s, (int, np.integer))
                      else int(s) for s in var.shape)
        inputs.append(ct.TensorType(name=name, shape=shape, dtype=np.float16))
    with _quiet_pass_pipeline(), _tempfile_dir(tmp_dir):
        model = ct.convert(prog, inputs=inputs, minimum_deployment_target=OPSET,
                           compute_precision=ct.precision.FLOAT32, skip_model_load=True,
                           convert_to="mlprogram")
        model.save(os.fspath(path))


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
