"""RoPE cos/sin tables as llama.cpp's ggml_rope_ext computes them (ext_factor 0: no yarn).

theta_j = pos * freq_scale * base^(-2j/rope_dims) / factor_j, cos and sin times attn_factor.
The factors are phi3's LongRoPE set chosen by the context window, llama 3.1's `rope_freqs`, or
all ones. Which dims a pair j rotates (NEOX halves or NORM neighbours) is the architecture's
business; the tables are the same for both.

The one place cos/sin tables are computed. The reference forward, the shard compiler's tests and
the runtime's host-side inputs all call `rope_tables`, so a shard and the reference can only
disagree about RoPE if the graph that consumes the tables is wrong.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

# "freqs": llama's rope_freqs tensor; "none": no factors at all (all ones).
FactorSet = Literal["short", "long", "freqs", "none"]


class RopeSpec(BaseModel):
    """Everything that fixes the tables for one context window (recorded in the manifest)."""

    model_config = ConfigDict(frozen=True)

    rope_dims: int
    freq_base: float
    factor_set: FactorSet
    factors: tuple[float, ...]
    attn_factor: float
    context_window: int
    freq_scale: float = 1.0

    def tables(self, positions: np.ndarray | list[int],
               dtype: np.dtype = np.float32) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(self, positions, dtype)


def choose_factor_set(context_window: int, original_context_length: int) -> FactorSet:
    """llama.cpp uses the long factors for every position once the window exceeds the original."""
    return "long" if context_window > original_context_length else "short"


def make_rope_spec(*, rope_dims: int, freq_base: float, attn_factor: float,
                   original_context_length: int, context_window: int,
                   short_factors: np.ndarray, long_factors: np.ndarray,
                   freq_scale: float = 1.0, factor_set: FactorSet | None = None) -> RopeSpec:
    """`factor_set=None` picks LongRoPE's short or long set by the window; "freqs" and "none"
    use `short_factors` as the one set there is."""
    if factor_set is None:
        factor_set = choose_factor_set(context_window, original_context_length)
    factors = long_factors if factor_set == "long" else short_factors
    if len(factors) != rope_dims // 2:
        raise ValueError(f"{factor_set} RoPE factors have {len(factors)} entries, "
                         f"expected rope_dims/2 = {rope_dims // 2}")
    return RopeSpec(rope_dims=rope_dims, freq_base=freq_base, factor_set=factor_set,
                    factors=tuple(float(f) for f in factors), attn_factor=attn_factor,
                    context_window=context_window, freq_scale=freq_scale)


def rope_tables(spec: RopeSpec, positions: np.ndarray | list[int],
                dtype: np.dtype = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[len(positions), rope_dims/2]`, already multiplied by the attention factor.

    theta_j = pos * base^(-2j/rope_dims) / factor_j. Computed in float64 so that fp32 and fp64
    consumers start from the same correctly rounded values.
    """
    pos = np.asarray(positions, dtype=np.float64).reshape(-1, 1)
    half = spec.rope_dims // 2
    inv_freq = spec.freq_base ** (-2.0 * np.arange(half, dtype=np.float64) / spec.rope_dims)
    theta = pos * (spec.freq_scale * inv_freq / np.asarray(spec.factors, dtype=np.float64))
    cos = np.cos(theta) * spec.attn_factor
    sin = np.sin(theta) * spec.attn_factor
    return cos.astype(dtype), sin.astype(dtype)
