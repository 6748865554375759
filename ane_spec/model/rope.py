"""Partial NEOX RoPE with LongRoPE factors, as llama.cpp's `phi3` graph applies it.

The one place cos/sin tables are computed. The reference forward, the shard compiler's tests and
the runtime's host-side inputs all call `rope_tables`, so a shard and the reference can only
disagree about RoPE if the graph that consumes the tables is wrong.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

FactorSet = Literal["short", "long"]


class RopeSpec(BaseModel):
    """Everything that fixes the tables for one context window (recorded in the manifest)."""

    model_config = ConfigDict(frozen=True)

    rope_dims: int
    freq_base: float
    factor_set: FactorSet
    factors: tuple[float, ...]
    attn_factor: float
    context_window: int

    def tables(self, positions: np.ndarray | list[int],
               dtype: np.dtype = np.float32) -> tuple[np.ndarray, np.ndarray]:
        return rope_tables(self, positions, dtype)


def choose_factor_set(context_window: int, original_context_length: int) -> FactorSet:
    """llama.cpp uses the long factors for every position once the window exceeds the original."""
    return "long" if context_window > original_context_length else "short"


def make_rope_spec(*, rope_dims: int, freq_base: float, attn_factor: float,
                   original_context_length: int, context_window: int,
                   short_factors: np.ndarray, long_factors: np.ndarray) -> RopeSpec:
    factor_set = choose_factor_set(context_window, original_context_length)
    factors = long_factors if factor_set == "long" else short_factors
    if len(factors) != rope_dims // 2:
        raise ValueError(f"{factor_set} RoPE factors have {len(factors)} entries, "
                         f"expected rope_dims/2 = {rope_dims // 2}")
    return RopeSpec(rope_dims=rope_dims, freq_base=freq_base, factor_set=factor_set,
                    factors=tuple(float(f) for f in factors), attn_factor=attn_factor,
                    context_window=context_window)


def rope_tables(spec: RopeSpec, positions: np.ndarray | list[int],
                dtype: np.dtype = np.float32) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin `[len(positions), rope_dims/2]`, already multiplied by the attention factor.

    theta_j = pos * base^(-2j/rope_dims) / factor_j. Computed in float64 so that fp32 and fp64
    consumers start from the same correctly rounded values.
    """
    pos = np.asarray(positions, dtype=np.float64).reshape(-1, 1)
    half = spec.rope_dims // 2
    inv_freq = spec.freq_base ** (-2.0 * np.arange(half, dtype=np.float64) / spec.rope_dims)
    theta = pos * (inv_freq / np.asarray(spec.factors, dtype=np.float64))
    cos = np.cos(theta) * spec.attn_factor
    sin = np.sin(theta) * spec.attn_factor
    return cos.astype(dtype), sin.astype(dtype)
