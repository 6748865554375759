"""GGUF matrices -> conv weights `[out, in, 1, 1]` in one of three formats.

- `int8-channel` (default): requantize each row to symmetric int8 with one fp16 scale per output
  channel, the format ane-book ran fully on the ANE. Requantizing loses a little against Q8_0;
  the cosine against the Q8_0 dequantization is measured per tensor and gated.
- `q8-block`: the GGUF's own Q8_0 blocks as `constexpr_blockwise_shift_scale` with one fp16 scale
  per 32 inputs. Bit-identical to the file, but per-block scales are reported to leave the ANE.
- `fp16`: plain half-precision constants.

Every value is checked to be finite on the way in (the GGUF's Q8_0 scales or float values) and
on the way out (fp16 weights and scales, which overflow past 65504): a NaN would otherwise pass
the cosine gate (`cos < min` is False for NaN) and poison every logit of the build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from ane_spec.errors import BuildError, untrusted
from ane_spec.model.gguf_file import Tensor
from ane_spec.model.quant import q8_0_quantize, q8_0_blocks

WeightFormat = Literal["int8-channel", "q8-block", "fp16"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("int8-channel", "q8-block", "fp16")

# Worst per-tensor cosine allowed between requantized int8-channel weights and the Q8_0 values.
# Per-row int8 noise is step/sqrt(12) with step = max|w_row|/127: for Gaussian rows (max ~4 sigma)
# that is cosine ~0.99996; 0.999 admits rows whose largest weight is ~20 sigma (real outlier
# channels) and rejects anything worse, where a 4.5% relative error per matrix would compound
# over 32 layers.
DEFAULT_MIN_WEIGHT_COSINE = 0.999


@dataclass
class ConvWeight:
    """Arrays ready for the MIL builder, plus how faithful they are to the GGUF values."""

    format: WeightFormat
    shape: tuple[int, int]          # (out, in)
    data: np.ndarray                # int8 [out, in, 1, 1] or fp16 [out, in, 1, 1]
    scale: np.ndarray | None        # fp16 [out, 1, 1, 1] or [out, in/32, 1, 1]
    cosine: float                   # against the GGUF's float values (1.0 when exact)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)


def estimate_bytes(out: int, inp: int, fmt: WeightFormat) -> int:
    """Stored size of one matrix, for shard budgets before anything is built."""
    if fmt == "fp16":
        return 2 * out * inp
    if fmt == "q8-block":
        return out * inp + 2 * out * (inp // 32)
    return out * inp + 2 * out


def require_finite(name: str, values: np.ndarray, first_row: int = 0, what: str = "") -> None:
    """BuildError naming the tensor and the first bad row unless every value is finite."""
    finite = np.isfinite(values)
    if not finite.all():
        bad = np.argwhere(~finite)[0]
        row = first_row + (int(bad[0]) if values.ndim > 1 else 0)
        raise BuildError(f"tensor {untrusted(name)}{what} holds NaN or infinite values (first "
                         f"at row {row}); the GGUF file is corrupt")


def check_tensor_finite(t: Tensor) -> None:
    """Scan a whole tensor (for those no conversion reads): Q8_0 scales, or float values."""
    step = max(1, (1 << 24) // max(1, t.shape[-1]))
    if t.is_q8_0:
        _, d = t.q8_0()
        for r0 in range(0, d.shape[0], step):
            require_finite(t.name, d[r0:r0 + step], r0, " (Q8_0 scales)")
        return
    if len(t.shape) == 1:
        require_finite(t.name, t.dequantize())
        return
    for r0, rows in t.row_chunks(step):
        require_finite(t.name, rows, r0)


def convert_matrix(t: Tensor, fmt: WeightFormat, rows: slice | None = None) -> ConvWeight:
    """Convert a GGUF matrix (optionally a row range of it, for LM head chunks)."""
    rows = rows or slice(0, t.shape[0])
    if fmt == "q8-block":
        qs, d = _q8_0_rows(t, rows)
        require_finite(t.name, d, rows.start, " (Q8_0 scales)")
        out, nb = d.shape
        data = np.ascontiguousarray(qs.reshape(out, nb * 32))[:, :, None, None]
        return ConvWeight(fmt, (out, nb * 32), data, np.ascontiguousarray(d)[:, :, None, None], 1.0)

    out, inp = rows.stop - rows.start, t.shape[1]
    data = np.empty((out, inp, 1, 1), np.int8 if fmt == "int8-channel" else np.float16)
    scale = np.empty((out, 1, 1, 1), np.float16) if fmt == "int8-channel" else None
    agreement = _CosineAccumulator()
    # Row chunks keep the float32 working set ~64 MB even for the 200064-row LM head.
    step = max(1, (1 << 24) // inp)
    for r0 in range(0, out, step):
        r1 = min(out, r0 + step)
        if fmt == "int8-channel" and t.is_q8_0:
            q, s16 = _requantize_q8_0_rows(t, rows.start + r0, rows.start + r1, agreement)
        else:
            q, s16 = _convert_float_rows(t, rows.start + r0, rows.start + r1, fmt, agreement)
        data[r0:r1, :, 0, 0] = q
        if scale is not None:
            scale[r0:r1, :, 0, 0] = s16
    return ConvWeight(fmt, (out, inp), data, scale, agreement.cosine())


def _requantize_q8_0_rows(t: Tensor, r0: int, r1: int, agreement: "_CosineAccumulator"
                          ) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> per-row int8, straight from the blocks: value = qs * d, so the row's max is
    the max over blocks of max|qs| * |d|, and q = rint(qs * d / s_row)."""
    qs, d = t.q8_0()
    qs, d32 = qs[r0:r1], d[r0:r1].astype(np.float32)
    require_finite(t.name, d32, r0, " (Q8_0 scales)")
    amax = (np.abs(qs).max(axis=2) * np.abs(d32)).max(axis=1, keepdims=True)
    with np.errstate(over="ignore"):
        s16 = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16)
    require_finite(t.name, s16, r0, " (int8 scales beyond the fp16 range)")
    s32 = s16.astype(np.float32)
    # Quantize against the fp16 scale actually stored, so the rounding matches what runs.
    qf = qs * (d32 / s32)[..., None]
    np.rint(qf, out=qf)
    np.clip(qf, -127, 127, out=qf)
    q = qf.astype(np.int8).reshape(r1 - r0, -1)
    original = (qs * d32[..., None]).reshape(r1 - r0, -1)   # exact: 8 x 11 bits < 24
    stored = q.astype(np.float32)
    stored *= s32
    agreement.add(original, stored)
    return q, s16


def _convert_float_rows(t: Tensor, r0: int, r1: int, fmt: WeightFormat,
                        agreement: "_CosineAccumulator") -> tuple[np.ndarray, np.ndarray | None]:
    values = t.rows(np.arange(r0, r1), np.float32)
    require_finite(t.name, values, r0)
    if fmt == "fp16":
        stored = values.astype(np.float16)
        require_finite(t.name, stored, r0, " (beyond the fp16 range, 65504)")
        agreement.add(values, stored.astype(np.float32))
        return stored, None
    amax = np.abs(values).max(axis=1, keepdims=True)
    with np.errstate(over="ignore"):
        s16 = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16)
    require_finite(t.name, s16, r0, " (int8 scales beyond the fp16 range)")
    s32 = s16.astype(np.float32)
    q = np.clip(np.rint(values / s32), -127, 127).astype(np.int8)
    agreement.add(values, q * s32)
    return q, s16


class _CosineAccumulator:
    """cos(a, b) over many row chunks. Rows are summed pairwise in float32 and the row sums
    accumulated in float64: 1 - cos is ~1e-5, which plain float32 accumulation would blur."""

    def __init__(self) -> None:
        self.ab = self.aa = self.bb = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        # einsum row dots make no temporaries: the cosine costs less than the quantization.
        for attr, x, y in (("ab", a, b), ("aa", a, a), ("bb", b, b)):
            rows = np.einsum("ij,ij->i", x, y)
            setattr(self, attr, getattr(self, attr) + float(np.sum(rows, dtype=np.float64)))

    def cosine(self) -> float:
        denom = np.sqrt(self.aa * self.bb)
        return 1.0 if denom == 0 else self.ab / float(denom)


def _q8_0_rows(t: Tensor, rows: slice) -> tuple[np.ndarray, np.ndarray]:
    if t.is_q8_0:
        qs, d = t.q8_0()
        return qs[rows], d[rows]
    # A float GGUF has no blocks to keep: make them the way llama.cpp's quantizer would.
    raw = q8_0_quantize(t.rows(np.arange(rows.start, rows.stop), np.float32))
    blocks = q8_0_blocks(raw, t.shape[1])
    return blocks["qs"], blocks["d"]
