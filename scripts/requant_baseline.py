"""The build's yardstick: a plain numpy pass that requantizes every matrix of a GGUF file to int8
per output channel, and nothing else.

    python scripts/requant_baseline.py MODEL.gguf

This is the least any build of the file does: read every matrix once, dequantize it, and round
it to int8 with one fp16 scale per row. No cosine, no format choice, no MIL program, no package,
no calibration, nothing written. Q8_0 blocks are widened in numpy (qs * d); any other type goes
through gguf-py's dequantization (`Tensor.rows`), as the build reads it. Single-threaded, 16 MB
of float32 rows at a time, each chunk's file pages given back once read, so its memory is flat.
`scripts/bench_build.py` runs it in a child beside the build and prints build / baseline: the
build's overhead over the work it cannot avoid, measured on the same machine in the same run.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ane_spec.model.gguf_file import open_gguf


def requantize_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows -> (int8 rows, fp16 per-row scales)."""
    amax = np.abs(values).max(axis=1, keepdims=True)
    scale = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16)
    q = np.clip(np.rint(values / scale.astype(np.float32)), -127, 127).astype(np.int8)
    return q, scale


def requantize_file(path: str) -> tuple[int, int]:
    """Requantize every 2-D tensor of `path`; returns (tensors, values) converted."""
    model = open_gguf(path)
    tensors = values = 0
    for t in model.tensors.values():
        if len(t.shape) != 2:
            continue
        rows = t.shape[0]
        step = t.rows_per_chunk()
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            if t.is_q8_0:
                qs, d = t.q8_0()
                x = (qs[r0:r1] * d[r0:r1, :, None].astype(np.float32)).reshape(r1 - r0, -1)
            else:
                x = t.rows(np.arange(r0, r1), np.float32)
            requantize_rows(x)
            t.release(r0, r1)
        tensors += 1
        values += rows * t.shape[1]
    return tensors, values


def main(argv: list[str]) -> int:
    start = time.monotonic()
    tensors, values = requantize_file(argv[0])
    print(f"requantized {tensors} matrices, {values / 1e9:.2f}G values to int8 per channel in "
          f"{time.monotonic() - start:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
