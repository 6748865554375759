"""token_embd rows for host-side lookup, kept in the GGUF's own precision.

Q8_0 tables are stored as int8 `qs` `[V, d]` plus fp16 scales `[V, d/32]` and dequantized per
looked-up row; a float32 copy of Phi-4-mini's table would be 2.4 GB for a lookup of a few rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ane_spec.model.gguf_file import Tensor

ROWS_PER_CHUNK = 16384


def write_embeddings(t: Tensor, folder: Path) -> tuple[str, dict[str, Path]]:
    """Write the table as .npy files in row chunks; returns (format, role -> path)."""
    folder.mkdir(parents=True, exist_ok=True)
    vocab, dim = t.shape
    if t.is_q8_0:
        qs_path, scales_path = folder / "embed_qs.npy", folder / "embed_scales.npy"
        qs_out = np.lib.format.open_memmap(qs_path, "w+", np.int8, (vocab, dim))
        sc_out = np.lib.format.open_memmap(scales_path, "w+", np.float16, (vocab, dim // 32))
        qs, d = t.q8_0()
        for r0 in range(0, vocab, ROWS_PER_CHUNK):
            r1 = min(vocab, r0 + ROWS_PER_CHUNK)
            qs_out[r0:r1] = qs[r0:r1].reshape(r1 - r0, dim)
            sc_out[r0:r1] = d[r0:r1]
            t.release(r0, r1)
        qs_out.flush()
        sc_out.flush()
        del qs_out, sc_out
        return "q8_0", {"qs": qs_path, "scales": scales_path}
    path = folder / "embed_f16.npy"
    out = np.lib.format.open_memmap(path, "w+", np.float16, (vocab, dim))
    for r0, rows in t.row_chunks(ROWS_PER_CHUNK):
        out[r0:r0 + rows.shape[0]] = rows.astype(np.float16)
    out.flush()
    del out
    return "fp16", {"table": path}
