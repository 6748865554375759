"""Write synthetic GGUF files with the exact Phi-4-mini layout, at any size.

There are no real weights on the machines this project is tested on, so fixtures and benchmarks
are files the real loading code reads: the same metadata keys, tensor names, types and shapes as
`Phi-4-mini-instruct.Q8_0.gguf`, a real byte-level BPE vocabulary, random but well-scaled weights.

Tensors are generated and written in row chunks straight into the file, so writing the 3.8B-param
preset needs a few hundred MB, not the 15 GB its fp32 weights would take.

Two fixture regimes matter (see the contract doc's "Synthetic fixtures: two traps"):
- `embed_std=1, branch_scale=1` is well conditioned: use it to compare logits with llama.cpp;
- the default `embed_std=0.05, branch_scale=4` keeps a random model's greedy output varied
  instead of repeating the input token, which decode and drafting tests need.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize as gguf_quantize
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ane_spec.errors import ConfigError

from ane_spec.model.config import ModelConfig, first_error, longrope_attn_factor
from ane_spec.model.gguf_file import expected_tensor_shapes
from ane_spec.model.quant import Q8_0_BLOCK, Q8_0_BLOCK_BYTES, q8_0_quantize
from ane_spec.model.vocab import build_synthetic_vocab

WeightType = Literal["q8_0", "f16", "bf16"]
CHUNK_ELEMENTS = 1 << 24  # ~64 MB of fp32 per generated chunk


class SyntheticSpec(BaseModel):
    """Shapes and weight statistics of a synthetic file."""

    model_config = ConfigDict(frozen=True)

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_size: int
    vocab_size: int
    rope_dims: int
    context_length: int = 131072
    original_context_length: int = 4096
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    embed_std: float = 0.05
    branch_scale: float = 4.0
    weight_type: WeightType = "q8_0"
    tied_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _valid(self) -> "SyntheticSpec":
        self.to_config()  # raises on inconsistent shapes
        return self

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def to_config(self) -> ModelConfig:
        return ModelConfig(
            hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            rope_dims=self.rope_dims, ffn_size=self.ffn_size, vocab_size=self.vocab_size,
            context_length=self.context_length,
            original_context_length=self.original_context_length,
            rope_freq_base=self.rope_freq_base,
            rope_attn_factor=longrope_attn_factor(self.context_length,
                                                  self.original_context_length),
            rms_eps=self.rms_eps, tied_embeddings=self.tied_embeddings)


PRESETS: dict[str, SyntheticSpec] = {
    # The dims the contract doc's trap measurements used: 3 layers, d=192, GQA 3, rotary 3/4.
    "tiny": SyntheticSpec(hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2,
                          ffn_size=512, vocab_size=1024, rope_dims=24),
    "small": SyntheticSpec(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                           ffn_size=1024, vocab_size=4096, rope_dims=48),
    "phi4-mini": SyntheticSpec(hidden_size=3072, num_layers=32, num_heads=24, num_kv_heads=8,
                               ffn_size=8192, vocab_size=200064, rope_dims=96),
}


def preset(name: str, **overrides: object) -> SyntheticSpec:
    """A preset with some fields replaced (None means keep the preset's value)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of {', '.join(PRESETS)}")
    values = PRESETS[name].model_dump() | {k: v for k, v in overrides.items() if v is not None}
    try:
        return SyntheticSpec(**values)
    except ValidationError as exc:
        raise ConfigError(f"invalid synthetic model: {first_error(exc)}") from None


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SyntheticSpec,
                         progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write `spec` as a GGUF file at `path` (atomically: a temp file renamed at the end)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    config = spec.to_config()
    tensors = _tensor_plan(spec, config)
    try:
        writer = GGUFWriter(tmp, "phi3")
        _add_metadata(writer, spec, config)
        for name, (shape, qtype, _) in tensors.items():
            nbytes = _nbytes(shape, qtype)
            writer.add_tensor_info(name, _stored_shape(shape, qtype), _stored_dtype(qtype),
                                   nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        total = len(tensors)
        for n, (name, (shape, qtype, make)) in enumerate(tensors.items()):
            writer.write_padding(fout, fout.tell())
            for chunk in make():
                _encode(chunk, qtype).tofile(fout)
            writer.write_padding(fout, fout.tell())
            if progress:
                progress(name, n + 1, total)
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _add_metadata(w: GGUFWriter, spec: SyntheticSpec, c: ModelConfig) -> None:
    w.add_name("synthetic-phi4-mini")
    w.add_file_type({"q8_0": 7, "f16": 1, "bf16": 32}[spec.weight_type])
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.ffn_size)
    w.add_block_count(c.num_layers)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.rope_dims)
    w.add_rope_freq_base(c.rope_freq_base)
    w.add_rope_scaling_attn_factors(c.rope_attn_factor)
    w.add_rope_scaling_orig_ctx_len(c.original_context_length)
    w.add_sliding_window(262144)

    vocab = build_synthetic_vocab(spec.vocab_size)
    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    for key, value in (("bos", vocab.bos_token_id), ("eos", vocab.eos_token_id),
                       ("unk", vocab.unknown_token_id), ("pad", vocab.padding_token_id)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    w.add_add_bos_token(False)
    w.add_add_eos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


Maker = Callable[[], Iterator[np.ndarray]]


def _tensor_plan(spec: SyntheticSpec, c: ModelConfig
                 ) -> dict[str, tuple[tuple[int, ...], GGMLQuantizationType, Maker]]:
    """Name -> (numpy shape, stored type, chunk generator), in the order llama.cpp writes them."""
    root = np.random.SeedSequence(spec.seed)
    matrix_type = {"q8_0": GGMLQuantizationType.Q8_0, "f16": GGMLQuantizationType.F16,
                   "bf16": GGMLQuantizationType.BF16}[spec.weight_type]
    f32 = GGMLQuantizationType.F32
    shapes = expected_tensor_shapes(c)
    plan: dict[str, tuple[tuple[int, ...], GGMLQuantizationType, Maker]] = {}
    half = c.rope_dims // 2
    # LongRoPE long factors grow with frequency index in the real model (1.0 .. ~50).
    long_factors = np.geomspace(1.0, 16.0, half).astype(np.float32)
    plan["rope_factors_long.weight"] = ((half,), f32, lambda: iter([long_factors]))
    plan["rope_factors_short.weight"] = ((half,), f32,
                                         lambda: iter([np.ones(half, np.float32)]))
    # One child seed per tensor: a tensor's values do not depend on the tensors written before it.
    for (name, shape), rng_seed in zip(shapes.items(), root.spawn(len(shapes))):
        if len(shape) == 1:
            plan[name] = (shape, f32, _norm_maker(shape, rng_seed))
            continue
        std = 1.0 / np.sqrt(shape[1])
        if name in ("token_embd.weight", "output.weight"):
            std = spec.embed_std
        elif name.endswith(("attn_output.weight", "ffn_down.weight")):
            std *= spec.branch_scale
        plan[name] = (shape, matrix_type, _gaussian_maker(shape, std, rng_seed))
    return plan


def _norm_maker(shape: tuple[int, ...], seed: np.random.SeedSequence) -> Maker:
    # Not all ones, so a graph that forgets to multiply by the norm weight is caught.
    return lambda: iter([np.random.default_rng(seed).uniform(0.8, 1.2, shape).astype(np.float32)])


def _gaussian_maker(shape: tuple[int, ...], std: float, seed: np.random.SeedSequence) -> Maker:
    rows_per_chunk = max(1, CHUNK_ELEMENTS // shape[1])

    def chunks() -> Iterator[np.ndarray]:
        rng = np.random.default_rng(seed)
        for start in range(0, shape[0], rows_per_chunk):
            rows = min(rows_per_chunk, shape[0] - start)
            yield rng.standard_normal((rows, shape[1]), dtype=np.float32) * np.float32(std)

    return chunks


def _encode(chunk: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.Q8_0:
        return q8_0_quantize(chunk)
    if qtype == GGMLQuantizationType.F16:
        return chunk.astype(np.float16)
    if qtype == GGMLQuantizationType.BF16:
        return gguf_quantize(chunk, qtype)
    return chunk.astype(np.float32)


def _nbytes(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> int:
    n = int(np.prod(shape))
    if qtype == GGMLQuantizationType.Q8_0:
        return n // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
    return n * (4 if qtype == GGMLQuantizationType.F32 else 2)


def _stored_shape(shape: tuple[int, ...], qtype: GGMLQuantizationType) -> tuple[int, ...]:
    if qtype == GGMLQuantizationType.Q8_0:
        return (*shape[:-1], shape[-1] // Q8_0_BLOCK * Q8_0_BLOCK_BYTES)
    if qtype == GGMLQuantizationType.BF16:
        return (*shape[:-1], shape[-1] * 2)
    return shape


def _stored_dtype(qtype: GGMLQuantizationType) -> np.dtype:
    return {GGMLQuantizationType.Q8_0: np.dtype(np.uint8), GGMLQuantizationType.BF16: np.dtype(np.uint8),
            GGMLQuantizationType.F16: np.dtype(np.float16)}.get(qtype, np.dtype(np.float32))
