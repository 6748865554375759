"""token_embd rows for host-side lookup, kept in the GGUF's own precision.

Q8_0 tables are stored as int8 `qs` `[V, d]` plus fp16 scales `[V, d/32]` and dequantized per
looked-up row; a float32 copy of Phi-4-mini's table would be 2.4 GB for a lookup of a few rows.

Other block types (Q4_K, Q5_0, Q6_K, IQ*, ...) are requantized to Q8_0 blocks, a chunk of rows at
a time: the host table stays ~1.06 bytes per weight, as small as the Q8_0 build's and half of
fp16's (Phi-4-mini: 650 MB, not 1.2 GB), and Q8_0's error (step/sqrt(12) with 32-value blocks)
is far below the 4-6-bit source's own, so the lookup adds nothing a reader could measure. The
float types (F32, F16, BF16) stay fp16 as before: nothing to gain from blocks there.

With a residual scale 2^k (residual_scale.py) the rows are stored times 2^k: the Q8_0 scales or
the fp16 values are scaled, never the int8 data, so a row is the same bits apart from its
exponent wherever fp16 keeps it normal.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ane_spec.model.gguf_file import Tensor
from ane_spec.model.quant import q8_0_blocks, q8_0_quantize
from ane_spec.shards.direct_file import DirectFile
from ane_spec.shards.residual_scale import FoldCount, scale_fp16
from ane_spec.shards.weights import require_finite

ROWS_PER_CHUNK = 16384


def write_embeddings(t: Tensor, folder: Path, log2_factor: int = 0,
                     fold: FoldCount | None = None) -> tuple[str, dict[str, Path]]:
    """Write the table as .npy files in row chunks, times 2^log2_factor; returns (format,
    role -> path). `fold` counts the values scaled and those fp16 could not scale exactly.
    A value that is not finite (a Q8_0 scale, or a dequantized value) ends it with a BuildError
    naming the row: each chunk is checked as it is read, so the table is dequantized once (a
    scan beforehand read Qwen2.5-Coder's Q5_0 table twice, 1.8 s more).

    The rows are appended past the page cache (direct_file.py), not written through a memory
    map: the same files open_memmap made, without a fresh page per written page, and a full
    disk is an OSError the build reports, not a SIGBUS."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab, dim = t.shape
    fold = fold if fold is not None else FoldCount()

    def scaled(values: np.ndarray) -> np.ndarray:
        if log2_factor == 0:
            return values
        out, n = scale_fp16(values.astype(np.float16), log2_factor, t.name)
        fold.add(n)
        return out
    with contextlib.ExitStack() as files:
        if t.is_q8_0 or not t.is_float:
            qs_path, scales_path = folder / "embed_qs.npy", folder / "embed_scales.npy"
            qs_out = files.enter_context(_npy_file(qs_path, np.int8, (vocab, dim)))
            sc_out = files.enter_context(_npy_file(scales_path, np.float16, (vocab, dim // 32)))
            if t.is_q8_0:
                qs, d = t.q8_0()
                for r0 in range(0, vocab, ROWS_PER_CHUNK):
                    r1 = min(vocab, r0 + ROWS_PER_CHUNK)
                    require_finite(t.name, d[r0:r1], r0, " (Q8_0 scales)")
                    qs_out.append(np.ascontiguousarray(qs[r0:r1]))
                    sc_out.append(np.ascontiguousarray(scaled(d[r0:r1]), np.float16))
                    t.release(r0, r1)
            else:
                for r0, rows in t.row_chunks(t.rows_per_chunk()):
                    require_finite(t.name, rows, r0)
                    blocks = q8_0_blocks(q8_0_quantize(rows), dim)
                    qs_out.append(np.ascontiguousarray(blocks["qs"]))
                    sc_out.append(np.ascontiguousarray(scaled(blocks["d"]), np.float16))
            return "q8_0", {"qs": qs_path, "scales": scales_path}
        path = folder / "embed_f16.npy"
        out = files.enter_context(_npy_file(path, np.float16, (vocab, dim)))
        for r0, rows in t.row_chunks(ROWS_PER_CHUNK):
            require_finite(t.name, rows, r0)
            out.append(np.ascontiguousarray(scaled(rows.astype(np.float16)), np.float16))
        return "fp16", {"table": path}


@contextlib.contextmanager
def _npy_file(path: Path, dtype: type, shape: tuple[int, int]) -> Iterator[DirectFile]:
    """A .npy file of `shape` whose rows the caller appends in order: the header open_memmap
    writes (format 1.0), then the data; finished only if every byte of it came."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
        "shape": shape})
    out = DirectFile(path)
    try:
        out.append(header.getvalue())
        yield out
        expected = len(header.getvalue()) + int(np.prod(shape)) * np.dtype(dtype).itemsize
        if out.size != expected:
            raise AssertionError(f"{path.name}: {out.size} bytes written, {expected} expected")
        out.close()
    finally:
        out.discard()
