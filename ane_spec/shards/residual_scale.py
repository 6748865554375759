"""Residual-stream scaling by a power of two, folded into the weights (`--residual-scale`).

RMSNorm is scale-invariant: rmsnorm(s*x, eps*s^2) == rmsnorm(x, eps). So multiplying the whole
residual stream by s = 2^k changes nothing a layer computes from it, provided that

- the embedding rows (the stream's start) are multiplied by s,
- every term ADDED into the stream is multiplied by s: with pre-norm layers (phi3, llama, qwen2,
  qwen3) those are the outputs of attn_output and ffn_down, so their weights are scaled. An
  architecture with post-norms (gemma3: x + post_norm(o_proj(..))) scales the post-norm's weight
  instead, since the norm would cancel a scaled o_proj: `STREAM_WRITERS` names, per
  architecture, the LayerWeights fields whose output adds into the stream;
- every norm whose INPUT is the stream (attn_norm, ffn_norm, output_norm) takes eps * s^2.
  Norms that read something else (qwen3's per-head q/k norms) keep eps.

Powers of two change no mantissa bit, so wherever the unscaled fp16 program stayed within fp16's
normal range the scaled one computes the same values times s, bit for bit; the logits are
unchanged. Where the unscaled stream overflowed (past 65,504), the scaled one (k < 0) holds it.

Where it is not exact: a value pushed below fp16's smallest normal (6.1e-5) loses mantissa bits
(subnormal) or becomes 0. For weights, the fold goes into the per-row scale (int8), the table
(lut8), the per-block scale (q8-block) or the values (fp16), never into the int data; the fold
counts values it could not scale exactly (`FoldCount`) and the manifest records the count. For
eps: Qwen's 1e-6 is already subnormal in fp16 (stored as ~1.01e-6), and 1e-6 * 2^-8 = 3.9e-9 is
below fp16's smallest subnormal (6e-8), so it is stored as 0. eps matters only for a row whose
mean(x^2) is comparable to it, i.e. an all-zero row; layer_graph.rms_norm's docstring says why
no such row is ever fed (an ANE that flushes subnormals already sees eps = 0 for every model
whose eps is below 6.1e-5). A subnormal eps also rounds differently once scaled (SmolLM2's
1e-5 at 2^-2: 6.25e-7 is stored as 5.96e-7, 4.6% low, where 1e-5 is stored 0.14% high), so a
row whose mean(x^2) is small differs in its last fp16 bit here and there: SmolLM2 built at 2^-2
against unscaled gives fp16 logits with cosine >= 0.99998 and the same argmax on 16 positions,
not bit-identical ones (tests/test_residual_scale.py shows bit-identity with a normal eps).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from ane_spec.errors import BuildError
from ane_spec.manifests.schema import ActivationCalibration, LayerActivations, ResidualScale
from ane_spec.model.activation_range import FP16_MAX, ActivationRanges, margin
from ane_spec.model.gguf_file import GGUFModel
from ane_spec.shards.layer_graph import LayerWeights
from ane_spec.shards.scale_decision import requested_log2
from ane_spec.shards.weights import ConvWeight

# LayerWeights fields whose output is added into the residual stream, per architecture
# (default: pre-norm layers). A ConvWeight is scaled in its stored form, an ndarray (a post-norm
# weight) as float values.
DEFAULT_STREAM_WRITERS: tuple[str, ...] = ("attn_output", "ffn_down")
STREAM_WRITERS: dict[str, tuple[str, ...]] = {
    # x + post_norm(o_proj(..)): the post-norm's output is what adds in, and it would cancel a
    # scaled o_proj/ffn_down, so its weight carries the factor (its eps stays: its input is
    # the branch, not the stream).
    "gemma3": ("post_attn_norm", "post_ffn_norm"),
}


def stream_writers(arch: str) -> tuple[str, ...]:
    return STREAM_WRITERS.get(arch, DEFAULT_STREAM_WRITERS)


def stream_eps(eps: float, log2: int) -> float:
    """eps for the norms that read the stream: eps * s^2, computed exactly (ldexp)."""
    return math.ldexp(eps, 2 * log2)


@dataclass
class FoldCount:
    """Stored values the fold scaled, and those it could not scale exactly (fp16 subnormals)."""

    values: int = 0
    inexact: int = 0

    def add(self, other: "FoldCount") -> None:
        self.values += other.values
        self.inexact += other.inexact


def scale_fp16(values: np.ndarray, log2: int, what: str) -> tuple[np.ndarray, FoldCount]:
    """fp16 `values` * 2^log2, with the count of those that did not scale exactly. A value that
    would overflow fp16 is refused (the fold can only scale up where k > 0)."""
    wide = np.ldexp(values.astype(np.float32), log2)
    with np.errstate(over="ignore"):
        out = wide.astype(np.float16)
    if not np.isfinite(out[np.isfinite(values)]).all():
        raise BuildError(f"--residual-scale 2^{log2} takes {what} beyond fp16's range "
                         f"({FP16_MAX:g}); choose a smaller factor")
    inexact = int(np.count_nonzero(out.astype(np.float32) != wide))
    return out, FoldCount(int(values.size), inexact)


def scale_conv_weight(w: ConvWeight, log2: int, what: str) -> tuple[ConvWeight, FoldCount]:
    """A conv weight whose every stored value is multiplied by 2^log2, in its stored form: the
    fp16 scale (int8-channel, q8-block), the fp16 table (lut8) or the fp16 values; the int data
    is untouched."""
    if log2 == 0:
        return w, FoldCount()
    if w.lut is not None:
        lut, n = scale_fp16(w.lut, log2, what)
        return replace(w, lut=lut), n
    if w.scale is not None:
        scale, n = scale_fp16(w.scale, log2, what)
        return replace(w, scale=scale), n
    data, n = scale_fp16(w.data, log2, what)
    return replace(w, data=data), n


def fold_into_layer(w: LayerWeights, arch: str, eps: float, log2: int, layer: int
                    ) -> tuple[LayerWeights, FoldCount]:
    """Layer weights for a stream scaled by 2^log2 (see the module docstring)."""
    count = FoldCount()
    if log2 == 0:
        return w, count
    changes: dict[str, object] = {"stream_eps": stream_eps(eps, log2)}
    for name in stream_writers(arch):
        value = getattr(w, name)
        if isinstance(value, ConvWeight):
            changes[name], n = scale_conv_weight(value, log2, f"blk.{layer}.{name}")
            count.add(n)
        else:  # a post-norm weight (fp32 here, rounded to fp16 by the graph)
            changes[name] = np.ldexp(np.asarray(value, np.float32), log2)
    return replace(w, **changes), count


def record(model: GGUFModel, setting: str, ranges: ActivationRanges | None) -> ResidualScale:
    """The manifest's record of the decision: k from `setting` and `ranges`, the stream's eps,
    the calibration and both margins as the fp16 program holds them."""
    log2 = requested_log2(setting, ranges)
    calibration = None
    if ranges is not None:
        calibration = ActivationCalibration(
            prompts=ranges.prompts, tokens=ranges.tokens, seconds=round(ranges.seconds, 3),
            embedding=ranges.embedding,
            layers=[LayerActivations(**vars(r)) for r in ranges.layers],
            residual_margin=_finite(margin(ranges.residual_max, 2.0 ** log2)),
            ffn_margin=_finite(margin(ranges.ffn_max)))
    return ResidualScale(setting=setting, log2_factor=log2,
                         stream_eps=stream_eps(model.config.rms_eps, log2),
                         calibration=calibration)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
