"""Llama 3.x (llama.cpp `src/models/llama.cpp`)."""

from ane_spec.model.architectures.base import Architecture

ARCHITECTURE = Architecture(
    name="llama", title="Llama 3.x", rope_type="norm",
    fused_qkv=False, fused_gate_up=False, qkv_bias=False, qk_norm=False,
    rope_factors="freqs", partial_rotary=False,
    vocab_family="llama3",
    quirks=("separate q/k/v and gate/up", "NORM (adjacent-pair) RoPE",
            "optional rope_freqs frequency divisors (Llama 3.1+)"),
)
