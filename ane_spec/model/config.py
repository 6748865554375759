"""Phi-4-mini hyper-parameters as read from GGUF metadata (llama.cpp architecture `phi3`)."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from ane_spec.errors import ConfigError, describe

ARCH = "phi3"


class ModelConfig(BaseModel):
    """Everything the forward pass needs to know about shapes and constants.

    Field names follow mlx-lm/HF, not the GGUF keys; `from_gguf_metadata` does the mapping.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_dims: int
    ffn_size: int
    vocab_size: int
    context_length: int
    original_context_length: int
    rope_freq_base: float = 10000.0
    rope_attn_factor: float = 1.0
    rms_eps: float = 1e-5
    tied_embeddings: bool = True

    @model_validator(mode="after")
    def _check_consistency(self) -> "ModelConfig":
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "rope_dims", "ffn_size", "vocab_size", "context_length",
                    "original_context_length")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"num_heads ({self.num_heads}) x head_dim ({self.head_dim}) != hidden_size "
                f"({self.hidden_size})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise ValueError(f"rope_dims ({self.rope_dims}) must be even and <= head_dim "
                             f"({self.head_dim})")
        # Q8_0 blocks are 32 wide along the input axis of every matrix.
        for name in ("hidden_size", "ffn_size"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of 32")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise ValueError(f"rms_eps must be a positive finite number, got {self.rms_eps}")
        for name in ("rope_attn_factor", "rope_freq_base"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        return self

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // gqa_group."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.hidden_size + 2 * self.kv_dim

    def num_parameters(self) -> int:
        d, f = self.hidden_size, self.ffn_size
        per_layer = 2 * d + self.qkv_rows * d + d * d + 2 * f * d + d * f
        head = 0 if self.tied_embeddings else self.vocab_size * d
        # Counted like HF's num_parameters: the LongRoPE factor tables are buffers, not weights.
        return self.vocab_size * d + d + self.num_layers * per_layer + head

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_size: int,
                           tied_embeddings: bool) -> "ModelConfig":
        """Map `phi3.*` keys to a validated config, naming the key on any problem."""
        p = ARCH + "."

        def value(key: str, kind: type, default: Any) -> Any:
            if p + key not in meta:
                if default is None:
                    raise ConfigError(f"GGUF metadata is missing required key '{p + key}'")
                return default
            v = meta[p + key]
            # GGUF stores integers and floats as typed values; bool is an int only in Python.
            number, what = ((int,), "an integer") if kind is int else ((int, float), "a number")
            if not isinstance(v, number) or isinstance(v, bool):
                raise ConfigError(f"'{p + key}' must be {what}, not {describe(v)}")
            return kind(v)

        def need(key: str, kind: type = int) -> Any:
            return value(key, kind, None)

        hidden = need("embedding_length")
        heads = need("attention.head_count")
        if heads <= 0 or hidden % heads:
            raise ConfigError(f"'{p}attention.head_count' ({heads}) does not divide "
                              f"'{p}embedding_length' ({hidden})")
        head_dim = hidden // heads
        context = need("context_length")
        values = dict(
            hidden_size=hidden,
            num_layers=need("block_count"),
            num_heads=heads,
            num_kv_heads=value("attention.head_count_kv", int, heads),
            head_dim=head_dim,
            rope_dims=value("rope.dimension_count", int, head_dim),
            ffn_size=need("feed_forward_length"),
            vocab_size=vocab_size,
            context_length=context,
            original_context_length=value("rope.scaling.original_context_length", int, context),
            rope_freq_base=value("rope.freq_base", float, 10000.0),
            # llama.cpp's default when the key is absent is 1.0 (no scaling).
            rope_attn_factor=value("rope.scaling.attn_factor", float, 1.0),
            rms_eps=need("attention.layer_norm_rms_epsilon", float),
            tied_embeddings=tied_embeddings,
        )
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigError(f"inconsistent model config in GGUF metadata: {first_error(exc)}") from None


def longrope_attn_factor(context_length: int, original_context_length: int) -> float:
    """The attention factor HF/llama.cpp derive for LongRoPE: sqrt(1 + ln(scale) / ln(orig))."""
    scale = context_length / original_context_length
    if scale <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(scale) / math.log(original_context_length))


def first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        return str(first.get("msg", exc)).removeprefix("Value error, ")
    return str(exc)
