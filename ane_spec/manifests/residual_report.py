"""A build's residual scale and activation margins in words: `build`, `inspect` and `doctor`
say them the same way. The record itself is `schema.ResidualScale`; the compiler side is
shards/residual_scale.py."""

from __future__ import annotations

import numpy as np

from ane_spec.manifests.schema import ResidualScale


def describe(rs: ResidualScale | None) -> list[str]:
    """The residual scale and the measured margins in a few lines (build, inspect, doctor)."""
    if rs is None:
        return ["residual scale: not recorded (built before residual scaling): stream unscaled, "
                "activation margins not measured"]
    lines = [f"residual scale: 2^{rs.log2_factor} ({rs.setting}); stream norms' eps "
             f"{rs.stream_eps:.3g}{_eps_in_fp16(rs.stream_eps)}"
             + (f"; {sum(rs.inexact_values.values()):,} stored value(s) not scaled exactly "
                "(fp16 subnormals)" if any(rs.inexact_values.values()) else "")]
    cal = rs.calibration
    if cal is None:
        lines.append("  activations not calibrated (--residual-scale off)")
        return lines
    peak = max([cal.embedding, *(x.residual for x in cal.layers)])
    worst = max(range(len(cal.layers)),
                key=lambda i: max(cal.layers[i].ffn_up, cal.layers[i].ffn_down_in), default=0)
    ffn_peak = max([0.0, *(max(x.ffn_up, x.ffn_down_in) for x in cal.layers)])
    lines.append(f"  calibration ({cal.prompts} prompts, {cal.tokens} tokens, {cal.seconds:.1f}s, "
                 f"fp32 reference): residual peak {peak:.4g}, as stored x2^{rs.log2_factor}: "
                 f"margin {_fmt_margin(cal.residual_margin)} under 65504; FFN intermediate peak "
                 f"{ffn_peak:.4g} (layer {worst}), margin {_fmt_margin(cal.ffn_margin)} (not "
                 "scaled by the fold)")
    for problem in margin_problems(rs):
        lines.append(f"  warning: {problem}")
    return lines


def margin_problems(rs: ResidualScale | None) -> list[str]:
    """What the recorded margins say overflows (or nearly) on the calibration prompts."""
    cal = rs.calibration if rs is not None else None
    if cal is None:
        return []
    out = []
    if cal.residual_margin is not None and cal.residual_margin < 1:
        out.append(f"the residual stream overflows fp16 even scaled by 2^{rs.log2_factor} "
                   f"(margin {cal.residual_margin:.2f}); use a smaller --residual-scale")
    if cal.ffn_margin is not None and cal.ffn_margin < 1:
        out.append(f"FFN intermediates overflow fp16 (margin {cal.ffn_margin:.2f}); the stream's "
                   "scale cannot help there. silu(gate)*up is linear in up, so ffn_up's rows "
                   "times 2^-j with ffn_down times 2^j would hold the product; a gate output "
                   "past 65504 would need the graph to split the conv")
    return out


def _fmt_margin(m: float | None) -> str:
    return "unbounded" if m is None else f"{m:.1f}x"


def _eps_in_fp16(eps: float) -> str:
    """What the fp16 constant holds: eps below fp16's smallest normal (6.1e-5) is stored as a
    subnormal, below half its smallest subnormal (3e-8) as 0 (layer_graph.rms_norm: harmless
    for every row but an all-zero one)."""
    stored = float(np.float16(eps))
    if stored == 0:
        return " (0 in fp16)"
    if stored < float(np.finfo(np.float16).tiny):
        return f" (fp16 subnormal {stored:.3g})"
    return ""
