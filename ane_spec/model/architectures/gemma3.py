"""Gemma 3 text models, 270M / 1B / 4B (llama.cpp `src/models/gemma3.cpp`).

What llama.cpp reads and computes, checked against its source:
- norms: `attn_norm`, `post_attention_norm`, `ffn_norm`, `post_ffw_norm`, per-head
  `attn_q_norm`/`attn_k_norm`; all plain RMSNorm x * w, because the converter already stored
  HF's (1 + w) (conversion/gemma.py, Gemma3Model.norm_shift);
- `inp_scaled` = token_embd[t] * sqrtf(n_embd);
- FFN: ggml_gelu (tanh form) of ffn_gate times ffn_up (LLM_FFN_GELU, LLM_FFN_PAR);
- q scaled by f_attention_scale = 1/sqrt(key_length) (27B only: 1/sqrt(n_embd/n_head)); the
  `query_pre_attn_scalar` of HF's config is not a GGUF key and llama.cpp does not read it;
- local layers (sliding window, pattern 6: five local then one global) use RoPE base
  `rope.freq_base_swa` (default 10000) with freq_scale 1; global layers use `rope.freq_base`
  and the file's linear scaling (Gemma 3 4B: factor 8);
- NEOX RoPE (llama_model_rope_type), tied output unless `output.weight` exists.
"""

from ane_spec.model.architectures.base import Architecture

ARCHITECTURE = Architecture(
    name="gemma3", title="Gemma 3", rope_type="neox",
    fused_qkv=False, fused_gate_up=False, qkv_bias=False, qk_norm=True,
    rope_factors="none", partial_rotary=False,
    vocab_family="gemma3",
    post_norms=True, ffn_activation="gelu_tanh", embed_scale=True, swa_pattern=6,
    quirks=("embeddings scaled by sqrt(hidden)", "RMSNorm before and after attention and FFN",
            "per-head RMSNorm of q and k", "GeGLU (tanh GELU)",
            "sliding-window layers (5 local : 1 global) with their own RoPE base",
            "head_dim from attention.key_length (256 in every size)"),
)
