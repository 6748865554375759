"""Weight formats: the Q8_0 fast path equals the generic one; cosines mean what they say."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.model.gguf_file import open_gguf
from ane_spec.model import quant
from ane_spec.shards import weights as W


def test_q8_0_fast_path_matches_generic_requantization(tiny_gguf: Path) -> None:
    t = open_gguf(tiny_gguf).tensor("blk.0.ffn_up.weight")
    fast_acc, slow_acc = W._CosineAccumulator(), W._CosineAccumulator()
    q_fast, s_fast = W._requantize_q8_0_rows(t, np.arange(t.shape[0]), fast_acc)
    q_slow, s_slow = W._convert_float_rows(t, np.arange(t.shape[0]), "int8-channel", slow_acc)
    np.testing.assert_array_equal(s_fast, s_slow)
    # rint of qs*(d/s) vs rint((qs*d)/s): the two float orders may round a .5 tie differently.
    assert np.abs(q_fast.astype(int) - q_slow.astype(int)).max() <= 1
    assert (q_fast != q_slow).mean() < 1e-3
    assert abs(fast_acc.cosine() - slow_acc.cosine()) < 1e-7


@pytest.fixture(params=["torch", "numpy"])
def arithmetic(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The requantization's elementwise ops as torch does them, or as numpy does without the
    `reference` extra."""
    if request.param == "torch":
        pytest.importorskip("torch")   # loaded, as the build has it
    if request.param == "numpy":
        monkeypatch.setattr(W, "loaded_torch", lambda: None)
        monkeypatch.setattr(quant, "loaded_torch", lambda: None)
    return request.param


def test_q8_0_requantization_takes_numpys_int8_times_float32_products(
        tiny_gguf: Path, arithmetic: str) -> None:
    """The fast path casts the int8 values once and multiplies the cast: the values, scales,
    int8 rows and cosine sums are those of numpy's int8 * float32 products, bit for bit, with
    torch's ops or numpy's."""
    t = open_gguf(tiny_gguf).tensor("blk.0.ffn_up.weight")
    assert t.is_q8_0
    qs, d = t.q8_0()
    n = t.shape[0]
    d32 = d.astype(np.float32)
    original = (qs * d32[..., None]).reshape(n, -1)
    s16 = (np.abs(original).max(axis=1, keepdims=True) / 127.0).astype(np.float16)
    s32 = s16.astype(np.float32)
    expected = np.clip(np.rint((qs * (d32 / s32)[..., None]).reshape(n, -1)), -127, 127)
    want = W._CosineAccumulator()
    want.add_scaled(original, expected, s32[:, 0])
    got = W._CosineAccumulator()
    q, s = W._requantize_q8_0_rows(t, np.arange(n), got)
    np.testing.assert_array_equal(q, expected.astype(np.int8))
    np.testing.assert_array_equal(s.view(np.uint16), s16.view(np.uint16))
    assert (got.ab, got.aa, got.bb) == (want.ab, want.aa, want.bb)


def test_q8_0_fast_path_gathers_rows_as_it_slices_them(tiny_gguf: Path) -> None:
    """A run of rows is sliced, any other index gathered: both give the full matrix's rows."""
    t = open_gguf(tiny_gguf).tensor("blk.0.ffn_up.weight")
    q_all, s_all = W._requantize_q8_0_rows(t, np.arange(t.shape[0]), W._CosineAccumulator())
    converted = W.convert_matrix(t, "int8-channel")   # cast into its array, chunk by chunk
    np.testing.assert_array_equal(converted.data[:, :, 0, 0], q_all)
    for idx in (np.arange(3, 40), np.array([7, 2, 2, 30, 5]), np.array([4, 5, 7, 8]),
                np.array([4, 6, 5, 7])):  # spans 4 rows, not in order
        q, s = W._requantize_q8_0_rows(t, idx, W._CosineAccumulator())
        np.testing.assert_array_equal(q, q_all[idx])
        np.testing.assert_array_equal(s, s_all[idx])


def test_formats_and_cosines(tiny_gguf: Path) -> None:
    t = open_gguf(tiny_gguf).tensor("blk.1.attn_qkv.weight")
    ref = t.dequantize().astype(np.float64)
    block = W.convert_matrix(t, "q8-block")
    values = block.data[:, :, 0, 0].reshape(320, 6, 32) * block.scale[:, :, 0, 0, None].astype(np.float64)
    np.testing.assert_array_equal(values.reshape(320, 192), ref)  # bit-identical to the GGUF
    assert block.cosine == 1.0

    chan = W.convert_matrix(t, "int8-channel")
    approx = chan.data[:, :, 0, 0] * chan.scale[:, :, 0, 0].astype(np.float64)
    cos = (approx * ref).sum() / np.sqrt((approx ** 2).sum() * (ref ** 2).sum())
    assert abs(cos - chan.cosine) < 1e-6 and 0.9999 < chan.cosine < 1.0

    half = W.convert_matrix(t, "fp16", rows=slice(10, 20))
    assert half.data.shape == (10, 192, 1, 1) and half.scale is None
    np.testing.assert_allclose(half.data[:, :, 0, 0], ref[10:20], rtol=1e-3)


def test_requantizing_in_threads_gives_the_serial_bits(tiny_gguf: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Row chunks requantized by several threads: the same int8 rows, scales and cosine (its
    sums are added in chunk order) as one thread, here with 7-row chunks over 5 threads."""
    t = open_gguf(tiny_gguf).tensor("blk.0.ffn_up.weight")
    index = np.arange(t.shape[0])
    results = []
    monkeypatch.setattr(W.os, "cpu_count", lambda: 8)   # five threads, whatever this machine has
    for threads in (1, 5):
        monkeypatch.setattr(W, "REQUANT_THREADS", threads)
        data = np.empty(t.shape, np.int8)
        scale = np.empty((t.shape[0], 1), np.float16)
        acc = W._CosineAccumulator()
        W._requantize_q8_0_parallel(t, index, 7, data, scale, acc)
        results.append((data, scale, acc.cosine()))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_array_equal(results[0][1], results[1][1])
    assert results[0][2] == results[1][2]
    q, s = W._requantize_q8_0_rows(t, index, W._CosineAccumulator())
    np.testing.assert_array_equal(results[1][0], q)
    np.testing.assert_array_equal(results[1][1], s)


class _Q8Blocks:
    """What `_requantize_q8_0_rows` reads of a GGUF tensor: its name and its Q8_0 blocks."""

    def __init__(self, qs: np.ndarray, d: np.ndarray):
        self.name, self._qs, self._d = "tiny-scales", qs, d

    def q8_0(self) -> tuple[np.ndarray, np.ndarray]:
        return self._qs, self._d


def test_rows_whose_fp16_scale_is_subnormal_are_kept_within_int8(arithmetic: str) -> None:
    """Rounding needs no clamp while a row's fp16 scale is normal (weights.py says why); rows
    of tiny weights get subnormal scales, whose rounding can put |q| past 127: those are
    clamped, as numpy's reference clips them."""
    rng = np.random.default_rng(7)
    qs = rng.integers(-127, 128, (64, 4, 32), dtype=np.int8)
    d = (rng.uniform(0.5, 1.0, (64, 4)) * 2.0 ** -20).astype(np.float16)
    d32 = d.astype(np.float32)
    original = (qs * d32[..., None]).reshape(64, -1)
    s32 = (np.abs(original).max(axis=1, keepdims=True) / 127.0).astype(np.float16).astype(np.float32)
    assert (s32 < 2.0 ** -14).all()   # subnormal in fp16
    unclamped = np.rint((qs * (d32 / s32)[..., None]).reshape(64, -1))
    assert np.abs(unclamped).max() > 127   # the case the clamp is for
    q, _ = W._requantize_q8_0_rows(_Q8Blocks(qs, d), np.arange(64), W._CosineAccumulator())
    np.testing.assert_array_equal(q, np.clip(unclamped, -127, 127).astype(np.int8))


def test_the_requantization_leaves_a_taken_core_to_the_work_beside_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(W.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(W, "REQUANT_THREADS", 2)
    assert W.requant_threads() == 2
    with W.core_taken():
        assert W.requant_threads() == 1
        with W.core_taken():
            assert W.requant_threads() == 1   # never fewer than one
    assert W.requant_threads() == 2


def test_row_dots_without_numpys_vecdot_are_einsums(monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy before 2.0 has no vecdot: the cosine's row dots are einsum's, to float32's
    rounding the same."""
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 37, 300)).astype(np.float32)
    blas = W._row_dots(a, b)
    monkeypatch.delattr(np, "vecdot", raising=False)
    np.testing.assert_allclose(W._row_dots(a, b), blas, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(W._row_dots(a, b), np.einsum("ij,ij->i", a, b))
