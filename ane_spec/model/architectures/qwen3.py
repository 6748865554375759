"""Qwen 3 dense (llama.cpp `src/models/qwen3.cpp`)."""

from ane_spec.model.architectures.base import Architecture

ARCHITECTURE = Architecture(
    name="qwen3", title="Qwen 3", rope_type="neox",
    fused_qkv=False, fused_gate_up=False, qkv_bias=False, qk_norm=True,
    rope_factors="none", partial_rotary=False,
    vocab_family="qwen3",
    quirks=("separate q/k/v, no biases", "per-head RMSNorm of q and k before RoPE",
            "NEOX RoPE", "head_dim from attention.key_length (heads x head_dim may differ "
            "from hidden)"),
)
