"""Numpy kernels for the MIL ops `MILInterpreter` can execute, plus load-time parameter checks.

Each kernel takes the op's resolved inputs as a dict (parameter name -> numpy array, list of arrays
for tuple inputs like `concat.values`, or a plain Python value for string parameters) and returns
one array, or a tuple of arrays for multi-output ops. Kernels compute in whatever dtype they are
given; the interpreter upcasts float16 inputs to float32 beforehand (unless the op only moves data)
and casts/rounds every output to its declared storage dtype afterwards, so kernels never decide
precision themselves. Semantics follow coremltools' op definitions (`mil/ops/defs/iOS15..iOS18`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

Args = dict[str, Any]
Kernel = Callable[[Args], np.ndarray | tuple]
# A check looks at the op and at the inputs already known when the program is loaded (consts and
# folded constexprs) and returns why the op is unsupported, or None.
Check = Callable[[Any, Args], str | None]


@dataclass(frozen=True)
class OpDef:
    kernel: Kernel
    # False for ops that only move or select data: upcasting their float16 inputs would cost a copy
    # of e.g. a whole KV cache for no change in the result.
    upcast: bool = True
    check: Check | None = None
    # Ops touching state must never be folded at load time even if their other inputs are const.
    stateful: bool = False


# ----------------------------------------------------------------------------------- helpers


def ints(v: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in np.ravel(np.asarray(v)))


def as_int(v: Any) -> int:
    return int(np.ravel(np.asarray(v))[0])


def as_bool(v: Any) -> bool:
    return bool(np.ravel(np.asarray(v))[0])


def _axes(a: Args, key: str = "axes") -> tuple[int, ...] | None:
    return None if a.get(key) is None else ints(a[key])


# -------------------------------------------------------------------------------- elementwise


def _binary(fn: Callable[[Any, Any], Any]) -> Kernel:
    return lambda a: fn(a["x"], a["y"])


def _unary(fn: Callable[[Any], Any]) -> Kernel:
    return lambda a: fn(a["x"])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    # exp(-x) overflows to inf for very negative x, which correctly yields 0; silence the warning.
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


# numpy has no erf and scipy is not a dependency; math.erf is exact. Phi-4 uses silu, so gelu's
# speed does not matter, only its correctness.
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(a: Args) -> np.ndarray:
    x, mode = a["x"], a.get("mode", "EXACT")
    if mode == "TANH_APPROXIMATION":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if mode == "SIGMOID_APPROXIMATION":
        return x * _sigmoid(1.702 * x)
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _check_gelu(op: Any, known: Args) -> str | None:
    modes = ("EXACT", "TANH_APPROXIMATION", "SIGMOID_APPROXIMATION")
    return None if known.get("mode", "EXACT") in modes else f"gelu mode {known.get('mode')!r}"


def _rsqrt(a: Args) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return 1.0 / np.sqrt(a["x"] + a.get("epsilon", 1e-12))


def _inverse(a: Args) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return 1.0 / (a["x"] + a.get("epsilon", 1e-4))


# ------------------------------------------------------------------------- linear algebra
#
# Row invariance (ane_spec.probes.row_invariance): a token's result must not depend on its row
# index in a pass or on its neighbours. One BLAS call over a whole block does not promise that:
# OpenBLAS computes the 12 query rows of a grouped-attention matmul with two different micro-
# kernels, rows 8..11 rounding differently from rows 0..7. So the default kernels give every row
# its own vector x matrix product, the same BLAS call whatever the row's index, the block's size
# or its neighbours; checked bitwise for any memory alignment. The "batched" kernels (one call per
# block) stay available as a real backend that is *not* row-invariant.

# Contractions this short are summed explicitly, term by term in index order: the KV scatter
# (write mask [S, T] @ rows [T, hd]) would otherwise cost S separate BLAS calls. So a T=4 pass
# sums its scatter here and a prefill pass (T = P > 8) calls BLAS. Both are exact (each slot
# gets one product by 1 and zeros), and they differ in one thing only, measured: an all-zero sum
# comes out -0 here where every product is -0 (all T rows negative in that column), +0 from
# BLAS. The state's `K * keep + placed` then keeps a slot's value unless it is itself a zero,
# so only a stored -0 can turn +0 (no op after it tells the two apart); `probe row-invariance`
# counts such values (`signed_zero_values`) when it compares the shapes.
_EXPLICIT_SUM_MAX_K = 8


def _matmul_operands(a: Args) -> tuple[np.ndarray, np.ndarray]:
    x, y = a["x"], a["y"]
    # MIL ignores transpose flags on rank-1 operands, as numpy's matmul treats them as vectors.
    if as_bool(a.get("transpose_x", False)) and x.ndim >= 2:
        x = np.swapaxes(x, -1, -2)
    if as_bool(a.get("transpose_y", False)) and y.ndim >= 2:
        y = np.swapaxes(y, -1, -2)
    return x, y


def _matmul(a: Args) -> np.ndarray:
    x, y = _matmul_operands(a)
    if x.ndim < 2 or y.ndim < 2 or x.shape[-2] == 1:
        return np.matmul(x, y)
    k = x.shape[-1]
    if k <= _EXPLICIT_SUM_MAX_K:
        out = x[..., :, 0:1] * y[..., 0:1, :]
        for i in range(1, k):
            out = out + x[..., :, i:i + 1] * y[..., i:i + 1, :]
        return out
    rows = np.ascontiguousarray(x)[..., :, None, :]        # [..., M, 1, K]: one product per row
    return np.matmul(rows, y[..., None, :, :])[..., 0, :]


def _matmul_batched(a: Args) -> np.ndarray:
    x, y = _matmul_operands(a)
    return np.matmul(x, y)


def _linear(a: Args) -> np.ndarray:
    out = np.matmul(a["x"], a["weight"].T)
    bias = a.get("bias")
    return out if bias is None else out + bias


# Output channels per product in the row kernels' conv: each token's [1, Cin] @ [Cin, 64] block
# product reads a slice of the weights that stays in cache for every other token of the pass, so
# a wide pass (a 64-row prefill chunk) reads each weight from memory once instead of once per
# row (9x faster for Qwen's 896 x 9728 up-projection at 64 rows, measured). The partition
# depends only on the weight's shape, so every row still gets the same products whatever its
# index, its neighbours or the pass width (tests/test_mil_interpreter.py checks it bitwise).
_CONV_BLOCK = 64


def _conv(a: Args) -> np.ndarray:
    # Only 1x1 kernels with stride 1 and no padding get here (see _check_conv), so each spatial
    # position (a token) is one [1, Cin/g] @ [Cin/g, Cout/g] product per group.
    x, w = a["x"], a["weight"]
    groups = as_int(a.get("groups", 1))
    n, cin, spatial = x.shape[0], x.shape[1], x.shape[2:]
    cout = w.shape[0]
    tokens = np.ascontiguousarray(np.moveaxis(x.reshape(n, groups, cin // groups, -1), -1, 1))
    rows = tokens[..., None, :]                                               # [n, P, g, 1, Cin/g]
    wg = w.reshape(groups, cout // groups, cin // groups)                     # [g, Cout/g, Cin/g]
    out = np.empty((*tokens.shape[:-1], cout // groups), dtype=np.result_type(x, w))
    for start in range(0, cout // groups, _CONV_BLOCK):
        block = wg[:, start:start + _CONV_BLOCK].transpose(0, 2, 1)           # [g, Cin/g, B]
        out[..., start:start + _CONV_BLOCK] = np.matmul(rows, block)[..., 0, :]
    out = np.moveaxis(out, 1, -1).reshape(n, cout, *spatial)                  # [n, P, g, Cout/g]
    return _add_conv_bias(out, a.get("bias"), cout, spatial)


def _conv_batched(a: Args) -> np.ndarray:
    # One grouped matmul per block: (g, Cout/g, Cin/g) @ (N, g, Cin/g, spatial).
    x, w = a["x"], a["weight"]
    groups = as_int(a.get("groups", 1))
    n, cin, spatial = x.shape[0], x.shape[1], x.shape[2:]
    cout = w.shape[0]
    xg = x.reshape(n, groups, cin // groups, -1)
    wg = w.reshape(groups, cout // groups, cin // groups)
    out = np.matmul(wg, xg).reshape(n, cout, *spatial)
    return _add_conv_bias(out, a.get("bias"), cout, spatial)


def _add_conv_bias(out: np.ndarray, bias: np.ndarray | None, cout: int,
                   spatial: tuple[int, ...]) -> np.ndarray:
    if bias is not None:
        out += bias.reshape((cout,) + (1,) * len(spatial))
    return out


def _check_conv(op: Any, known: Args) -> str | None:
    kernel = tuple(op.inputs["weight"].shape[2:])
    if not all(isinstance(k, (int, np.integer)) and k == 1 for k in kernel):
        return f"only 1x1 kernels are supported, got kernel {kernel}"
    for name in ("strides", "pad", "groups"):
        if name in op.inputs and name not in known:
            return f"'{name}' must be const"
    if any(s != 1 for s in ints(known.get("strides", 1))):
        return f"only stride 1 is supported, got {ints(known['strides'])}"
    if known.get("pad_type", "valid") == "custom" and any(ints(known.get("pad", 0))):
        return f"only zero padding is supported, got pad {ints(known['pad'])}"
    return None


# ----------------------------------------------------------------------------- normalization


def _softmax(a: Args) -> np.ndarray:
    x, axis = a["x"], as_int(a.get("axis", -1))
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def _layer_norm(a: Args) -> np.ndarray:
    x = a["x"]
    axes = tuple(ax % x.ndim for ax in (_axes(a) or range(x.ndim)))
    # gamma/beta have shape x.shape[axes]; the axes need not be trailing (e.g. channel axis 1 of
    # an NCHW activation), so give them broadcastable shape explicitly.
    norm_shape = [x.shape[i] if i in axes else 1 for i in range(x.ndim)]
    centered = x - np.mean(x, axis=axes, keepdims=True)
    var = np.mean(np.square(centered), axis=axes, keepdims=True)
    out = centered / np.sqrt(var + a.get("epsilon", 1e-5))
    if a.get("gamma") is not None:
        out = out * a["gamma"].reshape(norm_shape)
    if a.get("beta") is not None:
        out = out + a["beta"].reshape(norm_shape)
    return out


def _reduce(fn: Callable[..., np.ndarray]) -> Kernel:
    return lambda a: fn(a["x"], axis=_axes(a), keepdims=as_bool(a.get("keep_dims", False)))


def _reduce_argmax(a: Args) -> np.ndarray:
    keep = as_bool(a.get("keep_dims", False))
    return np.argmax(a["x"], axis=as_int(a.get("axis", -1)), keepdims=keep)


# ------------------------------------------------------------------------------ data movement


def _reshape(a: Args) -> np.ndarray:
    x, target = a["x"], list(ints(a["shape"]))
    # A 0 copies the input dim it lines up with counting from the right (iOS17 rule; identical to
    # the iOS15 rule whenever len(shape) == rank, the only case iOS15 allows), or 1 if none does.
    for i, size in enumerate(target):
        if size == 0:
            j = x.ndim - (len(target) - i)
            target[i] = x.shape[j] if j >= 0 else 1
    return x.reshape(target)


def _squeeze(a: Args) -> np.ndarray:
    return np.squeeze(a["x"], axis=_axes(a))


def _concat(a: Args) -> np.ndarray:
    values, axis = a["values"], as_int(a["axis"])
    if not as_bool(a.get("interleave", False)):
        return np.concatenate(values, axis=axis)
    # Interleaving equal-shaped inputs along `axis` = stacking them just after it, then merging.
    axis %= values[0].ndim
    stacked = np.stack(values, axis=axis + 1)
    shape = list(values[0].shape)
    shape[axis] *= len(values)
    return stacked.reshape(shape)


def _split(a: Args) -> tuple[np.ndarray, ...]:
    x, axis = a["x"], as_int(a["axis"])
    if a.get("split_sizes") is not None:
        cuts = np.cumsum(ints(a["split_sizes"]))[:-1]
        return tuple(np.split(x, cuts, axis=axis))
    return tuple(np.split(x, as_int(a["num_splits"]), axis=axis))


def _slice_by_index(a: Args) -> np.ndarray:
    return a["x"][_index(a, a["x"].ndim)]


def _slice_update(a: Args) -> np.ndarray:
    """iOS18 slice_update: a copy of x with the slice that slice_by_index's arguments name set to
    `update`. The slice must have update's shape exactly: a begin or end past x's bounds (the
    write position is a program input here) is an error, never numpy's silent clipping."""
    x, update = a["x"], np.asarray(a["update"])
    index = _index(a, x.ndim)
    out = np.array(x, copy=True)
    region = out[index]
    if region.shape != update.shape:
        raise ValueError(f"the slice begin {list(ints(a['begin']))}, end "
                         f"{list(ints(a['end']))} of a {list(x.shape)} tensor has shape "
                         f"{list(region.shape)}, the update {list(update.shape)}")
    out[index] = update
    return out


def _index(a: Args, rank: int) -> tuple[slice | int, ...]:
    # Python slicing with masks mapped to None, as coremltools' own value inference does.
    begin: list[int | None] = list(ints(a["begin"]))
    end: list[int | None] = list(ints(a["end"]))
    stride = list(ints(a["stride"])) if a.get("stride") is not None else [1] * rank
    begin_mask = _mask(a, "begin_mask", rank)
    end_mask = _mask(a, "end_mask", rank)
    squeeze_mask = _mask(a, "squeeze_mask", rank)
    index: list[slice | int] = []
    for i in range(rank):
        b = None if begin_mask[i] else begin[i]
        if squeeze_mask[i]:
            index.append(0 if b is None else b)
        else:
            index.append(slice(b, None if end_mask[i] else end[i], stride[i]))
    return tuple(index)


def _mask(a: Args, key: str, rank: int) -> list[bool]:
    v = a.get(key)
    return [False] * rank if v is None else [bool(m) for m in np.ravel(v)]


def _slice_by_size(a: Args) -> np.ndarray:
    x = a["x"]
    index = []
    for dim, b, s in zip(x.shape, ints(a["begin"]), ints(a["size"])):
        b = b + dim if b < 0 else b
        if not 0 <= b <= dim or (s != -1 and b + s > dim):
            # A begin from a program input (the slice form's window) is checked, not clipped.
            raise ValueError(f"begin {list(ints(a['begin']))}, size {list(ints(a['size']))} "
                             f"is outside a {list(x.shape)} tensor")
        index.append(slice(b, dim if s == -1 else b + s))
    return x[tuple(index)]


def _gather(a: Args) -> np.ndarray:
    return np.take(a["x"], a["indices"].astype(np.int64), axis=as_int(a.get("axis", 0)))


def _check_gather(op: Any, known: Args) -> str | None:
    if "batch_dims" in op.inputs and "batch_dims" not in known:
        return "'batch_dims' must be const"
    if as_int(known.get("batch_dims", 0)) != 0:
        return "only batch_dims=0 is supported"
    return None


_CAST_DTYPES = {
    "fp16": np.float16,
    "fp32": np.float32,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint16": np.uint16,
    "uint8": np.uint8,
    "bool": np.bool_,
}


def _cast(a: Args) -> np.ndarray:
    x, target = a["x"], _CAST_DTYPES[a["dtype"]]
    # Float targets: leave the value alone; the interpreter rounds to fp16 (fp16 mode) or keeps
    # float32 (fp32 mode) according to the declared output dtype.
    if np.issubdtype(target, np.floating):
        return x.astype(np.float32, copy=False)
    return x != 0 if target is np.bool_ else x.astype(target)


def _check_cast(op: Any, known: Args) -> str | None:
    return None if known.get("dtype") in _CAST_DTYPES else f"cast to dtype {known.get('dtype')!r}"


def _fill(a: Args) -> np.ndarray:
    return np.full(ints(a["shape"]), a.get("value", 0.0))


# ------------------------------------------------------------------------------------- state


def _read_state(a: Args) -> np.ndarray:
    # A copy: a later coreml_update_state writes the same buffer in place.
    return np.array(a["input"], copy=True)


def _update_state(a: Args) -> np.ndarray:
    a["state"][...] = a["value"]
    return a["value"]


def _constexpr_blockwise_shift_scale(a: Args) -> np.ndarray:
    data, scale, offset = a["data"], a["scale"], a.get("offset")
    # View every axis of length n as (scale_dim, n // scale_dim) so scale/offset broadcast over
    # blocks without np.repeat materialising full-size copies of them.
    blocked, param_shape = [], []
    for n, s in zip(data.shape, scale.shape):
        blocked += [s, n // s]
        param_shape += [s, 1]
    out = data.astype(np.float32).reshape(blocked)
    if offset is not None:
        out -= np.asarray(offset, dtype=np.float32).reshape(param_shape)
    out *= np.asarray(scale, dtype=np.float32).reshape(param_shape)
    return out.reshape(data.shape)


def _constexpr_lut_to_dense(a: Args) -> np.ndarray:
    """iOS18 palettization: `indices` of rank K, `lut` [l_0..l_{K-1}, 2^nbits, 1]; axis i of the
    indices is split into l_i equal blocks, each with its own table (scalar palettization only:
    the check refuses a vector size other than 1)."""
    indices, lut = np.asarray(a["indices"]), np.asarray(a["lut"])
    k = indices.ndim
    blocked, table_shape = [], []
    for n, blocks in zip(indices.shape, lut.shape[:k]):
        blocked += [blocks, n // blocks]
        table_shape += [blocks, 1]
    tables = lut[..., 0].reshape(table_shape + [lut.shape[k]])
    picked = indices.astype(np.intp).reshape(blocked + [1])
    out = np.take_along_axis(tables.astype(np.float32), picked, axis=-1)
    return out.reshape(indices.shape)


def _check_lut_to_dense(op: Any, known: Args) -> str | None:
    lut, indices = known.get("lut"), known.get("indices")
    if lut is None or indices is None:
        return "lut and indices must be constants"
    lut, indices = np.asarray(lut), np.asarray(indices)
    if lut.ndim != indices.ndim + 2 or lut.shape[-1] != 1:
        return f"only scalar palettization (lut rank indices+2, vector size 1), got {lut.shape}"
    if any(b == 0 or n % b for n, b in zip(indices.shape, lut.shape[:indices.ndim])):
        return f"lut blocks {lut.shape[:indices.ndim]} do not divide indices {indices.shape}"
    if indices.size and int(indices.max()) >= lut.shape[-2]:
        return f"an index is past the {lut.shape[-2]}-entry table"
    return None


def _constexpr_affine_dequantize(a: Args) -> np.ndarray:
    data = a["quantized_data"]
    axis = as_int(a["axis"]) % data.ndim
    # Scalar or vector parameters; a vector runs along `axis`.
    shape = [-1 if i == axis else 1 for i in range(data.ndim)]
    zero_point = np.asarray(a["zero_point"], dtype=np.float32).reshape(shape)
    scale = np.asarray(a["scale"], dtype=np.float32).reshape(shape)
    out = data.astype(np.float32)
    out -= zero_point
    out *= scale
    return out


def _identity(a: Args) -> np.ndarray:
    return a["x"]


#: The one-call-per-block kernels `MILInterpreter(kernels="batched")` swaps in.
BATCHED_KERNELS: dict[str, Kernel] = {"matmul": _matmul_batched, "conv": _conv_batched}

OPS: dict[str, OpDef] = {
    "constexpr_blockwise_shift_scale": OpDef(_constexpr_blockwise_shift_scale),
    "constexpr_affine_dequantize": OpDef(_constexpr_affine_dequantize),
    "constexpr_lut_to_dense": OpDef(_constexpr_lut_to_dense, check=_check_lut_to_dense),
    "conv": OpDef(_conv, check=_check_conv),
    "linear": OpDef(_linear),
    "matmul": OpDef(_matmul),
    "add": OpDef(_binary(np.add)),
    "sub": OpDef(_binary(np.subtract)),
    "mul": OpDef(_binary(np.multiply)),
    "real_div": OpDef(_binary(np.true_divide)),
    "maximum": OpDef(_binary(np.maximum)),
    "minimum": OpDef(_binary(np.minimum)),
    # min(max(x, alpha), beta) as coremltools defines it: NaN stays NaN, +-inf become the bounds.
    "clip": OpDef(lambda a: np.minimum(np.maximum(a["x"], a["alpha"]), a["beta"])),
    "pow": OpDef(_binary(np.power)),
    "greater": OpDef(_binary(np.greater)),
    "less": OpDef(_binary(np.less)),
    "equal": OpDef(_binary(np.equal)),
    "greater_equal": OpDef(_binary(np.greater_equal)),
    "less_equal": OpDef(_binary(np.less_equal)),
    "not_equal": OpDef(_binary(np.not_equal)),
    "sqrt": OpDef(_unary(np.sqrt)),
    "rsqrt": OpDef(_rsqrt),
    "exp": OpDef(_unary(np.exp)),
    "inverse": OpDef(_inverse),
    "tanh": OpDef(_unary(np.tanh)),
    "sigmoid": OpDef(_unary(_sigmoid)),
    "silu": OpDef(_unary(lambda x: x * _sigmoid(x))),
    "gelu": OpDef(_gelu, check=_check_gelu),
    "relu": OpDef(_unary(lambda x: np.maximum(x, 0))),
    "softmax": OpDef(_softmax),
    "layer_norm": OpDef(_layer_norm),
    "reduce_sum": OpDef(_reduce(np.sum)),
    "reduce_mean": OpDef(_reduce(np.mean)),
    "reduce_max": OpDef(_reduce(np.max)),
    "reduce_min": OpDef(_reduce(np.min)),
    "reduce_argmax": OpDef(_reduce_argmax),
    "reshape": OpDef(_reshape, upcast=False),
    "transpose": OpDef(lambda a: np.transpose(a["x"], ints(a["perm"])), upcast=False),
    "expand_dims": OpDef(lambda a: np.expand_dims(a["x"], ints(a["axes"])), upcast=False),
    "squeeze": OpDef(_squeeze, upcast=False),
    "concat": OpDef(_concat, upcast=False),
    "split": OpDef(_split, upcast=False),
    "slice_by_index": OpDef(_slice_by_index, upcast=False),
    "slice_by_size": OpDef(_slice_by_size, upcast=False),
    "slice_update": OpDef(_slice_update, upcast=False),
    "gather": OpDef(_gather, upcast=False, check=_check_gather),
    "tile": OpDef(lambda a: np.tile(a["x"], ints(a["reps"])), upcast=False),
    "cast": OpDef(_cast, check=_check_cast),
    "select": OpDef(lambda a: np.where(a["cond"], a["a"], a["b"]), upcast=False),
    "shape": OpDef(lambda a: np.asarray(a["x"].shape, dtype=np.int32), upcast=False),
    "fill": OpDef(_fill),
    "identity": OpDef(_identity, upcast=False),
    "read_state": OpDef(_read_state, upcast=False, stateful=True),
    "coreml_update_state": OpDef(_update_state, upcast=False, stateful=True),
}
