"""Qwen 2 / 2.5 (llama.cpp `src/models/qwen2.cpp`)."""

from ane_spec.model.architectures.base import Architecture

ARCHITECTURE = Architecture(
    name="qwen2", title="Qwen 2 / 2.5", rope_type="neox",
    fused_qkv=False, fused_gate_up=False, qkv_bias=True, qk_norm=False,
    rope_factors="none", partial_rotary=False,
    vocab_family="qwen2",
    quirks=("separate q/k/v with biases", "NEOX RoPE"),
)
