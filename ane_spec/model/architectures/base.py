"""What distinguishes one llama.cpp architecture from another, as data.

Each supported `general.architecture` is one short module in this package holding an
`Architecture`; the GGUF reader, the reference forward pass, the shard compiler and the synthetic
writer read these fields and nothing else about the family. The fields are the differences that
exist between the graphs in llama.cpp's `src/models/{phi3,llama,qwen2,qwen3,gemma3}.cpp`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeType = Literal["norm", "neox"]
RopeFactors = Literal["longrope", "freqs", "none"]
# llama.cpp's build_ffn activation on the gate: LLM_FFN_SILU, or LLM_FFN_GELU (ggml_gelu, the
# tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).
FfnActivation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class Architecture:
    name: str                  # the `general.architecture` value, also the metadata key prefix
    title: str                 # what `inspect` calls it
    # llama.cpp's llama_model_rope_type: NORM rotates adjacent pairs (x[2j], x[2j+1]), NEOX the
    # halves (x[j], x[j + rot/2]).
    rope_type: RopeType
    fused_qkv: bool            # one `attn_qkv` matrix (phi3) or `attn_q`/`attn_k`/`attn_v`
    fused_gate_up: bool        # `ffn_up` holds gate then up (phi3) or `ffn_gate` + `ffn_up`
    qkv_bias: bool             # `attn_{q,k,v}.bias` (qwen2)
    qk_norm: bool              # per-head RMSNorm of q and k before RoPE (qwen3)
    # Where per-pair RoPE frequency divisors come from: phi3's LongRoPE tensors
    # (`rope_factors_long/short.weight`), llama 3.1+'s `rope_freqs.weight`, or none.
    rope_factors: RopeFactors
    # llama.cpp refuses (llama) or asserts against (qwen2, qwen3) rope.dimension_count != head_dim;
    # only phi3 rotates part of each head.
    partial_rotary: bool
    # The value llama.cpp uses for add_bos when the file has no tokenizer.ggml.add_bos_token is a
    # property of the pre-tokenizer (tokenizer.py), not of the architecture.
    # The special-token layout synthetic fixtures of this family get (vocab.build_synthetic_vocab).
    vocab_family: str = "phi4"
    # Gemma 3: RMSNorm of each branch's output before it is added to the residual stream
    # (`post_attention_norm`, `post_ffw_norm`).
    post_norms: bool = False
    ffn_activation: FfnActivation = "silu"
    # Gemma 3: the token embeddings are multiplied by sqrt(hidden_size) before the first layer.
    embed_scale: bool = False
    # Gemma 3 (llama.cpp's load_swa_pattern(ml, n)): when the file has
    # `<arch>.attention.sliding_window`, layer il is local unless il % n == n - 1, with n from
    # `<arch>.attention.sliding_window_pattern` (an int, or one bool per layer) or this default.
    # 0: the family has no sliding-window layers.
    swa_pattern: int = 0
    quirks: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.name} ({self.title}): " + "; ".join(self.quirks)
