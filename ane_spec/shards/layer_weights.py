"""One layer's GGUF tensors -> the arrays the shared layer graph takes, for any architecture.

The layer graph (layer_graph.py) has one shape for every family: a fused q|k|v conv with an
optional bias, optional per-head q/k norms, NEOX RoPE, and a fused gate|up conv. This module
maps each architecture's tensors onto it:

- separate `attn_q/k/v` (and their biases) are stacked into one q|k|v matrix, `ffn_gate` and
  `ffn_up` into one gate|up matrix. Every weight format is per output row or per group of rows
  (int8 with one scale per row, a LUT per group of rows that divides every part, Q8_0 blocks
  along the input axis, fp16), so stacking rows changes no value. A stacked matrix takes one
  format, the one its worst part needs (weights.convert_parts).
- NORM RoPE (llama) rotates adjacent pairs (2j, 2j+1). Reordering the rows of each q and k head
  to [0, 2, 4, .., 1, 3, 5, .., rot..] makes those pairs (j, j + rot/2), which the graph's NEOX
  RoPE rotates by the same angle; q.k sums over all head dims, so attention is unchanged. The
  q/k biases and norm weights get the same reordering. The rows are read in that order from
  the file (so a LUT group holds the rows it is stored with). K in the state is then in that order
  too, which only the shard itself ever reads.
"""

from __future__ import annotations

import numpy as np

from ane_spec.model.config import ModelConfig
from ane_spec.model.gguf_file import GGUFModel, Tensor, layer_tensor_shapes
from ane_spec.shards.layer_graph import LayerWeights
from ane_spec.shards.weights import (
    DEFAULT_MIN_WEIGHT_COSINE,
    ConvWeight,
    Part,
    TensorChoice,
    WeightFormat,
    convert_parts,
    require_finite,
)


def layer_tensor_names(c: ModelConfig, i: int) -> list[str]:
    """Every tensor layer `i`'s shard reads (its fingerprint covers them)."""
    return list(layer_tensor_shapes(c, i))


def neox_order(c: ModelConfig, heads: int) -> np.ndarray:
    """Row order that turns NORM pairs into NEOX halves in each of `heads` heads."""
    hd, rot = c.head_dim, c.rope_dims
    head = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, hd)])
    return (np.arange(heads)[:, None] * hd + head[None, :]).reshape(-1)


def layer_weights(model: GGUFModel, i: int, fmt: WeightFormat,
                  choices: dict[str, TensorChoice],
                  min_cosine: float = DEFAULT_MIN_WEIGHT_COSINE) -> LayerWeights:
    """Layer `i`'s arrays; each matrix tensor's choice (format, cosine, why) goes into
    `choices` under its name."""
    c, a = model.config, model.config.architecture

    def matrices(*parts: tuple[str, np.ndarray | None]) -> ConvWeight:
        tensors = [model.layer(i, part) for part, _ in parts]
        w = convert_parts([Part(t, rows) for t, (_, rows) in zip(tensors, parts)], fmt,
                          min_cosine)
        for t in tensors:
            t.release()
        choices.update({ch.name: ch for ch in w.choices})
        return w

    def matrix(part: str) -> ConvWeight:
        return matrices((part, None))

    def vector(name: str) -> np.ndarray:
        return finite_vector(model.tensor(f"blk.{i}.{name}"))

    # q, k rows reordered for NORM RoPE (see the module docstring); identity for NEOX.
    q_rows = neox_order(c, c.num_heads) if a.rope_type == "norm" else None
    k_rows = neox_order(c, c.num_kv_heads) if a.rope_type == "norm" else None
    if a.fused_qkv:
        qkv = matrix("attn_qkv")
    else:
        qkv = matrices(("attn_q", q_rows), ("attn_k", k_rows), ("attn_v", None))
    bias = None
    if a.qkv_bias:
        bias = np.concatenate([_pick(vector("attn_q.bias"), q_rows),
                               _pick(vector("attn_k.bias"), k_rows), vector("attn_v.bias")])
    q_norm = k_norm = None
    if a.qk_norm:
        head = neox_order(c, 1) if a.rope_type == "norm" else None
        q_norm = _pick(vector("attn_q_norm.weight"), head)
        k_norm = _pick(vector("attn_k_norm.weight"), head)
    up = matrix("ffn_up") if a.fused_gate_up else matrices(("ffn_gate", None), ("ffn_up", None))
    post = (dict(post_attn_norm=vector("post_attention_norm.weight"),
                 post_ffn_norm=vector("post_ffw_norm.weight")) if a.post_norms else {})
    return LayerWeights(
        attn_norm=vector("attn_norm.weight"), qkv=qkv, attn_output=matrix("attn_output"),
        ffn_norm=vector("ffn_norm.weight"), ffn_up=up, ffn_down=matrix("ffn_down"),
        qkv_bias=bias, q_norm=q_norm, k_norm=k_norm, **post)


def _pick(values: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return values if rows is None else values[rows]


def finite_vector(t: Tensor) -> np.ndarray:
    values = np.array(t.dequantize())
    require_finite(t.name, values)
    return values
