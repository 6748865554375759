"""The numpy MIL executor against independent numpy math, on programs and on saved .mlpackages."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import coremltools as ct
import numpy as np
import pytest
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.mil import get_new_symbol, types

from ane_spec.errors import AneSpecError
from ane_spec.runtime import mil_ops
from ane_spec.runtime.mil_interpreter import MILInterpreter, UnsupportedOpError

IOS18 = ct.target.iOS18
rng = np.random.default_rng(0)


def randn(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


def run(prog: Any, inputs: dict[str, np.ndarray], precision: str = "fp32") -> dict[str, np.ndarray]:
    return MILInterpreter.from_program(prog, precision=precision).predict(inputs)


def save_and_load(prog: Any, path: Path, precision: str = "fp32", **convert: Any) -> MILInterpreter:
    """Convert (running ct's graph passes), save, and load back through the package path."""
    convert.setdefault("compute_precision", ct.precision.FLOAT32)
    model = ct.convert(prog, minimum_deployment_target=IOS18, skip_model_load=True, **convert)
    model.save(str(path))
    return MILInterpreter.from_package(path, precision=precision)


def unary_program(shape: tuple[int, ...], build: Callable[[Any], Any]) -> Any:
    @mb.program(input_specs=[mb.TensorSpec(shape)], opset_version=IOS18)
    def prog(x):
        return build(x)

    return prog


def binary_program(
    sx: tuple[int, ...], sy: tuple[int, ...], build: Callable[[Any, Any], Any]
) -> Any:
    @mb.program(input_specs=[mb.TensorSpec(sx), mb.TensorSpec(sy)], opset_version=IOS18)
    def prog(x, y):
        return build(x, y)

    return prog


def only(out: dict[str, np.ndarray]) -> np.ndarray:
    assert len(out) == 1
    return next(iter(out.values()))


def np_sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x.astype(np.float64)))


def np_erf(x: np.ndarray) -> np.ndarray:
    return np.array([math.erf(v) for v in x.ravel().astype(np.float64)]).reshape(x.shape)


# ------------------------------------------------------------------------------ elementwise

BINARY = {
    "add": (mb.add, np.add),
    "sub": (mb.sub, np.subtract),
    "mul": (mb.mul, np.multiply),
    "real_div": (mb.real_div, np.divide),
    "maximum": (mb.maximum, np.maximum),
    "minimum": (mb.minimum, np.minimum),
    "pow": (mb.pow, np.power),
}


@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_ops_broadcast(op: str) -> None:
    build, ref = BINARY[op]
    prog = binary_program((2, 3, 4), (3, 1), lambda x, y: build(x=x, y=y))
    x, y = np.abs(randn(2, 3, 4)) + 0.5, randn(3, 1)
    out = only(run(prog, {"x": x, "y": y}))
    assert out.dtype == np.float32 and out.shape == (2, 3, 4)
    np.testing.assert_allclose(out, ref(x.astype(np.float64), y), rtol=1e-5)


UNARY = {
    "sqrt": (lambda x: mb.sqrt(x=x), np.sqrt),
    "rsqrt": (lambda x: mb.rsqrt(x=x, epsilon=0.5), lambda x: 1 / np.sqrt(x + 0.5)),
    "exp": (lambda x: mb.exp(x=x), np.exp),
    "inverse": (lambda x: mb.inverse(x=x, epsilon=0.25), lambda x: 1 / (x + 0.25)),
    "tanh": (lambda x: mb.tanh(x=x), np.tanh),
    "sigmoid": (lambda x: mb.sigmoid(x=x), np_sigmoid),
    "silu": (lambda x: mb.silu(x=x), lambda x: x * np_sigmoid(x)),
    "relu": (lambda x: mb.relu(x=x), lambda x: np.maximum(x, 0)),
    "gelu_exact": (lambda x: mb.gelu(x=x), lambda x: 0.5 * x * (1 + np_erf(x / math.sqrt(2)))),
    "gelu_tanh": (
        lambda x: mb.gelu(x=x, mode="TANH_APPROXIMATION"),
        lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3))),
    ),
    "gelu_sigmoid": (
        lambda x: mb.gelu(x=x, mode="SIGMOID_APPROXIMATION"),
        lambda x: x * np_sigmoid(1.702 * x),
    ),
}


@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary_ops(op: str) -> None:
    build, ref = UNARY[op]
    x = randn(3, 5) * 3
    if op in ("sqrt",):
        x = np.abs(x)
    if op == "rsqrt":
        x = np.abs(x)
    out = only(run(unary_program((3, 5), build), {"x": x}))
    np.testing.assert_allclose(out, ref(x.astype(np.float64)), rtol=2e-6, atol=1e-6)


def test_default_epsilons_are_mil_defaults() -> None:
    # inverse's default epsilon is 1e-4 (not 0): 1/(2 + 1e-4).
    out = only(
        run(unary_program((1,), lambda x: mb.inverse(x=x)), {"x": np.array([2.0], np.float32)})
    )
    np.testing.assert_allclose(out, [1 / (2 + 1e-4)], rtol=1e-7)


def test_comparisons_select_and_cast() -> None:
    def build(x, y):
        gt = mb.greater(x=x, y=y)
        outs = [mb.cast(x=gt, dtype="int32")]
        for fn in (mb.less, mb.equal, mb.greater_equal, mb.less_equal, mb.not_equal):
            outs.append(mb.cast(x=fn(x=x, y=y), dtype="int32"))
        outs.append(mb.select(cond=gt, a=x, b=mb.mul(x=y, y=10.0)))
        outs.append(mb.cast(x=mb.mul(x=x, y=3.0), dtype="int32"))  # truncates like astype
        return tuple(outs)

    x = np.array([[1.0, 2.0, -3.0, 4.0]], np.float32)
    y = np.array([[1.0, 1.0, 0.5, 5.0]], np.float32)
    outs = list(run(binary_program((1, 4), (1, 4), build), {"x": x, "y": y}).values())
    for got, fn in zip(
        outs[:6], (np.greater, np.less, np.equal, np.greater_equal, np.less_equal, np.not_equal)
    ):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, fn(x, y).astype(np.int32))
    np.testing.assert_array_equal(outs[6], np.where(x > y, x, y * 10))
    assert outs[7].dtype == np.int32
    np.testing.assert_array_equal(outs[7], (x * 3).astype(np.int32))


# --------------------------------------------------------------------------- linear algebra


def test_matmul_transposes_and_batch_broadcast() -> None:
    prog = binary_program(
        (2, 1, 5, 3),
        (4, 6, 5),
        lambda x, y: mb.matmul(x=x, y=y, transpose_x=True, transpose_y=True),
    )
    x, y = randn(2, 1, 5, 3), randn(4, 6, 5)
    out = only(run(prog, {"x": x, "y": y}))
    ref = np.swapaxes(x, -1, -2).astype(np.float64) @ np.swapaxes(y, -1, -2)
    assert out.shape == (2, 4, 3, 6)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_linear_with_bias() -> None:
    w, b = randn(6, 4), randn(6)
    x = randn(2, 3, 4)
    out = only(run(unary_program((2, 3, 4), lambda x: mb.linear(x=x, weight=w, bias=b)), {"x": x}))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + b, rtol=1e-5, atol=1e-5)


def np_conv1x1(
    x: np.ndarray, w: np.ndarray, groups: int, bias: np.ndarray | None = None
) -> np.ndarray:
    n, cin = x.shape[:2]
    cout = w.shape[0]
    xs = x.reshape(n, groups, cin // groups, -1).astype(np.float64)
    ws = w.reshape(groups, cout // groups, cin // groups).astype(np.float64)
    out = np.einsum("goc,ngcl->ngol", ws, xs).reshape((n, cout, *x.shape[2:]))
    if bias is not None:
        out += bias.reshape((cout,) + (1,) * (x.ndim - 2))
    return out


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_conv_1x1_groups_and_bias(groups: int) -> None:
    w, b = randn(8, 8 // groups, 1, 1), randn(8)
    x = randn(2, 8, 3, 5)
    prog = unary_program((2, 8, 3, 5), lambda x: mb.conv(x=x, weight=w, bias=b, groups=groups))
    np.testing.assert_allclose(
        only(run(prog, {"x": x})), np_conv1x1(x, w, groups, b), rtol=1e-5, atol=1e-5
    )


def test_conv_1d() -> None:
    w = randn(6, 4, 1)
    x = randn(1, 4, 7)
    prog = unary_program((1, 4, 7), lambda x: mb.conv(x=x, weight=w))
    np.testing.assert_allclose(only(run(prog, {"x": x})), np_conv1x1(x, w, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["matmul", "conv"])
def test_default_kernels_give_a_row_the_same_bits_at_every_index(kind: str) -> None:
    """Row invariance by construction: the row at index r of a block, whatever its neighbours,
    and the same row alone, come out bit-identical (12 rows: the grouped-attention shape on which
    one BLAS call per block rounds rows 8..11 differently; 64 rows: a prefill chunk). 150 output
    channels: the conv computes them in blocks of 64 (two whole, one partial) for every row."""
    row, other = randn(96), randn(150, 96)
    results = []
    for rows in (1, 4, 12, 64):
        for r in sorted({0, rows // 2, rows - 1}):
            block = randn(rows, 96)
            block[r] = row
            if kind == "matmul":
                out = mil_ops.OPS["matmul"].kernel({"x": block[None], "y": other.T[None]})[0]
            else:  # [1, Cin, T, 1] activations, [Cout, Cin, 1, 1] weights
                x = block.T[None, :, :, None]
                out = mil_ops.OPS["conv"].kernel({"x": x, "weight": other[:, :, None, None]})
                out = out[0, :, :, 0].T
            results.append(out[r])
    assert all(np.array_equal(x, results[0]) for x in results)
    np.testing.assert_allclose(results[0], other.astype(np.float64) @ row, rtol=1e-5, atol=1e-4)


def test_short_contractions_are_summed_in_index_order() -> None:
    """The KV scatter's [S, T] @ [T, hd] with a one-hot mask copies rows exactly."""
    write = np.zeros((1, 1, 8, 4), np.float32)
    write[0, 0, [5, 6], [0, 1]] = 1.0
    rows = randn(1, 2, 4, 3)
    out = mil_ops.OPS["matmul"].kernel({"x": write, "y": rows})
    assert np.array_equal(out[0, :, 5], rows[0, :, 0]) and np.array_equal(out[0, :, 6], rows[0, :, 1])
    assert not out[0, :, [0, 1, 2, 3, 4, 7]].any()


# ---------------------------------------------------------------------------- normalization


def test_softmax_axis() -> None:
    x = randn(2, 5, 3) * 4
    out = only(run(unary_program((2, 5, 3), lambda x: mb.softmax(x=x, axis=1)), {"x": x}))
    e = np.exp(x.astype(np.float64) - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, e / e.sum(axis=1, keepdims=True), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("axes", [[1], [-1], [1, 2]])
def test_layer_norm_axes_gamma_beta(axes: list[int]) -> None:
    shape = (2, 6, 4)
    norm_shape = tuple(shape[a] for a in axes)
    gamma, beta = randn(*norm_shape), randn(*norm_shape)
    x = randn(*shape) * 3 + 1
    prog = unary_program(
        shape, lambda x: mb.layer_norm(x=x, axes=axes, gamma=gamma, beta=beta, epsilon=1e-3)
    )
    out = only(run(prog, {"x": x}))
    xd = x.astype(np.float64)
    ax = tuple(a % 3 for a in axes)
    bshape = [shape[i] if i in ax else 1 for i in range(3)]
    ref = (xd - xd.mean(ax, keepdims=True)) / np.sqrt(xd.var(ax, keepdims=True) + 1e-3)
    ref = ref * gamma.reshape(bshape) + beta.reshape(bshape)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_reductions_and_argmax() -> None:
    def build(x):
        return (
            mb.reduce_sum(x=x, axes=[1], keep_dims=True),
            mb.reduce_mean(x=x, axes=[0, 2]),
            mb.reduce_max(x=x, axes=[-1]),
            mb.reduce_min(x=x),
            mb.reduce_argmax(x=x, axis=1),
            mb.reduce_argmax(x=x, axis=-1, keep_dims=True),
        )

    x = randn(2, 3, 4)
    s, m, mx, mn, am, am_keep = run(unary_program((2, 3, 4), build), {"x": x}).values()
    np.testing.assert_allclose(s, x.sum(1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(m, x.mean((0, 2)), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(mx, x.max(-1))
    np.testing.assert_array_equal(mn, x.min())
    assert am.dtype == np.int32 and am_keep.dtype == np.int32
    np.testing.assert_array_equal(am, x.argmax(1))
    np.testing.assert_array_equal(am_keep, x.argmax(-1)[..., None])


# ---------------------------------------------------------------------------- data movement


def test_reshape_transpose_expand_squeeze() -> None:
    def build(x, y):
        return (
            mb.reshape(x=x, shape=[0, -1]),  # the 0 lines up with dim 1 from the right
            mb.reshape(x=x, shape=mb.shape(x=y)),  # shape from a runtime tensor
            mb.transpose(x=x, perm=[2, 0, 1]),
            mb.expand_dims(x=x, axes=[0, -1]),
            mb.squeeze(x=mb.expand_dims(x=x, axes=[1]), axes=[1]),
            mb.squeeze(x=mb.reshape(x=x, shape=[1, 2, 1, 12])),
            mb.identity(x=x),
        )

    x, y = randn(2, 3, 4), randn(4, 6)
    r0, r1, t, e, s1, s2, ident = run(
        binary_program((2, 3, 4), (4, 6), build), {"x": x, "y": y}
    ).values()
    np.testing.assert_array_equal(r0, x.reshape(3, 8))
    np.testing.assert_array_equal(r1, x.reshape(4, 6))
    np.testing.assert_array_equal(t, x.transpose(2, 0, 1))
    np.testing.assert_array_equal(e, x[None, ..., None])
    np.testing.assert_array_equal(s1, x)
    np.testing.assert_array_equal(s2, x.reshape(2, 12))
    np.testing.assert_array_equal(ident, x)


def test_reshape_zero_counts_from_the_right() -> None:
    # iOS17+ rule: [1, 0, -1, 0] on (2, 50) -> (1, 1, 2, 50).
    x = randn(2, 50)
    out = only(
        run(unary_program((2, 50), lambda x: mb.reshape(x=x, shape=[1, 0, -1, 0])), {"x": x})
    )
    np.testing.assert_array_equal(out, x.reshape(1, 1, 2, 50))


def test_concat_split_tile() -> None:
    def build(x, y):
        a, b, c = mb.split(x=x, num_splits=3, axis=1)
        p, q = mb.split(x=x, split_sizes=[1, 5], axis=-1)
        return (
            mb.concat(values=[x, y], axis=0),
            mb.concat(values=[x, x], axis=1, interleave=True),
            a,
            b,
            c,
            p,
            q,
            mb.tile(x=y, reps=[2, 1, 3]),
        )

    x, y = randn(2, 3, 6), randn(1, 3, 6)
    outs = list(run(binary_program((2, 3, 6), (1, 3, 6), build), {"x": x, "y": y}).values())
    np.testing.assert_array_equal(outs[0], np.concatenate([x, y], 0))
    np.testing.assert_array_equal(outs[1], np.stack([x, x], axis=2).reshape(2, 6, 6))
    for got, want in zip(outs[2:5], np.split(x, 3, axis=1)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(outs[5], x[..., :1])
    np.testing.assert_array_equal(outs[6], x[..., 1:])
    np.testing.assert_array_equal(outs[7], np.tile(y, (2, 1, 3)))


def test_slicing_gather_shape_fill() -> None:
    def build(x, pos):
        return (
            mb.slice_by_index(
                x=x,
                begin=[1, 0, -3, 0],
                end=[2, 3, -1, 5],
                stride=[1, 2, 1, 2],
                begin_mask=[False, True, False, False],
                end_mask=[False, False, False, True],
                squeeze_mask=[True, False, False, False],
            ),
            mb.slice_by_size(x=x, begin=[0, 1, 2, 0], size=[2, -1, 2, 1]),
            mb.slice_by_index(
                x=x,
                begin=mb.concat(values=[[0, 0], pos, [0]], axis=0),
                end=[2, 3, 0, 5],
                end_mask=[False, False, True, False],
            ),
            mb.gather(x=x, indices=np.array([[2, 0], [1, 2]], np.int32), axis=1),
            mb.shape(x=x),
            mb.fill(shape=mb.shape(x=pos), value=2.5),
        )

    @mb.program(
        input_specs=[mb.TensorSpec((2, 3, 4, 5)), mb.TensorSpec((1,), dtype=types.int32)],
        opset_version=IOS18,
    )
    def prog(x, pos):
        return build(x, pos)

    x = randn(2, 3, 4, 5)
    pos = np.array([3], np.int32)
    s1, s2, s3, g, shp, fill = run(prog, {"x": x, "pos": pos}).values()
    np.testing.assert_array_equal(s1, x[1, :3:2, -3:-1, 0::2])
    np.testing.assert_array_equal(s2, x[0:2, 1:, 2:4, 0:1])
    np.testing.assert_array_equal(s3, x[:, :, 3:, :])
    np.testing.assert_array_equal(g, np.take(x, [[2, 0], [1, 2]], axis=1))
    assert shp.dtype == np.int32
    np.testing.assert_array_equal(shp, [2, 3, 4, 5])
    np.testing.assert_array_equal(fill, [2.5])


# ---------------------------------------------------------------------- quantized weights


def blockwise_program(
    q8: np.ndarray, s8: np.ndarray, q4: np.ndarray, s4: np.ndarray, o4: np.ndarray
) -> Any:
    cin = q8.shape[1]

    @mb.program(input_specs=[mb.TensorSpec((1, cin, 3, 1), dtype=types.fp16)], opset_version=IOS18)
    def prog(x):
        w8 = mb.constexpr_blockwise_shift_scale(data=q8, scale=s8, name="w8")
        w4 = mb.constexpr_blockwise_shift_scale(data=q4, scale=s4, offset=o4, name="w4")
        y = mb.conv(x=x, weight=w8, name="conv8")
        return y, mb.conv(x=x, weight=w4, name="conv4")

    return prog


def np_dequant(q: np.ndarray, scale: np.ndarray, offset: np.ndarray | None = None) -> np.ndarray:
    out = q.astype(np.float64)
    for axis, (n, s) in enumerate(zip(q.shape, scale.shape)):
        scale = np.repeat(scale, n // s, axis)
        offset = None if offset is None else np.repeat(offset, n // s, axis)
    if offset is not None:
        out = out - offset
    return out * scale.astype(np.float64)


@pytest.fixture(scope="module")
def quantized() -> dict[str, np.ndarray]:
    cout, cin = 8, 16
    return {
        "q8": rng.integers(-127, 128, (cout, cin, 1, 1)).astype(np.int8),
        "s8": (rng.random((cout, 4, 1, 1)) * 0.01 + 0.001).astype(
            np.float16
        ),  # blocks of 4 along Cin
        "q4": rng.integers(-8, 8, (cout, cin, 1, 1)).astype(types.np_int4_dtype),
        "s4": (rng.random((cout, 1, 1, 1)) * 0.1 + 0.01).astype(np.float16),  # per output channel
        "o4": rng.integers(-8, 8, (cout, 1, 1, 1)).astype(types.np_int4_dtype),
        "x": randn(1, cin, 3, 1, dtype=np.float16),
    }


def check_blockwise(interp: MILInterpreter, qd: dict[str, np.ndarray]) -> None:
    y8, y4 = interp.predict({"x": qd["x"]}).values()
    w8 = np_dequant(qd["q8"], qd["s8"])
    w4 = np_dequant(qd["q4"], qd["s4"], qd["o4"])
    np.testing.assert_allclose(y8, np_conv1x1(qd["x"], w8, 1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y4, np_conv1x1(qd["x"], w4, 1), rtol=1e-5, atol=1e-5)


def test_blockwise_shift_scale_conv_program(quantized: dict[str, np.ndarray]) -> None:
    prog = blockwise_program(*(quantized[k] for k in ("q8", "s8", "q4", "s4", "o4")))
    check_blockwise(MILInterpreter.from_program(prog), quantized)


def test_blockwise_shift_scale_conv_package(
    quantized: dict[str, np.ndarray], tmp_path: Path
) -> None:
    prog = blockwise_program(*(quantized[k] for k in ("q8", "s8", "q4", "s4", "o4")))
    interp = save_and_load(prog, tmp_path / "q.mlpackage", compute_precision=ct.precision.FLOAT16)
    check_blockwise(interp, quantized)


def test_constexpr_evaluated_once_at_load(
    quantized: dict[str, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    opdef = mil_ops.OPS["constexpr_blockwise_shift_scale"]
    counting = type(opdef)(lambda a: calls.append(1) or opdef.kernel(a))
    monkeypatch.setitem(mil_ops.OPS, "constexpr_blockwise_shift_scale", counting)
    prog = blockwise_program(*(quantized[k] for k in ("q8", "s8", "q4", "s4", "o4")))
    interp = MILInterpreter.from_program(prog)
    assert len(calls) == 2
    interp.predict({"x": quantized["x"]})
    interp.predict({"x": quantized["x"]})
    assert len(calls) == 2


def test_affine_dequantize_linear() -> None:
    q = rng.integers(0, 256, (6, 4)).astype(np.uint8)
    zp = rng.integers(100, 150, (6,)).astype(np.uint8)
    scale = (rng.random(6) * 0.02 + 0.01).astype(np.float32)

    @mb.program(input_specs=[mb.TensorSpec((2, 4))], opset_version=ct.target.iOS16)
    def prog(x):
        w = mb.constexpr_affine_dequantize(quantized_data=q, zero_point=zp, scale=scale, axis=0)
        return mb.linear(x=x, weight=w)

    x = randn(2, 4)
    w = (q.astype(np.float64) - zp[:, None]) * scale[:, None]
    np.testing.assert_allclose(only(run(prog, {"x": x})), x @ w.T, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ state, RangeDim, packages

D, S = 4, 6


def stateful_program() -> Any:
    """y = x + (sum of everything written so far); cache[:, :, 0:T, :] gets x each call."""

    @mb.program(
        input_specs=[
            mb.TensorSpec((1, D, get_new_symbol(), 1), dtype=types.fp16),
            mb.StateTensorSpec((1, 1, S, D), dtype=types.fp16),
        ],
        opset_version=IOS18,
    )
    def prog(x, cache):
        old = mb.read_state(input=cache)
        xt = mb.transpose(x=x, perm=[0, 3, 2, 1])  # (1, 1, T, D)
        total = mb.reduce_sum(x=old, axes=[2], keep_dims=True)  # (1, 1, 1, D)
        # Accumulate x's rows into cache row 0..T-1 by padding xt up to S rows with zeros.
        pad = mb.fill(
            shape=mb.concat(
                values=[
                    [1, 1],
                    mb.sub(x=S, y=mb.slice_by_index(x=mb.shape(x=xt), begin=[2], end=[3])),
                    [D],
                ],
                axis=0,
            ),
            value=np.float16(0),
        )
        mb.coreml_update_state(
            state=cache, value=mb.add(x=old, y=mb.concat(values=[xt, pad], axis=2))
        )
        return mb.add(x=xt, y=total, name="y")

    return prog


@pytest.fixture(scope="module")
def stateful_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pkg") / "stateful.mlpackage"
    model = ct.convert(
        stateful_program(),
        inputs=[
            ct.TensorType("x", shape=(1, D, ct.RangeDim(1, 4, default=1), 1), dtype=np.float16)
        ],
        minimum_deployment_target=IOS18,
        compute_precision=ct.precision.FLOAT16,
        skip_model_load=True,
    )
    model.save(str(path))
    return path


def np_stateful(xs: list[np.ndarray]) -> tuple[list[np.ndarray], np.ndarray]:
    cache = np.zeros((1, 1, S, D))
    outs = []
    for x in xs:
        xt = x.astype(np.float64).transpose(0, 3, 2, 1)
        outs.append(xt + cache.sum(axis=2, keepdims=True))
        cache[:, :, : xt.shape[2], :] += xt
    return outs, cache


@pytest.mark.parametrize("source", ["program", "package"])
def test_stateful_rangedim_t1_then_t4(source: str, stateful_package: Path) -> None:
    interp = (
        MILInterpreter.from_program(stateful_program())
        if source == "program"
        else MILInterpreter.from_package(stateful_package)
    )
    assert interp.input_names == ["x"] and interp.state_names == ["cache"]
    assert interp.input_shapes == {"x": (1, D, None, 1)}
    assert interp.state_shapes == {"cache": (1, 1, S, D)}
    state = interp.make_state()
    assert state["cache"].dtype == np.float32
    cache_array = state["cache"]
    xs = [randn(1, D, 1, 1, dtype=np.float16), randn(1, D, 4, 1, dtype=np.float16)]
    ys = [interp.predict({"x": x}, state)["y"] for x in xs]
    want, want_cache = np_stateful(xs)
    assert state["cache"] is cache_array  # updated in place, not replaced
    np.testing.assert_allclose(state["cache"], want_cache, rtol=1e-6)
    for y, w in zip(ys, want):
        assert y.dtype == np.float32
        np.testing.assert_allclose(y, w, rtol=1e-6)
    # The second call saw the first call's write: its output differs from a fresh-state call.
    fresh = interp.predict({"x": xs[1]})["y"]
    assert not np.allclose(fresh, ys[1])


def test_stateful_package_fp16_mode(stateful_package: Path) -> None:
    interp = MILInterpreter.from_package(stateful_package, precision="fp16")
    state = interp.make_state()
    assert state["cache"].dtype == np.float16
    xs = [randn(1, D, 1, 1, dtype=np.float16), randn(1, D, 4, 1, dtype=np.float16)]
    ys = [interp.predict({"x": x}, state)["y"] for x in xs]
    want, want_cache = np_stateful(xs)
    assert ys[1].dtype == np.float16
    np.testing.assert_allclose(ys[1], want[1], rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(state["cache"], want_cache, rtol=2e-3, atol=2e-3)


def test_read_state_is_a_snapshot_not_a_view() -> None:
    @mb.program(
        input_specs=[mb.TensorSpec((2,)), mb.StateTensorSpec((2,), dtype=types.fp16)],
        opset_version=IOS18,
    )
    def prog(x, st):
        before = mb.read_state(input=st)
        mb.coreml_update_state(state=st, value=mb.add(x=before, y=mb.cast(x=x, dtype="fp16")))
        # Used after the update: must still be the value read before it.
        return mb.cast(x=mb.mul(x=before, y=np.float16(1.0)), dtype="fp32")

    interp = MILInterpreter.from_program(prog)
    state = interp.make_state()
    x = np.array([1.0, 2.0], np.float32)
    np.testing.assert_array_equal(only(interp.predict({"x": x}, state)), [0.0, 0.0])
    np.testing.assert_array_equal(only(interp.predict({"x": x}, state)), [1.0, 2.0])
    np.testing.assert_array_equal(state["st"], [2.0, 4.0])


def test_rangedim_bounds_from_package(stateful_package: Path) -> None:
    interp = MILInterpreter.from_package(stateful_package)
    with pytest.raises(ValueError, match=r"'x'.*axis 2"):
        interp.predict({"x": randn(1, D, 5, 1)}, interp.make_state())


def mini_block_program() -> Any:
    """A transformer-ish block written with primitives that ct.convert's passes like to fuse."""
    d, f = 8, 12
    wq, wo, w1 = randn(d, d) * 0.3, randn(d, d) * 0.3, randn(f, d) * 0.3
    g, b = randn(d) + 1, randn(d)

    @mb.program(input_specs=[mb.TensorSpec((3, d))], opset_version=IOS18)
    def prog(x):
        mean = mb.reduce_mean(x=x, axes=[-1], keep_dims=True)
        cent = mb.sub(x=x, y=mean)
        var = mb.reduce_mean(x=mb.mul(x=cent, y=cent), axes=[-1], keep_dims=True)
        ln = mb.add(x=mb.mul(x=mb.mul(x=cent, y=mb.rsqrt(x=mb.add(x=var, y=1e-5))), y=g), y=b)
        q = mb.add(x=mb.matmul(x=ln, y=wq, transpose_y=True), y=b)
        att = mb.softmax(x=mb.mul(x=mb.matmul(x=q, y=ln, transpose_y=True), y=0.35), axis=-1)
        h = mb.add(x=x, y=mb.matmul(x=mb.matmul(x=att, y=ln), y=wo, transpose_y=True))
        up = mb.matmul(x=h, y=w1, transpose_y=True)
        act = mb.mul(x=up, y=mb.sigmoid(x=up))
        rms = mb.rsqrt(
            x=mb.add(x=mb.reduce_mean(x=mb.mul(x=act, y=act), axes=[-1], keep_dims=True), y=1e-6)
        )
        return mb.mul(x=act, y=rms, name="out")

    return prog


def test_pass_rewritten_package_matches_program(tmp_path: Path) -> None:
    prog = mini_block_program()
    x = randn(3, 8)
    want = only(run(prog, {"x": x}))
    got32 = save_and_load(prog, tmp_path / "b32.mlpackage").predict({"x": x})["out"]
    np.testing.assert_allclose(got32, want, rtol=1e-4, atol=1e-5)
    # FLOAT16 conversion inserts fp32<->fp16 casts around an fp16 body.
    interp16 = save_and_load(
        prog, tmp_path / "b16.mlpackage", "fp16", compute_precision=ct.precision.FLOAT16
    )
    got16 = interp16.predict({"x": x})["out"]
    assert got16.dtype == np.float32  # the declared output is fp32 (cast back by the converter)
    np.testing.assert_allclose(got16, want, rtol=3e-2, atol=3e-2)
    assert not np.array_equal(got16, want)


# -------------------------------------------------------------------------------- precision


def test_fp16_mode_rounds_each_op_fp32_does_not() -> None:
    @mb.program(input_specs=[mb.TensorSpec((1,), dtype=types.fp16)], opset_version=IOS18)
    def prog(x):
        bumped = mb.add(x=x, y=np.float16(2.0**-12))  # below fp16 resolution at 1.0
        return mb.sub(x=bumped, y=x)

    x = np.array([1.0], np.float16)
    out32 = only(run(prog, {"x": x}, "fp32"))
    out16 = only(run(prog, {"x": x}, "fp16"))
    assert out32.dtype == np.float32 and out16.dtype == np.float16
    assert out32[0] == np.float32(2.0**-12)
    assert out16[0] == 0.0  # 1 + 2^-12 rounded to 1 in fp16 before the subtraction


def test_cast_to_fp16_rounds_only_in_fp16_mode() -> None:
    prog = unary_program((1,), lambda x: mb.cast(x=x, dtype="fp16"))
    x = np.array([1.0 + 2.0**-12], np.float32)
    out32 = only(run(prog, {"x": x}, "fp32"))
    out16 = only(run(prog, {"x": x}, "fp16"))
    assert out32.dtype == np.float32 and out32[0] == x[0]
    assert out16.dtype == np.float16 and out16[0] == 1.0


def test_fp16_overflow_warns_naming_the_op() -> None:
    @mb.program(input_specs=[mb.TensorSpec((2,), dtype=types.fp16)], opset_version=IOS18)
    def prog(x):
        return mb.mul(x=x, y=np.float16(1000.0), name="scale_up")

    interp = MILInterpreter.from_program(prog, "fp16")
    with pytest.warns(RuntimeWarning, match="scale_up"):
        out = only(interp.predict({"x": np.array([100.0, 1.0], np.float32)}))
    assert np.isinf(out[0]) and out[1] == 1000.0
    assert only(run(prog, {"x": np.array([100.0, 1.0], np.float32)}))[0] == 1e5  # fp32: no overflow


def test_cast_to_fp32_before_softmax_stays_fp32_in_fp16_mode() -> None:
    @mb.program(input_specs=[mb.TensorSpec((1, 3), dtype=types.fp16)], opset_version=IOS18)
    def prog(x):
        logits = mb.mul(x=x, y=np.float16(1.0))
        return mb.softmax(x=mb.cast(x=logits, dtype="fp32"), axis=-1)

    x = np.array([[0.0, -20.0, -0.5]], np.float16)
    out = only(run(prog, {"x": x}, "fp16"))
    assert out.dtype == np.float32
    e = np.exp(x.astype(np.float64) - x.max())
    ref = e / e.sum()
    # exp(-20) / Z ~ 1.3e-9 is below fp16's smallest subnormal: it survives only in fp32.
    np.testing.assert_allclose(out, ref, rtol=1e-6)
    assert out[0, 1] > 0 and np.float16(out[0, 1]) == 0


def test_fp16_inputs_accept_float32_arrays() -> None:
    prog = unary_program((2,), lambda x: mb.mul(x=x, y=3.0))
    out = only(
        MILInterpreter.from_program(prog, "fp16").predict({"x": np.array([1.0, 2.0], np.float32)})
    )
    np.testing.assert_array_equal(out, [3.0, 6.0])


# ------------------------------------------------------------------------------------ errors


def test_unsupported_op_raises_at_load_with_op_name() -> None:
    prog = unary_program((2, 3), lambda x: mb.sin(x=mb.relu(x=x), name="my_sine"))
    with pytest.raises(UnsupportedOpError, match=r"'sin'.*'my_sine'") as info:
        MILInterpreter.from_program(prog)
    assert isinstance(info.value, AneSpecError)


def test_unsupported_conv_geometry_raises_at_load() -> None:
    w = randn(4, 4, 3, 3)
    prog = unary_program((1, 4, 5, 5), lambda x: mb.conv(x=x, weight=w, name="conv3x3"))
    with pytest.raises(UnsupportedOpError, match=r"conv3x3.*1x1"):
        MILInterpreter.from_program(prog)
    strided = unary_program(
        (1, 4, 4, 4), lambda x: mb.conv(x=x, weight=randn(4, 4, 1, 1), strides=[2, 2])
    )
    with pytest.raises(UnsupportedOpError, match="stride"):
        MILInterpreter.from_program(strided)


def test_input_validation_names_the_input() -> None:
    prog = binary_program((2, 3), (3,), lambda x, y: mb.add(x=x, y=y))
    interp = MILInterpreter.from_program(prog)
    good = {"x": randn(2, 3), "y": randn(3)}
    bad_inputs = [
        ({"x": good["x"]}, r"missing.*'y'"),
        ({**good, "z": good["y"]}, r"unexpected.*'z'"),
        ({**good, "x": randn(2, 3, 1)}, r"'x'.*rank 2"),
        ({**good, "y": randn(4)}, r"'y'.*shape \(3\)"),
        ({**good, "y": np.arange(3)}, r"'y'.*dtype"),
    ]
    for inputs, message in bad_inputs:
        with pytest.raises(ValueError, match=message):
            interp.predict(inputs)


def test_state_validation(stateful_package: Path) -> None:
    interp = MILInterpreter.from_package(stateful_package, precision="fp16")
    x = randn(1, D, 1, 1, dtype=np.float16)
    fp32_state = np.zeros((1, 1, S, D), np.float32)  # fp16 mode stores (and wants) fp16 state
    read_only = interp.make_state()["cache"]
    read_only.flags.writeable = False
    for state in ({"cache": fp32_state}, {}, {"cache": read_only}):
        with pytest.raises(ValueError, match=r"state 'cache'"):
            interp.predict({"x": x}, state)
    with pytest.raises(ValueError, match=r"unexpected state.*'kv'"):
        interp.predict({"x": x}, {**interp.make_state(), "kv": fp32_state})
