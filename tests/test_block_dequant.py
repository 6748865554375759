"""block_dequant.py gives gguf-py's values bit for bit: on every byte pattern of each block
type it handles, through dequantize_rows, and on every such tensor of the real files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from ane_spec.model.block_dequant import DEQUANTIZERS
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.quant import dequantize_rows


def _gguf_py(raw_rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gguf_quants.dequantize(np.ascontiguousarray(raw_rows), qtype)


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as float32 bit patterns: NaNs and signed zeros included."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_the_types_of_a_q4_k_m_file_are_covered() -> None:
    assert {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K,
            GGMLQuantizationType.Q5_0} <= set(DEQUANTIZERS)


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZERS, key=lambda t: t.name),
                         ids=lambda t: t.name)
def test_random_blocks_dequantize_as_gguf_py_does(qtype: GGMLQuantizationType) -> None:
    """Random bytes: every nibble, high bit and scale bit pattern, non-finite scales too."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(7).integers(0, 256, (20_000, type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        got = DEQUANTIZERS[qtype](blocks)
    assert _same_bits(got, _gguf_py(blocks.reshape(1, -1), qtype).reshape(-1, block))


@pytest.mark.parametrize("qtype", sorted(DEQUANTIZERS, key=lambda t: t.name),
                         ids=lambda t: t.name)
@pytest.mark.parametrize("rows, blocks_per_row", [(1, 1), (3, 7), (40, 28)])
def test_rows_dequantize_as_gguf_py_does(qtype: GGMLQuantizationType, rows: int,
                                         blocks_per_row: int) -> None:
    block, type_size = GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(rows).integers(0, 256, (rows, blocks_per_row * type_size),
                                               dtype=np.uint8)
    got = dequantize_rows(raw, qtype, blocks_per_row * block)
    assert _same_bits(got, _gguf_py(raw, qtype))


def _check_file(path: Path) -> set[str]:
    """Rows from the start, middle and end of every tensor of a handled type."""
    model = open_gguf(path)
    seen = set()
    for t in model.tensors.values():
        if t.type not in DEQUANTIZERS or len(t.shape) != 2:
            continue
        seen.add(t.type.name)
        n = t.shape[0]
        idx = np.unique(np.r_[0:min(n, 8), n // 2:n // 2 + 8, max(0, n - 8):n]).clip(0, n - 1)
        raw = t.raw.reshape(n, -1)[idx]
        assert _same_bits(t.rows(idx), _gguf_py(raw, t.type).reshape(len(idx), -1)), t.name
    return seen


def test_real_q4_k_m_file(qwen_coder_gguf: Path) -> None:
    assert _check_file(qwen_coder_gguf) >= {"Q4_K", "Q6_K", "Q5_0"}


def test_real_q4_1_file(smollm2_gguf: Path) -> None:
    assert "Q4_1" in _check_file(smollm2_gguf)
