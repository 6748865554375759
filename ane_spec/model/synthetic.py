"""Write synthetic GGUF files of any supported architecture (Phi-4-mini's layout by default).

There are no real weights on the machines this project is tested on, so fixtures and benchmarks
are files the real loading code reads: the same metadata keys, tensor names, types and shapes as
`Phi-4-mini-instruct.Q8_0.gguf` (or a Llama 3 / Qwen file for `arch`), a real byte-level BPE
vocabulary with the family's special tokens, random but well-scaled weights.

Tensors are generated in row chunks and written by the project's one GGUF writer
(`gguf_writer.write_gguf`, which the trained tiny model also goes through), so writing the
3.8B-param preset needs a few hundred MB, not the 15 GB its fp32 weights would take.

Two fixture regimes matter (see the contract doc's "Synthetic fixtures: two traps"):
- `embed_std=1, branch_scale=1` is well conditioned: use it to compare logits with llama.cpp;
- the default `embed_std=0.05, branch_scale=4` keeps a random model's greedy output varied
  instead of repeating the input token, which decode and drafting tests need.
Gemma 3 differs: its embeddings are scaled by sqrt(hidden) and its post-norms undo
`branch_scale`, so its regimes are set by `embed_std` alone (tests/test_gemma3*.py: 0.25 for
logit comparisons, 0.02 for varied greedy output, on the 160-wide `gemma3-tiny`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import numpy as np
from gguf import GGMLQuantizationType
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ane_spec.errors import ConfigError

from ane_spec.model.architectures import ARCHITECTURES
from ane_spec.model.config import (
    ModelConfig,
    first_error,
    gemma3_query_scale,
    longrope_attn_factor,
    swa_flags,
)
from ane_spec.model.gguf_file import expected_tensor_shapes
from ane_spec.model.gguf_writer import (
    Chunks,
    TensorSource,
    llama3_rope_freqs,
    longrope_factor_tensors,
    write_gguf,
)
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
    rope_dims: int | None = None     # None: all of head_dim
    arch: str = "phi3"
    head_dim: int | None = None      # None: hidden_size / num_heads (written as key_length if not)
    rope_freqs: bool = False         # llama: write Llama 3.1's rope_freqs tensor, computed
                                     # for original_context_length (8192 in Llama 3.2)
    context_length: int = 131072
    original_context_length: int = 4096
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0     # 1 / linear rope.scaling.factor (Gemma 3 4B: 1/8)
    # Sliding-window families (gemma3): the window (0: none), the local/global period (None:
    # the family's default) and the local layers' RoPE base.
    sliding_window: int = 0
    swa_pattern: int | None = None
    rope_freq_base_swa: float = 10000.0
    rms_eps: float = 1e-5
    embed_std: float = 0.05
    branch_scale: float = 4.0
    weight_type: WeightType = "q8_0"
    tied_embeddings: bool = True
    seed: int = 0

    @model_validator(mode="after")
    def _valid(self) -> "SyntheticSpec":
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {self.arch!r}; choose one of "
                             f"{', '.join(ARCHITECTURES)}")
        if self.rope_freqs and ARCHITECTURES[self.arch].rope_factors != "freqs":
            raise ValueError(f"rope_freqs is a llama tensor; {self.arch} has none")
        if self.sliding_window and not ARCHITECTURES[self.arch].swa_pattern:
            raise ValueError(f"{self.arch} has no sliding-window layers")
        self.to_config()  # raises on inconsistent shapes
        return self

    def to_config(self) -> ModelConfig:
        head_dim = self.head_dim or self.hidden_size // self.num_heads
        longrope = ARCHITECTURES[self.arch].rope_factors == "longrope"
        # Only LongRoPE files carry original_context_length and the attention factor.
        original = self.original_context_length if longrope else self.context_length
        a = ARCHITECTURES[self.arch]
        window: dict[str, object] = {}
        if self.arch == "gemma3":
            window["query_scale"] = gemma3_query_scale(self.num_layers, self.hidden_size,
                                                       self.num_heads, head_dim)
        if self.sliding_window:
            pattern = a.swa_pattern if self.swa_pattern is None else self.swa_pattern
            window |= dict(sliding_window=self.sliding_window,
                           swa_layers=swa_flags(pattern, self.num_layers),
                           rope_freq_base_swa=self.rope_freq_base_swa)
        return ModelConfig(
            arch=self.arch, hidden_size=self.hidden_size, num_layers=self.num_layers,
            num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=head_dim,
            rope_dims=self.rope_dims or head_dim, ffn_size=self.ffn_size,
            vocab_size=self.vocab_size, context_length=self.context_length,
            original_context_length=original, rope_freq_base=self.rope_freq_base,
            rope_attn_factor=longrope_attn_factor(self.context_length, original),
            rms_eps=self.rms_eps, tied_embeddings=self.tied_embeddings,
            rope_freq_scale=self.rope_freq_scale, **window)


PRESETS: dict[str, SyntheticSpec] = {
    # The dims the contract doc's trap measurements used: 3 layers, d=192, GQA 3, rotary 3/4.
    "tiny": SyntheticSpec(hidden_size=192, num_layers=3, num_heads=6, num_kv_heads=2,
                          ffn_size=512, vocab_size=1024, rope_dims=24),
    "small": SyntheticSpec(hidden_size=384, num_layers=4, num_heads=6, num_kv_heads=2,
                           ffn_size=1024, vocab_size=4096, rope_dims=48),
    "phi4-mini": SyntheticSpec(hidden_size=3072, num_layers=32, num_heads=24, num_kv_heads=8,
                               ffn_size=8192, vocab_size=200064, rope_dims=96),
    # The real shapes of the small models people run locally (their HF config.json files).
    "llama-3.2-1b": SyntheticSpec(arch="llama", hidden_size=2048, num_layers=16, num_heads=32,
                                  num_kv_heads=8, ffn_size=8192, vocab_size=128256,
                                  rope_freq_base=500000.0, rope_freqs=True,
                                  original_context_length=8192),
    "llama-3.2-3b": SyntheticSpec(arch="llama", hidden_size=3072, num_layers=28, num_heads=24,
                                  num_kv_heads=8, ffn_size=8192, vocab_size=128256,
                                  rope_freq_base=500000.0, rope_freqs=True,
                                  original_context_length=8192),
    "qwen2.5-3b": SyntheticSpec(arch="qwen2", hidden_size=2048, num_layers=36, num_heads=16,
                                num_kv_heads=2, ffn_size=11008, vocab_size=151936,
                                context_length=32768, rope_freq_base=1000000.0, rms_eps=1e-6),
    "qwen3-4b": SyntheticSpec(arch="qwen3", hidden_size=2560, num_layers=36, num_heads=32,
                              num_kv_heads=8, head_dim=128, ffn_size=9728, vocab_size=151936,
                              context_length=40960, rope_freq_base=1000000.0, rms_eps=1e-6),
    # Gemma 3 text models (HF config.json): head_dim 256, window 512 (4B: 1024), five local
    # layers to one global, local RoPE base 10000, global 1e6; the 4B scales global RoPE
    # linearly by 8 and its GGUF vocabulary is padded to 262,208 entries.
    "gemma-3-270m": SyntheticSpec(arch="gemma3", hidden_size=640, num_layers=18, num_heads=4,
                                  num_kv_heads=1, head_dim=256, ffn_size=2048,
                                  vocab_size=262144, context_length=32768,
                                  rope_freq_base=1000000.0, sliding_window=512, rms_eps=1e-6),
    "gemma-3-1b": SyntheticSpec(arch="gemma3", hidden_size=1152, num_layers=26, num_heads=4,
                                num_kv_heads=1, head_dim=256, ffn_size=6912, vocab_size=262144,
                                context_length=32768, rope_freq_base=1000000.0,
                                sliding_window=512, rms_eps=1e-6),
    "gemma-3-4b": SyntheticSpec(arch="gemma3", hidden_size=2560, num_layers=34, num_heads=8,
                                num_kv_heads=4, head_dim=256, ffn_size=10240, vocab_size=262208,
                                context_length=131072, rope_freq_base=1000000.0,
                                rope_freq_scale=0.125, sliding_window=1024, rms_eps=1e-6),
    # Odd-sized on purpose: q is 192 wide on a 160-wide stream, 4 layers with a period of 3
    # (local, local, global, local) and a window of 8, so short prompts cross it.
    "gemma3-tiny": SyntheticSpec(arch="gemma3", hidden_size=160, num_layers=4, num_heads=3,
                                 num_kv_heads=1, head_dim=64, ffn_size=352, vocab_size=1031,
                                 context_length=4096, rope_freq_base=1000000.0,
                                 rope_freq_scale=0.5, sliding_window=8, swa_pattern=3,
                                 rms_eps=1e-6),
}


def preset(name: str, **overrides: object) -> SyntheticSpec:
    """A preset with some fields replaced (None means keep the preset's value)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of {', '.join(PRESETS)}")
    values = PRESETS[name].model_dump() | {k: v for k, v in overrides.items() if v is not None}
    # Another architecture, or other head shapes, with no rope_dims given: rotate what the
    # architecture rotates (all of head_dim outside phi3) instead of the preset's count.
    if overrides.get("rope_dims") is None and (
            values["arch"] != PRESETS[name].arch
            or any(overrides.get(k) is not None for k in ("hidden_size", "num_heads", "head_dim"))):
        if not ARCHITECTURES[values["arch"]].partial_rotary:
            values["rope_dims"] = None
    if values.get("rope_freqs") and ARCHITECTURES[values["arch"]].rope_factors != "freqs":
        values["rope_freqs"] = False
    if not ARCHITECTURES[values["arch"]].swa_pattern:  # a Gemma preset as another family
        values |= {"sliding_window": 0, "swa_pattern": None}
    try:
        return SyntheticSpec(**values)
    except ValidationError as exc:
        raise ConfigError(f"invalid synthetic model: {first_error(exc)}") from None


def write_synthetic_gguf(path: str | os.PathLike[str], spec: SyntheticSpec,
                         progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write `spec` as a GGUF file at `path` (atomically: a temp file renamed at the end)."""
    config = spec.to_config()
    family = config.architecture.vocab_family
    name = "synthetic-phi4-mini" if spec.arch == "phi3" else f"synthetic-{spec.arch}"
    return write_gguf(path, config, build_synthetic_vocab(spec.vocab_size, family=family),
                      _tensor_plan(spec, config), name=name, progress=progress)


def _tensor_plan(spec: SyntheticSpec, c: ModelConfig) -> dict[str, TensorSource]:
    """Name -> tensor source, in the order llama.cpp writes them."""
    root = np.random.SeedSequence(spec.seed)
    matrix_type = {"q8_0": GGMLQuantizationType.Q8_0, "f16": GGMLQuantizationType.F16,
                   "bf16": GGMLQuantizationType.BF16}[spec.weight_type]
    f32 = GGMLQuantizationType.F32
    shapes = expected_tensor_shapes(c)
    factors = c.architecture.rope_factors
    plan = (longrope_factor_tensors(c) if factors == "longrope"
            else llama3_rope_freqs(c, original_context=spec.original_context_length)
            if spec.rope_freqs else {})
    # One child seed per tensor: a tensor's values do not depend on the tensors written before it.
    for (name, shape), rng_seed in zip(shapes.items(), root.spawn(len(shapes))):
        if name.endswith(".bias"):
            plan[name] = TensorSource(shape, f32, _bias_maker(shape, rng_seed))
            continue
        if len(shape) == 1:
            plan[name] = TensorSource(shape, f32, _norm_maker(shape, rng_seed))
            continue
        std = 1.0 / np.sqrt(shape[1])
        if name in ("token_embd.weight", "output.weight"):
            std = spec.embed_std
        elif name.endswith(("attn_output.weight", "ffn_down.weight")):
            std *= spec.branch_scale
        plan[name] = TensorSource(shape, matrix_type, _gaussian_maker(shape, std, rng_seed))
    return plan


def _norm_maker(shape: tuple[int, ...], seed: np.random.SeedSequence) -> Chunks:
    # Not all ones, so a graph that forgets to multiply by the norm weight is caught.
    return lambda: iter([np.random.default_rng(seed).uniform(0.8, 1.2, shape).astype(np.float32)])


def _bias_maker(shape: tuple[int, ...], seed: np.random.SeedSequence) -> Chunks:
    # Large enough that a graph which drops a bias fails every logit comparison.
    return lambda: iter([np.random.default_rng(seed).uniform(-0.5, 0.5, shape).astype(np.float32)])


def _gaussian_maker(shape: tuple[int, ...], std: float, seed: np.random.SeedSequence) -> Chunks:
    rows_per_chunk = max(1, CHUNK_ELEMENTS // shape[1])

    def chunks() -> Iterator[np.ndarray]:
        rng = np.random.default_rng(seed)
        for start in range(0, shape[0], rows_per_chunk):
            rows = min(rows_per_chunk, shape[0] - start)
            yield rng.standard_normal((rows, shape[1]), dtype=np.float32) * np.float32(std)

    return chunks
