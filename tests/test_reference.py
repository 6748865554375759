"""The reference forward pass, held against a second, loop-by-loop float64 reading of the contract.

The real oracle is llama.cpp (test_llama_cpp_oracle.py, optional). This file guards the
reference on every run: an independent numpy transcription of the contract doc, incremental
decoding with the KV cache, and the long/short factor switch.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ane_spec.errors import AneSpecError
from ane_spec.model.gguf_file import GGUFModel, open_gguf
from ane_spec.model.reference import ReferenceModel


def contract_forward(m: GGUFModel, tokens: list[int], window: int) -> np.ndarray:
    """The contract doc's pseudo-code, transcribed literally with per-head, per-pair loops."""
    c = m.config
    w = lambda name: m.tensor(name).dequantize().astype(np.float64)  # noqa: E731
    factors = m.rope_factors("long" if window > c.original_context_length else "short").astype(float)
    rms = lambda x, g: x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * g  # noqa: E731

    def rope(vec: np.ndarray, pos: int) -> np.ndarray:
        out = vec.copy()
        half = c.rope_dims // 2
        for j in range(half):
            theta = pos * c.rope_freq_base ** (-2 * j / c.rope_dims) / factors[j]
            cs, sn = math.cos(theta) * c.rope_attn_factor, math.sin(theta) * c.rope_attn_factor
            out[j] = vec[j] * cs - vec[j + half] * sn
            out[j + half] = vec[j] * sn + vec[j + half] * cs
        return out

    T, hd = len(tokens), c.head_dim
    h = w("token_embd.weight")[tokens]
    for layer in range(c.num_layers):
        a = rms(h, w(f"blk.{layer}.attn_norm.weight"))
        qkv = a @ w(f"blk.{layer}.attn_qkv.weight").T
        q = qkv[:, : c.hidden_size].reshape(T, c.num_heads, hd)
        k = qkv[:, c.hidden_size: c.hidden_size + c.kv_dim].reshape(T, c.num_kv_heads, hd)
        v = qkv[:, c.hidden_size + c.kv_dim:].reshape(T, c.num_kv_heads, hd)
        q = np.stack([[rope(q[t, i], t) for i in range(c.num_heads)] for t in range(T)])
        k = np.stack([[rope(k[t, i], t) for i in range(c.num_kv_heads)] for t in range(T)])
        o = np.zeros((T, c.hidden_size))
        for head in range(c.num_heads):
            g = head // (c.num_heads // c.num_kv_heads)
            for t in range(T):
                s = np.array([q[t, head] @ k[u, g] / math.sqrt(hd) for u in range(t + 1)])
                p = np.exp(s - s.max())
                p /= p.sum()
                o[t, head * hd:(head + 1) * hd] = p @ v[: t + 1, g]
        h = h + o @ w(f"blk.{layer}.attn_output.weight").T
        f = rms(h, w(f"blk.{layer}.ffn_norm.weight")) @ w(f"blk.{layer}.ffn_up.weight").T
        gate, up = f[:, : c.ffn_size], f[:, c.ffn_size:]
        h = h + (gate / (1 + np.exp(-gate)) * up) @ w(f"blk.{layer}.ffn_down.weight").T
    return rms(h, w("output_norm.weight")) @ w("token_embd.weight").T


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("window", [4096, 8192])
def test_matches_contract_transcription(tiny_gguf_conditioned: Path, window: int) -> None:
    m = open_gguf(tiny_gguf_conditioned)
    tokens = [int(t) for t in np.random.default_rng(window).integers(0, 1000, 23)]
    expected = contract_forward(m, tokens, window)
    ref64 = ReferenceModel(m, context_window=window, dtype=torch.float64)
    got64 = ref64.forward(tokens, ref64.new_cache()).numpy()
    got32 = ReferenceModel(m, context_window=window).logits(tokens)
    # float64 vs float64: only summation order differs.
    np.testing.assert_allclose(got64, expected, rtol=0, atol=1e-8 * np.abs(expected).max())
    assert cosines(got32, expected).min() > 0.999999
    assert (got32.argmax(-1) == expected.argmax(-1)).all()


def test_factor_sets_really_differ(tiny_gguf_conditioned: Path) -> None:
    m = open_gguf(tiny_gguf_conditioned)
    tokens = list(range(5, 45))
    short = ReferenceModel(m, context_window=4096).logits(tokens)
    long = ReferenceModel(m, context_window=8192).logits(tokens)
    assert cosines(short, long).min() < 0.999  # the long factors change late positions


def test_incremental_decoding_equals_full_pass(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    ref = ReferenceModel(m, context_window=64)
    tokens = [int(t) for t in np.random.default_rng(1).integers(0, 1000, 17)]
    full = ref.logits(tokens)
    cache = ref.new_cache()
    parts = [ref.forward(tokens[:6], cache), ref.forward(tokens[6:7], cache),
             ref.forward(tokens[7:11], cache), ref.forward(tokens[11:], cache)]
    np.testing.assert_allclose(torch.cat(parts).numpy(), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 17 and cache.tokens == tokens


def test_greedy_generation_is_varied_and_stops_at_window(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    ref = ReferenceModel(m, context_window=64)
    out = ref.generate([10, 20, 30, 40], max_new_tokens=40)
    assert len(out) == 40
    # The varied fixture must not collapse into one repeated token (contract trap #1).
    assert len(set(out)) >= 8
    full = ref.generate(list(range(1, 60)), max_new_tokens=100)
    assert len(full) == 64 - 59 + 1  # the last token is emitted without being fed back


def test_bad_input_is_refused(tiny_gguf: Path) -> None:
    ref = ReferenceModel(open_gguf(tiny_gguf), context_window=32)
    with pytest.raises(AneSpecError, match="outside the vocabulary"):
        ref.logits([1, 5000])
    with pytest.raises(AneSpecError, match="do not fit the context window of 32"):
        ref.logits(list(range(33)))


def test_a_forked_child_runs_the_reference_after_its_parent_did() -> None:
    """libgomp is not fork-safe: a child forked after the parent ran a parallel torch op hung at
    its first one (builds calibrate with the reference; the build-kill tests fork builds). The
    reference module puts a forked child's torch on one thread."""
    import os
    import signal
    import time

    import torch

    import ane_spec.model.reference  # noqa: F401  (registers the at-fork hook)

    previous = torch.get_num_threads()
    # A team to inherit, whatever this worker's thread budget, held through the fork: a child of
    # a one-thread parent would never enter OpenMP, and the test could not fail.
    torch.set_num_threads(2)
    try:
        big = torch.ones(1 << 22)
        assert float((big * 2).sum()) == 2 * (1 << 22)  # the parent's OpenMP team now exists
        pid = os.fork()
        if pid == 0:  # the child: the same parallel op, then out without pytest's teardown
            os._exit(0 if float((big * 3).sum()) == 3 * (1 << 22) else 1)
    finally:
        torch.set_num_threads(previous)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung in torch (libgomp after fork)")


@pytest.mark.parametrize("weight_type", ["q8_0", "f16"])
def test_streamed_projections_equal_whole_matrix_ones(tmp_path: Path, weight_type: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Activation calibration multiplies each matrix a row block at a time as it dequantizes it
    (Weights.project, stream_weights): the product must be the whole-matrix one, bit for bit,
    in blocks that do not divide the rows, from Q8_0 blocks and from other types alike. (Blocks
    of 7 rows, not a multiple of STREAM_ROW_MULTIPLE, fail this on MKL.)"""
    from ane_spec.model import reference
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.shards.layer_weights import layer_tensor_names

    path = write_synthetic_gguf(tmp_path / f"{weight_type}.gguf",
                                preset("tiny", num_layers=2, weight_type=weight_type))
    model = open_gguf(path)
    monkeypatch.setattr(reference, "STREAM_BLOCK_ELEMENTS", 64 * model.config.ffn_size)
    streamed = ReferenceModel(model, materialize=False, stream_weights=True).w
    whole = ReferenceModel(model, materialize=False).w
    assert streamed.stream and not whole.stream
    rng = torch.Generator().manual_seed(0)
    names = [n for i in range(2) for n in layer_tensor_names(model.config, i)
             if len(model.tensor(n).shape) == 2]
    assert len(names) == 8
    for name in names:
        rows, width = model.tensor(name).shape
        x = torch.randn(40, width, generator=rng)
        expected = x @ whole(name).T
        got = streamed.project(x, name)
        assert got.shape == (40, rows) and torch.equal(got, expected), name
