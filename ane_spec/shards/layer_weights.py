"""One layer's GGUF tensors -> the arrays the shared layer graph takes, for any architecture.

The layer graph (layer_graph.py) has one shape for every family: a fused q|k|v conv with an
optional bias, optional per-head q/k norms, NEOX RoPE, and a fused gate|up conv. This module
maps each architecture's tensors onto it:

- separate `attn_q/k/v` (and their biases) are stacked into one q|k|v matrix, `ffn_gate` and
  `ffn_up` into one gate|up matrix. Every weight format is per output row (int8 with one scale
  per row, Q8_0 blocks along the input axis, fp16), so stacking rows changes no value.
- NORM RoPE (llama) rotates adjacent pairs (2j, 2j+1). Reordering the rows of each q and k head
  to [0, 2, 4, .., 1, 3, 5, .., rot..] makes those pairs (j, j + rot/2), which the graph's NEOX
  RoPE rotates by the same angle; q.k sums over all head dims, so attention is unchanged. The
  q/k biases and norm weights get the same reordering. K in the state is then in that order
  too, which only the shard itself ever reads.
"""

from __future__ import annotations

import numpy as np

from ane_spec.model.config import ModelConfig
from ane_spec.model.gguf_file import GGUFModel, Tensor, layer_tensor_shapes
from ane_spec.shards.layer_graph import LayerWeights
from ane_spec.shards.weights import ConvWeight, WeightFormat, convert_matrix, require_finite


def layer_tensor_names(c: ModelConfig, i: int) -> list[str]:
    """Every tensor layer `i`'s shard reads (its fingerprint covers them)."""
    return list(layer_tensor_shapes(c, i))


def neox_order(c: ModelConfig, heads: int) -> np.ndarray:
    """Row order that turns NORM pairs into NEOX halves in each of `heads` heads."""
    hd, rot = c.head_dim, c.rope_dims
    head = np.concatenate([np.arange(0, rot, 2), np.arange(1, rot, 2), np.arange(rot, hd)])
    return (np.arange(heads)[:, None] * hd + head[None, :]).reshape(-1)


def layer_weights(model: GGUFModel, i: int, fmt: WeightFormat,
                  cosines: dict[str, float]) -> LayerWeights:
    c, a = model.config, model.config.architecture

    def matrix(part: str) -> ConvWeight:
        t = model.layer(i, part)
        w = convert_matrix(t, fmt)
        t.release()
        cosines[t.name] = w.cosine
        return w

    def vector(name: str) -> np.ndarray:
        return finite_vector(model.tensor(f"blk.{i}.{name}"))

    # q, k rows reordered for NORM RoPE (see the module docstring); identity for NEOX.
    q_rows = neox_order(c, c.num_heads) if a.rope_type == "norm" else None
    k_rows = neox_order(c, c.num_kv_heads) if a.rope_type == "norm" else None
    if a.fused_qkv:
        qkv = matrix("attn_qkv")
    else:
        qkv = stack([reorder(matrix("attn_q"), q_rows), reorder(matrix("attn_k"), k_rows),
                     matrix("attn_v")])
    bias = None
    if a.qkv_bias:
        bias = np.concatenate([_pick(vector("attn_q.bias"), q_rows),
                               _pick(vector("attn_k.bias"), k_rows), vector("attn_v.bias")])
    q_norm = k_norm = None
    if a.qk_norm:
        head = neox_order(c, 1) if a.rope_type == "norm" else None
        q_norm = _pick(vector("attn_q_norm.weight"), head)
        k_norm = _pick(vector("attn_k_norm.weight"), head)
    up = matrix("ffn_up") if a.fused_gate_up else stack([matrix("ffn_gate"), matrix("ffn_up")])
    return LayerWeights(
        attn_norm=vector("attn_norm.weight"), qkv=qkv, attn_output=matrix("attn_output"),
        ffn_norm=vector("ffn_norm.weight"), ffn_up=up, ffn_down=matrix("ffn_down"),
        qkv_bias=bias, q_norm=q_norm, k_norm=k_norm)


def stack(parts: list[ConvWeight]) -> ConvWeight:
    """Row-stack conv weights of one format; the cosine is the worst part's (each part's own
    cosine is recorded under its tensor name)."""
    first = parts[0]
    data = np.concatenate([p.data for p in parts])
    scale = None if first.scale is None else np.concatenate([p.scale for p in parts])
    return ConvWeight(first.format, (data.shape[0], first.shape[1]), data, scale,
                      min(p.cosine for p in parts))


def reorder(w: ConvWeight, rows: np.ndarray | None) -> ConvWeight:
    if rows is None:
        return w
    scale = None if w.scale is None else np.ascontiguousarray(w.scale[rows])
    return ConvWeight(w.format, w.shape, np.ascontiguousarray(w.data[rows]), scale, w.cosine)


def _pick(values: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return values if rows is None else values[rows]


def finite_vector(t: Tensor) -> np.ndarray:
    values = np.array(t.dequantize())
    require_finite(t.name, values)
    return values
