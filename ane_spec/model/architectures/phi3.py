"""Phi-3 / Phi-4-mini (llama.cpp `src/models/phi3.cpp`)."""

from ane_spec.model.architectures.base import Architecture

ARCHITECTURE = Architecture(
    name="phi3", title="Phi-3 / Phi-4-mini", rope_type="neox",
    fused_qkv=True, fused_gate_up=True, qkv_bias=False, qk_norm=False,
    rope_factors="longrope", partial_rotary=True,
    vocab_family="phi4",
    quirks=("fused attn_qkv and gate|up ffn_up", "partial NEOX RoPE",
            "LongRoPE factors chosen by the context window, attention factor on cos/sin"),
)
