"""GGUF tensor types: every block type as gguf-py's own dequantization reads it, Q8_0 as views.

`dequantize_rows` hands whole rows of blocks to `gguf.quants.dequantize`, the code llama.cpp's
own Python tools use, so a K-quant or IQ file reads as llama.cpp defines it; the types in
`block_dequant.DEQUANTIZERS` (those of Q4_K_M, Q5_K_M, Q3_K_M, Q2_K and older Q4/Q5 files) go
through it instead, which gives gguf-py's values bit for bit ~3x faster. The callers bound
the work (a chunk of rows at a time); gguf-py itself works through 16 rows at a time, so its
temporaries stay a few times one chunk.

A Q8_0 row of n values is n/32 blocks of 34 bytes: an fp16 scale `d` then 32 int8 `qs`, and
value = d * qs[j]. Viewing the raw bytes through a structured dtype gives the scales and the
int8 values without copying anything out of the memmap.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from ane_spec.errors import GGUFError
from ane_spec.model.block_dequant import DEQUANTIZERS

if TYPE_CHECKING:
    from types import ModuleType

FLOAT_TYPES = frozenset({GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16})
# What gguf-py can dequantize: its registered block types plus the two it handles inline.
DEQUANTIZABLE = frozenset(gguf_quants._type_traits) | FLOAT_TYPES


def dequantize_rows(raw_rows: np.ndarray, qtype: GGMLQuantizationType, row_length: int
                    ) -> np.ndarray:
    """Raw bytes of whole rows `[n, row_bytes]` -> float32 `[n, row_length]`, as gguf-py gives
    them."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    if raw_rows.shape[-1] != row_length // block * type_size or row_length % block:
        # gguf_format checks this for every tensor; a caller slicing wrongly gets a clear error.
        raise GGUFError(f"{qtype.name} rows of {row_length} values need "
                        f"{row_length // block * type_size} bytes each, got {raw_rows.shape[-1]}")
    n = raw_rows.shape[0]
    fast = DEQUANTIZERS.get(qtype)
    if fast is not None:
        with np.errstate(all="ignore"):  # non-finite scales are the caller's to refuse, by name
            values = fast(np.ascontiguousarray(raw_rows).reshape(-1, type_size))
        return values.reshape(n, row_length)
    # gguf-py works through 16 of its rows per numpy pass; short rows make that many small
    # passes. Blocks are independent and stay in order, so k short rows are handed over as one
    # longer row when k divides the count (its own code, fewer passes: ~1.4x on 896-wide Q5_0).
    k = max(1, _GGUF_ROW_VALUES // row_length)
    while n % k:
        k -= 1
    rows = np.ascontiguousarray(raw_rows).reshape(n // k, -1)
    with np.errstate(all="ignore"):  # non-finite scales are the caller's to refuse, by name
        values = gguf_quants.dequantize(rows, qtype)
    return values.reshape(n, row_length)


_GGUF_ROW_VALUES = 4096

Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 34
Q8_0_DTYPE = np.dtype([("d", "<f2"), ("qs", "i1", (Q8_0_BLOCK,))])


def q8_0_blocks(raw: np.ndarray, in_features: int) -> np.ndarray:
    """View raw bytes `[rows, row_bytes]` as structured blocks `[rows, in/32]` (no copy)."""
    n_blocks = in_features // Q8_0_BLOCK
    rows = raw.reshape(-1, n_blocks * Q8_0_BLOCK_BYTES)
    return rows.view(Q8_0_DTYPE).reshape(rows.shape[0], n_blocks)


def q8_0_dequantize(qs: np.ndarray, scales: np.ndarray, dtype: np.dtype = np.float32,
                    empty: Callable[..., np.ndarray] = np.empty) -> np.ndarray:
    """Blocked int8 `[rows, nb, 32]` and fp16 scales `[rows, nb]` -> `[rows, nb*32]`, in an
    array from `empty(shape, dtype)` (a memory_pool.MemoryPool's, to reuse memory)."""
    out = empty(qs.shape, dtype)
    # int8 * float32 into a preallocated output: numpy casts the int8 in small buffers, so the
    # only full-size allocation is the result itself.
    np.multiply(qs, scales.astype(dtype)[..., None], out=out)
    return out.reshape(qs.shape[0], -1)


def loaded_torch() -> "ModuleType | None":
    """torch if this process has imported it, else None. The build has (coremltools imports
    it, and the calibration runs on it); importing it for a faster elementwise op would cost
    ~1 s wherever a GGUF is read (`inspect`, the hash child), and torch is the optional
    `reference` extra."""
    return sys.modules.get("torch")


def times_block_scales(values: np.ndarray, scales: np.ndarray, out: np.ndarray) -> None:
    """out = values * scales[..., None]: float32 blocks `[rows, nb, 32]` times one scale each
    `[rows, nb]` (`out` may be `values`). torch's where loaded: numpy broadcasts a block's
    scale over its 32 values an inner loop at a time (118 us on a 2 MB chunk here, torch 51).
    The same IEEE float32 products either way, bit for bit."""
    torch = loaded_torch()
    if torch is None:
        np.multiply(values, scales[..., None], out=out)
    else:
        torch.mul(torch.from_numpy(values), torch.from_numpy(scales).unsqueeze(-1),
                  out=torch.from_numpy(out))


def round_in_place(values: np.ndarray) -> None:
    """Round half to even, as np.rint: torch's where loaded (~30% faster on a 2 MB chunk)."""
    torch = loaded_torch()
    if torch is None:
        np.rint(values, out=values)
    else:
        torch.from_numpy(values).round_()


def cast_into(values: np.ndarray, out: np.ndarray) -> None:
    """`values` cast into `out`'s dtype, in place (C's conversion: exact for integral values):
    torch's where loaded (~30% faster on a 2 MB chunk)."""
    torch = loaded_torch()
    if torch is None:
        np.copyto(out, values, casting="unsafe")
    else:
        torch.from_numpy(out).copy_(torch.from_numpy(values))


def q8_0_quantize(values: np.ndarray) -> np.ndarray:
    """Quantize float rows `[rows, n]` to Q8_0 bytes `[rows, n/32*34]` as ggml does.

    ggml's reference: d = amax / 127, qs = round(x / d); the stored d is fp16 and the division
    uses the unrounded d, exactly what gguf-py's `quantize` does too (checked in the tests).
    """
    rows, n = values.shape
    blocks = values.astype(np.float32, copy=False).reshape(rows, n // Q8_0_BLOCK, Q8_0_BLOCK)
    d = np.abs(blocks).max(axis=-1) / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d == 0, 0.0, 1.0 / d).astype(np.float32)
    out = np.empty((rows, n // Q8_0_BLOCK), dtype=Q8_0_DTYPE)
    out["d"] = d.astype(np.float16)
    out["qs"] = np.round(blocks * inv[..., None]).astype(np.int8)
    return out.view(np.uint8).reshape(rows, -1)


def bf16_to_float32(raw: np.ndarray) -> np.ndarray:
    """bf16 is the top half of an fp32, so widening is a shift."""
    return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
