"""GGUF matrices -> conv weights `[out, in, 1, 1]`, in a format chosen per tensor or requested.

- `auto` (default): per tensor, the first of these whose cosine against the file's own
  (dequantized) values reaches `--min-weight-cosine`:
  1. `int8-channel`: symmetric int8 with one fp16 scale per output channel, the format ane-book
     ran fully on the ANE (`constexpr_blockwise_shift_scale` with a per-row scale).
  2. `lut8`: 8-bit palettization per group of output rows (`constexpr_lut_to_dense`, iOS18), a
     256-entry fp16 table per group, as Anemll ships on the ANE. Its entries are fitted to the
     group's values (quantile start, a few 1-D k-means steps), so an outlier input column gets
     table entries of its own instead of stretching one step over the whole row: real weights
     (outlier columns are normal) that int8 per channel rounds to cosine 0.998 keep 0.9999+.
     Same size as int8 (1 byte a weight) plus 512 bytes per group.
  3. `fp16`: plain half-precision constants, twice the size, the last resort.
  A stacked matrix (q|k|v, gate|up: one conv) takes one format, the one its worst part needs;
  each tensor's own cosine and the reason are recorded.
- `int8-channel`: as in auto's first step, for every tensor; a tensor below the cosine floor is
  refused, naming it.
- `q8-block`: the GGUF's own Q8_0 blocks as `constexpr_blockwise_shift_scale` with one fp16 scale
  per 32 inputs. Bit-identical to a Q8_0 file, but per-block scales give wrong results on the
  ANE (apple/coreai-models#279); kept for comparisons, never chosen by auto.
- `fp16`: plain half-precision constants.

Every value is checked to be finite on the way in (the GGUF's Q8_0 scales or float values) and
on the way out (fp16 weights and scales, which overflow past 65504): a NaN would otherwise pass
the cosine gate (`cos < min` is False for NaN) and poison every logit of the build. Every source
type is read a chunk of rows at a time (`Tensor.rows`), so no tensor is ever float32 whole.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from ane_spec.errors import BuildError, untrusted
from ane_spec.model.gguf_file import Tensor
from ane_spec.model.quant import (
    cast_into,
    loaded_torch,
    q8_0_blocks,
    q8_0_quantize,
    round_in_place,
    times_block_scales,
)
from ane_spec.shards import weight_memory

# Threads that requantize a Q8_0 matrix's row chunks at once: each holds a few chunk-sized
# float32 temporaries (~16 MB each), and past a few the memory bus, not the cores, bounds them.
REQUANT_THREADS = max(1, min(4, os.cpu_count() or 1))
# Cores that work beside the conversion holds (`core_taken`): the requantization leaves them.
_cores_taken = 0
_cores_lock = threading.Lock()
# Values per row chunk of a Q8_0 requantization (2 MB of float32): its five passes over the
# chunk then stay in the core's caches instead of streaming 16 MB to memory and back five
# times. Real-size Phi-4-mini layers here: 0.21 s a layer at 16 MB chunks, 0.15-0.18 s at 2 MB
# (two threads, best of 7; `rows_per_chunk`'s 16 MB stays the bound for everything else).
REQUANT_CHUNK_ELEMENTS = 1 << 19
# A row scale below this is subnormal in fp16, and rounding to it can push |q| past 127.
_FP16_SMALLEST_NORMAL = np.float16(2.0 ** -14)

# What a build may request, and what a tensor may get.
WeightFormat = Literal["auto", "int8-channel", "q8-block", "fp16"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("auto", "int8-channel", "q8-block", "fp16")
StoredFormat = Literal["int8-channel", "lut8", "q8-block", "fp16"]
STORED_FORMATS: tuple[StoredFormat, ...] = ("int8-channel", "lut8", "q8-block", "fp16")
# auto's ladder, cheapest first; all are one conv weight, so the graph is the same whatever wins.
AUTO_LADDER: tuple[StoredFormat, ...] = ("int8-channel", "lut8", "fp16")

LUT_ENTRIES = 256
LUT_BYTES = 2 * LUT_ENTRIES
# Weights per LUT: with 16k weights a 512-byte table adds ~3% to the int8 size, and a group is a
# few output rows (16 at d=1024, 4 at 3072, 1 above 16k inputs), so rows of very different
# magnitudes seldom share a table.
LUT_GROUP_WEIGHTS = 1 << 14
# 1-D k-means (Lloyd) steps after the start table: on Gaussian rows with and without outlier
# columns they take 1 - cos from ~3.0e-5 to ~2.5e-5; more steps change the next digit only.
LUT_KMEANS_STEPS = 2

# Worst per-tensor cosine allowed between requantized int8-channel weights and the Q8_0 values.
# Per-row int8 noise is step/sqrt(12) with step = max|w_row|/127: for Gaussian rows (max ~4 sigma)
# that is cosine ~0.99996; 0.999 admits rows whose largest weight is ~20 sigma (real outlier
# channels) and rejects anything worse, where a 4.5% relative error per matrix would compound
# over 32 layers.
DEFAULT_MIN_WEIGHT_COSINE = 0.999


@dataclass
class TensorChoice:
    """What one GGUF tensor got, and why (the manifest records it)."""

    name: str
    format: StoredFormat
    cosine: float        # of the stored values against the file's own
    reason: str


@dataclass
class ConvWeight:
    """Arrays ready for the MIL builder, plus how faithful they are to the GGUF values."""

    format: StoredFormat
    shape: tuple[int, int]          # (out, in)
    data: np.ndarray                # int8 / uint8 LUT indices / fp16, [out, in, 1, 1]
    scale: np.ndarray | None        # fp16 [out, 1, 1, 1] or [out, in/32, 1, 1]
    cosine: float                   # against the GGUF's float values (1.0 when exact)
    lut: np.ndarray | None = None   # lut8: fp16 [out/group, 1, 1, 1, 256, 1]
    choices: list[TensorChoice] = field(default_factory=list)
    part_cosines: list[float] = field(default_factory=list)  # per stacked part

    @property
    def nbytes(self) -> int:
        return (self.data.nbytes + (0 if self.scale is None else self.scale.nbytes)
                + (0 if self.lut is None else self.lut.nbytes))


def lut_group(rows: list[int] | int, inp: int) -> int:
    """Output rows per LUT: a power of two near LUT_GROUP_WEIGHTS / inp that divides every part
    of a stacked matrix (their tables are stacked too)."""
    parts = [rows] if isinstance(rows, int) else rows
    g = 1
    while g * 2 * inp <= LUT_GROUP_WEIGHTS and all(r % (g * 2) == 0 for r in parts):
        g *= 2
    return g


def estimate_bytes(out: int, inp: int, fmt: WeightFormat | StoredFormat) -> int:
    """Stored size of one matrix, for shard budgets before anything is built. `auto` is costed
    as int8 per channel, the form real tensors get (all 386 matrices of the two catalog files):
    costing it at lut8's size (+3%) split Qwen 3 4B into 17,17,2 shards instead of 18,18, one
    more ANE round trip per pass for a fallback that had not happened. A shard that fallbacks
    (lut8 +3% per tensor, fp16 x2) take over --max-shard-mb is refused by the build's check of
    its real size, naming --topology; the budget is itself ~10% under the largest shard
    measured resident."""
    if fmt == "fp16":
        return 2 * out * inp
    if fmt == "q8-block":
        return out * inp + 2 * out * (inp // 32)
    if fmt == "lut8":
        return out * inp + LUT_BYTES * (out // lut_group(out, inp))
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
    if not (t.is_q8_0 or t.is_float):
        step = t.rows_per_chunk()  # gguf-py holds a chunk's output twice while it works
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


@dataclass(frozen=True)
class Part:
    """Rows of a GGUF matrix that become (part of) one conv weight. `index` lists the source
    rows in output order (a head chunk's range, RoPE's q/k reordering); None is all rows."""

    tensor: Tensor
    index: np.ndarray | None = None
    label: str | None = None   # the name the manifest records; the tensor's own by default

    @property
    def name(self) -> str:
        return self.label or self.tensor.name

    @property
    def rows(self) -> int:
        return self.tensor.shape[0] if self.index is None else len(self.index)


def convert_parts(parts: list[Part], fmt: WeightFormat, min_cosine: float) -> ConvWeight:
    """Convert and row-stack `parts` into one conv weight, choosing the format under `auto`
    (see the module docstring); each part's choice is in the result's `choices`."""
    if fmt != "auto":
        w = stack([convert_matrix(p.tensor, fmt, index=p.index) for p in parts])
        w.choices = [TensorChoice(p.name, fmt, c, f"{fmt} requested, cos {c:.6f}")
                     for p, c in zip(parts, w.part_cosines)]
        return w
    tried: dict[str, list[float]] = {}
    group = lut_group([p.rows for p in parts], parts[0].tensor.shape[1])
    for stored in AUTO_LADDER:
        w = stack([convert_matrix(p.tensor, stored, index=p.index, group=group) for p in parts])
        if min(w.part_cosines) >= min_cosine or stored == AUTO_LADDER[-1]:
            w.choices = [TensorChoice(p.name, stored, c, _reason(stored, i, parts, tried,
                                                                 c, min_cosine))
                         for i, (p, c) in enumerate(zip(parts, w.part_cosines))]
            return w
        tried[stored] = w.part_cosines
        del w
    raise AssertionError("unreachable: the ladder ends in fp16")


def _reason(stored: StoredFormat, i: int, parts: list[Part], tried: dict[str, list[float]],
            cos: float, floor: float) -> str:
    if not tried:
        return f"{stored} cos {cos:.6f} ≥ {floor}"
    failed = []
    for fmt, cosines in tried.items():
        if cosines[i] < floor:
            failed.append(f"{fmt} cos {cosines[i]:.6f} < {floor}")
        else:  # this part was fine; a part stacked with it was not
            worst = min(range(len(parts)), key=lambda j: cosines[j])
            failed.append(f"{fmt} cos {cosines[i]:.6f}, but {parts[worst].name} in the same "
                          f"stacked conv reached {cosines[worst]:.6f} < {floor}")
    return f"{stored}: " + "; ".join(failed)


def convert_matrix(t: Tensor, fmt: StoredFormat, rows: slice | None = None,
                   index: np.ndarray | None = None, group: int | None = None) -> ConvWeight:
    """Convert a GGUF matrix, or the rows of it that `rows` (a range, for LM head chunks) or
    `index` (any rows, in output order) select. `group`: rows per LUT for lut8."""
    if index is None:
        rows = rows or slice(0, t.shape[0])
        index = np.arange(rows.start, rows.stop)
    index = np.asarray(index, dtype=np.int64)
    if fmt == "q8-block":
        qs, d = _q8_0_rows(t, index)
        require_finite(t.name, d, int(index[0]) if len(index) else 0, " (Q8_0 scales)")
        out, nb = d.shape
        data = np.ascontiguousarray(qs.reshape(out, nb * 32))[:, :, None, None]
        return ConvWeight(fmt, (out, nb * 32), data, np.ascontiguousarray(d)[:, :, None, None],
                          1.0)

    out, inp = len(index), t.shape[1]
    dtype = {"int8-channel": np.int8, "lut8": np.uint8, "fp16": np.float16}[fmt]
    data = weight_memory.empty((out, inp, 1, 1), dtype)   # reused between a build's packages
    scale = np.empty((out, 1, 1, 1), np.float16) if fmt == "int8-channel" else None
    lut = None
    if fmt == "lut8":
        group = group or lut_group(out, inp)
        if out % group:
            raise ValueError(f"lut8 group {group} does not divide {out} rows")
        lut = np.empty((out // group, 1, 1, 1, LUT_ENTRIES, 1), np.float16)
    agreement = _CosineAccumulator()
    # Row chunks keep the float32 working set ~16 MB (and gguf-py's temporaries a few times
    # that) even for a 200064-row LM head; lut8 chunks hold whole groups.
    step = t.rows_per_chunk()
    if fmt == "lut8":
        step = max(group, step // group * group)
    if fmt == "int8-channel" and t.is_q8_0:
        _requantize_q8_0_parallel(t, index, t.rows_per_chunk(REQUANT_CHUNK_ELEMENTS),
                                  data[:, :, 0, 0], scale[:, :, 0, 0], agreement)
        return ConvWeight(fmt, (out, inp), data, scale, agreement.cosine(), lut)
    starts = range(0, out, step)
    values_of = (_read_ahead(t, [index[r0:r0 + step] for r0 in starts])
                 if not (t.is_q8_0 or t.is_float) else None)
    for r0 in starts:
        r1 = min(out, r0 + step)
        idx = index[r0:r1]
        values = None if values_of is None else next(values_of)
        if fmt == "lut8":
            q, s16 = _lut_rows(t, idx, group, agreement, values)
            lut[r0 // group:r1 // group, 0, 0, 0, :, 0] = s16
            s16 = None
        else:
            q, s16 = _convert_float_rows(t, idx, fmt, agreement, values)
        data[r0:r1, :, 0, 0] = q
        if scale is not None:
            scale[r0:r1, :, 0, 0] = s16
    return ConvWeight(fmt, (out, inp), data, scale, agreement.cosine(), lut)


def _requantize_q8_0_parallel(t: Tensor, index: np.ndarray, step: int, data: np.ndarray,
                              scale: np.ndarray, agreement: "_CosineAccumulator") -> None:
    """Every row chunk of a Q8_0 matrix requantized into `data`/`scale`, REQUANT_THREADS chunks
    at a time: the chunks are independent and numpy releases the GIL in each step, so a second
    core does half the build's innermost work (issue 33: 2x on Phi-4-mini's ffn_up here). Each
    chunk's cosine sums are added in chunk order, so the result is the serial one, bit for bit."""
    starts = range(0, len(index), step)
    sums = [_CosineAccumulator() for _ in starts]

    def chunk(n: int) -> None:
        r0 = starts[n]
        r1 = min(len(index), r0 + step)
        with _one_torch_thread():
            _, scale[r0:r1] = _requantize_q8_0_rows(t, index[r0:r1], sums[n], out=data[r0:r1])

    threads = requant_threads()
    if len(starts) == 1 or threads == 1:
        for n in range(len(starts)):
            chunk(n)
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="requantize") as pool:
            list(pool.map(chunk, range(len(starts))))   # re-raises a chunk's error here
    for part in sums:
        agreement.merge(part)


def requant_threads() -> int:
    """REQUANT_THREADS, less the cores work beside the conversion holds (at least one)."""
    with _cores_lock:
        spare = (os.cpu_count() or 1) - _cores_taken
    return max(1, min(REQUANT_THREADS, spare))


@contextlib.contextmanager
def core_taken() -> Iterator[None]:
    """Work that keeps a core busy beside the conversion (the residual scale's calibration, in
    its child process: scale_aside.py) holds it for the block: the requantization then runs
    on the cores left.
    Three compute threads on two cores took turns on each core's cache: a Phi-4-mini build's
    requantization and calibration together cost ~2 CPU s more than with one requantization
    thread beside the calibration (seven alternating pairs, median 35.7 against 33.5 CPU s)."""
    global _cores_taken
    with _cores_lock:
        _cores_taken += 1
    try:
        yield
    finally:
        with _cores_lock:
            _cores_taken -= 1


@contextlib.contextmanager
def _one_torch_thread() -> Iterator[None]:
    """torch's ops on one thread in this one: the chunks are the parallelism, and an OpenMP
    team per op beside them would only wait at its barriers. Set per thread (OpenMP's nthreads
    ICV) and put back, so other threads keep their count; left alone where it is already 1."""
    torch = loaded_torch()
    threads = 1 if torch is None else torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _read_ahead(t: Tensor, chunks: list[np.ndarray]) -> Iterator[np.ndarray]:
    """Each chunk's float rows, the next chunk dequantized by a helper thread while the caller
    converts this one. gguf-py's dequantization is numpy work that releases the GIL, and it is
    what a K-quant or IQ source costs beyond a Q8_0 one: overlapped, a second core hides most of
    it. One chunk ahead: ~16 MB more memory."""
    with ThreadPoolExecutor(1, thread_name_prefix="dequantize") as pool:
        pending = pool.submit(t.rows, chunks[0], np.float32) if chunks else None
        for n in range(len(chunks)):
            values = pending.result()
            if n + 1 < len(chunks):
                pending = pool.submit(t.rows, chunks[n + 1], np.float32)
            yield values


def stack(parts: list[ConvWeight]) -> ConvWeight:
    """Row-stack conv weights of one format; `cosine` is the worst part's, `part_cosines` each
    part's (recorded under its tensor name)."""
    first = parts[0]
    if len(parts) == 1:
        first.part_cosines = [first.cosine]
        return first
    data = np.concatenate([p.data for p in parts])
    scale = None if first.scale is None else np.concatenate([p.scale for p in parts])
    lut = None if first.lut is None else np.concatenate([p.lut for p in parts])
    w = ConvWeight(first.format, (data.shape[0], first.shape[1]), data, scale,
                   min(p.cosine for p in parts), lut)
    w.part_cosines = [p.cosine for p in parts]
    return w


def _requantize_q8_0_rows(t: Tensor, idx: np.ndarray, agreement: "_CosineAccumulator",
                          out: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows -> per-row int8, straight from the blocks: value = qs * d, and
    q = rint(qs * d / s_row).

    The cosine needs no stored copy: the stored row is q * s, so its dots with the original x
    are s * (x . q) and s^2 * (q . q), scaled per row after float32 row dots. Reductions run along
    whole rows (a max over each 32-wide block is several times slower in numpy), a run of
    rows is sliced, not gathered, and the int8 rows are cast straight into `out` (the caller's
    weight array) when given: this is the build's innermost loop (issue 33)."""
    qs, d = t.q8_0()
    n = len(idx)
    if n and bool(np.all(np.diff(idx) == 1)):
        rows = slice(int(idx[0]), int(idx[0]) + n)
        qs, d = qs[rows], d[rows]
    else:
        qs, d = qs[idx], d[idx]
    d32 = d.astype(np.float32)
    require_finite(t.name, d32, int(idx[0]), " (Q8_0 scales)")
    # The chunk's two float32 temporaries come from the build's scratch pool (weight_memory.py:
    # fresh pages cost a host fault each on the VMs this is built on). The int8 values are cast
    # once, and both products taken from the cast: numpy's int8 * float32 casts inside each
    # multiply, and the cast was most of it (the same values, bit for bit; a third less time
    # for the two). Exact: 8 x 11 bits < 24.
    # The per-block products, the rounding and the cast to int8 are torch's where it is
    # loaded (`quant.times_block_scales`, `round_in_place`, `cast_into`): numpy's
    # broadcast multiply is ~2x slower on these shapes, its rounding and cast ~30%. The same
    # IEEE float32 products, rounding half to even (np.rint's) and exact casts: the same bits
    # either way (tests/test_weights.py).
    qf = weight_memory.scratch(qs.shape, np.float32)
    np.copyto(qf, qs, casting="unsafe")
    original = weight_memory.scratch(qs.shape, np.float32)
    times_block_scales(qf, d32, original)
    original = original.reshape(n, -1)
    amax = np.maximum(original.max(axis=1), -original.min(axis=1))[:, None]
    with np.errstate(over="ignore"):
        s16 = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16)
    require_finite(t.name, s16, int(idx[0]), " (int8 scales beyond the fp16 range)")
    s32 = s16.astype(np.float32)
    # Quantize against the fp16 scale actually stored, so the rounding matches what runs.
    times_block_scales(qf, d32 / s32, qf)
    round_in_place(qf)
    # s is amax / 127 rounded to fp16 (relative error <= 2^-11 while it is normal), so
    # |qs * d / s| <= 127 / (1 - 2^-11) + float32's rounding < 127.5: the rounded values
    # already lie in [-127, 127]. A subnormal scale has no such bound.
    if not bool((s16 >= _FP16_SMALLEST_NORMAL).all()):
        np.clip(qf, -127, 127, out=qf)
    qf = qf.reshape(n, -1)
    if out is None:
        q = qf.astype(np.int8)
    else:
        q = out
        cast_into(qf, q)   # integral values in [-127, 127]: exact
    agreement.add_scaled(original, qf, s32[:, 0])
    return q, s16


def _convert_float_rows(t: Tensor, idx: np.ndarray, fmt: StoredFormat,
                        agreement: "_CosineAccumulator", values: np.ndarray | None = None
                        ) -> tuple[np.ndarray, np.ndarray | None]:
    values = t.rows(idx, np.float32) if values is None else values
    require_finite(t.name, values, int(idx[0]))
    if fmt == "fp16":
        stored = values.astype(np.float16)
        require_finite(t.name, stored, int(idx[0]), " (beyond the fp16 range, 65504)")
        agreement.add(values, stored.astype(np.float32))
        return stored, None
    # max|x| per row without an |x| copy, and the rounding in place: a chunk's only full-size
    # temporaries are the scaled values and the stored ones (the cosine needs both).
    amax = np.maximum(values.max(axis=1), -values.min(axis=1))[:, None]
    with np.errstate(over="ignore"):
        s16 = np.where(amax == 0, 1.0, amax / 127.0).astype(np.float16)
    require_finite(t.name, s16, int(idx[0]), " (int8 scales beyond the fp16 range)")
    s32 = s16.astype(np.float32)
    scaled = values / s32
    np.rint(scaled, out=scaled)
    np.clip(scaled, -127, 127, out=scaled)
    q = scaled.astype(np.int8)
    np.multiply(scaled, s32, out=scaled)   # the stored values, exactly: |q| <= 127, fp16 scale
    agreement.add(values, scaled)
    return q, s16


def _lut_rows(t: Tensor, idx: np.ndarray, group: int, agreement: "_CosineAccumulator",
              values: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows (whole groups of them) -> uint8 indices `[rows, in]` and fp16 tables
    `[rows / group, 256]`."""
    values = t.rows(idx, np.float32) if values is None else values
    require_finite(t.name, values, int(idx[0]))
    n, inp = values.shape
    grouped = values.reshape(n // group, group * inp)
    indices, lut = fit_lut(grouped)
    require_finite(t.name, lut, int(idx[0]), " (LUT entries beyond the fp16 range, 65504)")
    stored = np.take_along_axis(lut.astype(np.float32), indices.astype(np.intp), axis=1)
    agreement.add(grouped, stored)
    return indices.reshape(n, inp), lut


_HIST_BINS = 4096


# Entries reserved for each group's largest-magnitude values, exactly: a few outliers carry much
# of a row's energy, and Lloyd steps cannot move entries across the empty range between the bulk
# and them. As many as the group has values beyond LUT_OUTLIER_SIGMAS robust sigmas (a Gaussian
# has none there), at least LUT_RESERVED_MIN (its extreme tail), at most half the table.
LUT_RESERVED_MIN = 16
LUT_RESERVED_MAX = LUT_ENTRIES // 2
LUT_OUTLIER_SIGMAS = 6.0


def _start_table(values: np.ndarray, reserved: int) -> np.ndarray:
    """Initial entries per row, `[groups, 256]`: the `reserved` largest |values| themselves, and
    the rest at the quantiles of the other values' (histogram density)^(1/3), where
    high-resolution quantization theory puts the optimal entries for a smooth density."""
    groups, n = values.shape
    reserved = min(reserved, n)
    mag = np.abs(values)
    top = np.argpartition(mag, n - reserved, axis=1)[:, n - reserved:]
    exact = np.take_along_axis(values, top, axis=1).astype(np.float64)
    cut = np.take_along_axis(mag, top, axis=1).min(axis=1, keepdims=True)
    rest = mag < cut
    lo = np.where(rest, values, np.inf).min(axis=1)
    hi = np.where(rest, values, -np.inf).max(axis=1)
    empty = ~np.isfinite(lo)
    lo, hi = np.where(empty, 0.0, lo), np.where(empty, 0.0, hi)
    width = np.where(hi > lo, hi - lo, 1.0)
    bins = ((values - lo[:, None]) / width[:, None] * _HIST_BINS).astype(np.int64)
    np.clip(bins, 0, _HIST_BINS - 1, out=bins)
    bins += (np.arange(groups) * (_HIST_BINS + 1))[:, None]
    bins[~rest] = groups * (_HIST_BINS + 1)  # one spare bin that nothing reads
    hist = np.bincount(bins.ravel(), minlength=groups * (_HIST_BINS + 1) + 1)[:-1]
    density = np.cbrt(hist.reshape(groups, _HIST_BINS + 1)[:, :_HIST_BINS].astype(np.float64))
    cdf = np.cumsum(density, axis=1)
    cdf /= np.maximum(cdf[:, -1:], 1e-300)
    free = LUT_ENTRIES - reserved
    targets = (np.arange(free) + 0.5) / free
    centres = np.empty((groups, LUT_ENTRIES), np.float64)
    centres[:, free:] = exact
    edges = np.arange(_HIST_BINS) + 0.5
    for g in range(groups):
        centres[g, :free] = lo[g] + np.interp(targets, cdf[g], edges) / _HIST_BINS * width[g]
    centres.sort(axis=1)
    return centres


def fit_lut(values: np.ndarray, steps: int = LUT_KMEANS_STEPS) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `values` `[groups, n]`: a 256-entry fp16 table and each value's nearest entry.

    The table starts with the group's largest-magnitude values as entries of their own (outliers
    carry much of a row's energy, so the cosine needs them exact; quantiles would leave them one
    entry between many) and the rest where high-resolution quantization theory puts optimal
    entries, at a density proportional to the values' density to the power 1/3; it then takes
    `steps` 1-D k-means (Lloyd) steps, each O(n) on the sorted values: cluster boundaries are
    the midpoints between entries, found by binary search, and each entry moves to its cluster's
    mean (prefix sums). The final assignment uses the fp16-rounded entries, which are what runs.
    """
    groups, n = values.shape
    srt = np.sort(values, axis=1)
    # Robust sigma from the sorted values' 16th-84th percentiles, blind to the outliers.
    sigma = (srt[:, int(0.8413 * (n - 1))] - srt[:, int(0.1587 * (n - 1))]) / 2
    far = (np.abs(values) > LUT_OUTLIER_SIGMAS * sigma[:, None]).sum(axis=1)
    reserved = int(np.clip(far.max(initial=0), LUT_RESERVED_MIN, LUT_RESERVED_MAX))
    centres = _start_table(values, reserved)
    if steps:
        sums = np.zeros((groups, n + 1), np.float64)
        np.cumsum(srt, axis=1, dtype=np.float64, out=sums[:, 1:])
        pos = np.empty((groups, LUT_ENTRIES + 1), np.int64)
        pos[:, 0], pos[:, -1] = 0, n
        for _ in range(steps):
            bounds = (centres[:, 1:] + centres[:, :-1]) / 2
            for g in range(groups):
                pos[g, 1:-1] = np.searchsorted(srt[g], bounds[g])
            count = np.diff(pos, axis=1)
            total = np.take_along_axis(sums, pos[:, 1:], 1) - np.take_along_axis(sums, pos[:, :-1], 1)
            with np.errstate(invalid="ignore", divide="ignore"):
                centres = np.where(count > 0, total / np.maximum(count, 1), centres)
            centres.sort(axis=1)
    with np.errstate(over="ignore"):
        lut = centres.astype(np.float16)
    lut.sort(axis=1)
    edges = lut.astype(np.float32)
    edges = (edges[:, 1:] + edges[:, :-1]) / 2
    indices = np.empty(values.shape, np.uint8)
    for g in range(groups):
        indices[g] = np.searchsorted(edges[g], values[g])
    return indices, lut


def _row_dots(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Each row's dot product `[rows]` of float32 rows `[rows, n]`: BLAS's (`np.vecdot`, numpy
    2.0 on), else einsum's."""
    vecdot = getattr(np, "vecdot", None)
    return vecdot(a, b) if vecdot is not None else np.einsum("ij,ij->i", a, b)


class _CosineAccumulator:
    """cos(a, b) over many row chunks. Each row's dot is taken in float32 (`_row_dots`: BLAS's
    several SIMD partial sums, 40% faster here than einsum's) and the row sums are
    accumulated in float64: 1 - cos is ~1e-5, which one float32 sum over a matrix would blur."""

    def __init__(self) -> None:
        self.ab = self.aa = self.bb = 0.0

    def add(self, a: np.ndarray, b: np.ndarray) -> None:
        # Row dots make no temporaries: the cosine costs less than the quantization.
        for attr, x, y in (("ab", a, b), ("aa", a, a), ("bb", b, b)):
            rows = _row_dots(x, y)
            setattr(self, attr, getattr(self, attr) + float(np.sum(rows, dtype=np.float64)))

    def merge(self, other: "_CosineAccumulator") -> None:
        self.ab += other.ab
        self.aa += other.aa
        self.bb += other.bb

    def add_scaled(self, a: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
        """`add(a, q * scale[:, None])` without the product: each row's dots are taken in
        float32 and scaled in float64."""
        s = scale.astype(np.float64)
        self.ab += float(s @ _row_dots(a, q))
        self.aa += float(np.sum(_row_dots(a, a), dtype=np.float64))
        self.bb += float((s * s) @ _row_dots(q, q))

    def cosine(self) -> float:
        denom = np.sqrt(self.aa * self.bb)
        return 1.0 if denom == 0 else self.ab / float(denom)


def _q8_0_rows(t: Tensor, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if t.is_q8_0:
        qs, d = t.q8_0()
        return qs[index], d[index]
    # Other types have no Q8_0 blocks to keep: make them the way llama.cpp's quantizer would.
    raw = q8_0_quantize(t.rows(index, np.float32))
    blocks = q8_0_blocks(raw, t.shape[1])
    return blocks["qs"], blocks["d"]
