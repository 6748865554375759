"""Model hyper-parameters as read from GGUF metadata, the way llama.cpp's loader reads them.

`arch` names the architecture (architectures/); the keys are `<arch>.*` for every family.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from ane_spec.errors import ConfigError, describe, untrusted
from ane_spec.model.architectures import ARCHITECTURES, Architecture

ARCH = "phi3"  # the flagship's architecture, the default of every config
# `rope.scaling.type` values the RoPE tables here reproduce. yarn changes theta per dimension
# and scales attention; it is refused rather than run wrongly.
_ROPE_SCALING_TYPES = ("none", "linear")


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
    arch: str = ARCH
    # llama.cpp's freq_scale = 1 / rope.scaling.factor (linear scaling); 1.0 without the key.
    rope_freq_scale: float = 1.0
    # Sliding-window attention (Gemma 3): a local layer's row at position p sees key positions
    # p - W < k <= p (llama_hparams::is_masked_swa hides p - k >= W). 0: no local layers.
    sliding_window: int = 0
    # One flag per layer, True for local (sliding-window) layers; empty without a window.
    swa_layers: tuple[bool, ...] = ()
    # Local layers' RoPE: llama.cpp's rope_freq_base_train_swa (default 10000) with
    # rope_freq_scale_train_swa = 1, whatever linear scaling the global layers get.
    rope_freq_base_swa: float = 10000.0
    # The factor q is multiplied by before q.k (llama.cpp's f_attention_scale); None means
    # 1/sqrt(head_dim), what every other family's build_attn uses.
    query_scale: float | None = None

    @model_validator(mode="after")
    def _check_consistency(self) -> "ModelConfig":
        positive = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                    "rope_dims", "ffn_size", "vocab_size", "context_length",
                    "original_context_length")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"architecture {self.arch!r} is not supported; supported: "
                             f"{', '.join(ARCHITECTURES)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) is not a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.rope_dims % 2 or self.rope_dims > self.head_dim:
            raise ValueError(f"rope_dims ({self.rope_dims}) must be even and <= head_dim "
                             f"({self.head_dim})")
        if self.rope_dims != self.head_dim and not self.architecture.partial_rotary:
            # llama.cpp: "invalid n_rot" (llama) or GGML_ASSERT(n_embd_head == n_rot) (qwen2/3).
            raise ValueError(f"rope_dims ({self.rope_dims}) must equal head_dim "
                             f"({self.head_dim}) for architecture {self.arch}")
        # Q8_0 blocks are 32 wide along the input axis of every matrix.
        for name in ("hidden_size", "ffn_size", "q_dim"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of 32")
        if not (self.rms_eps > 0 and math.isfinite(self.rms_eps)):
            raise ValueError(f"rms_eps must be a positive finite number, got {self.rms_eps}")
        for name in ("rope_attn_factor", "rope_freq_base", "rope_freq_scale",
                     "rope_freq_base_swa"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        if self.query_scale is not None and not (
                self.query_scale > 0 and math.isfinite(self.query_scale)):
            raise ValueError(f"query_scale must be a positive finite number, got "
                             f"{self.query_scale}")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")
        if (self.sliding_window > 0) != bool(self.swa_layers):
            raise ValueError("sliding_window and swa_layers go together: a window needs the "
                             "per-layer flags and the flags need a window")
        if self.swa_layers and len(self.swa_layers) != self.num_layers:
            raise ValueError(f"swa_layers has {len(self.swa_layers)} flags for "
                             f"{self.num_layers} layers")
        return self

    @property
    def architecture(self) -> Architecture:
        return ARCHITECTURES[self.arch]

    @property
    def attention_scale(self) -> float:
        """What q is multiplied by before q.k."""
        return self.query_scale if self.query_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def is_local(self, layer: int) -> bool:
        """Whether `layer` attends over the sliding window only (and uses the local RoPE)."""
        return bool(self.swa_layers) and self.swa_layers[layer]

    @property
    def has_local_layers(self) -> bool:
        return any(self.swa_layers)

    @property
    def gqa_group(self) -> int:
        """Query heads per KV head: query head h reads KV head h // gqa_group."""
        return self.num_heads // self.num_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def q_dim(self) -> int:
        """Query width, num_heads x head_dim: hidden_size except where key_length says otherwise
        (Qwen3-4B: 32 x 128 = 4096 on a 2560-wide residual stream)."""
        return self.num_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_dim + 2 * self.kv_dim

    def num_parameters(self) -> int:
        d, f, a = self.hidden_size, self.ffn_size, self.architecture
        per_layer = 2 * d + self.qkv_rows * d + self.q_dim * d + 2 * f * d + d * f
        per_layer += (self.qkv_rows if a.qkv_bias else 0) + (2 * self.head_dim if a.qk_norm else 0)
        per_layer += 2 * d if a.post_norms else 0
        head = 0 if self.tied_embeddings else self.vocab_size * d
        # Counted like HF's num_parameters: the LongRoPE factor tables are buffers, not weights.
        return self.vocab_size * d + d + self.num_layers * per_layer + head

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], *, vocab_size: int,
                           tied_embeddings: bool, arch: str = ARCH) -> "ModelConfig":
        """Map `<arch>.*` keys to a validated config, naming the key on any problem.

        Defaults are llama.cpp's (llama_model::load_hparams): head_dim = key_length or
        hidden / heads, rope dims = rope.dimension_count or head_dim, freq_scale =
        1 / rope.scaling.factor, attention factor 1.
        """
        p = arch + "."

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
        if p + "attention.key_length" in meta:
            head_dim = need("attention.key_length")
            if head_dim <= 0:
                raise ConfigError(f"'{p}attention.key_length' must be positive, got {head_dim}")
        elif heads <= 0 or hidden % heads:
            raise ConfigError(f"'{p}attention.head_count' ({heads}) does not divide "
                              f"'{p}embedding_length' ({hidden})")
        else:
            head_dim = hidden // heads
        value_dim = value("attention.value_length", int, head_dim)
        if value_dim != head_dim:
            raise ConfigError(f"'{p}attention.value_length' ({value_dim}) differs from the key "
                              f"length ({head_dim}); every supported graph needs them equal")
        scaling = meta.get(p + "rope.scaling.type", "none")
        allowed = _ROPE_SCALING_TYPES + (
            ("longrope",) if ARCHITECTURES.get(arch) and ARCHITECTURES[arch].rope_factors
            == "longrope" else ())
        if scaling not in allowed:
            raise ConfigError(f"'{p}rope.scaling.type' is {untrusted(scaling)}; supported: "
                              f"{', '.join(allowed)}")
        factor = value("rope.scaling.factor", float, 0.0) or value("rope.scale_linear", float, 0.0)
        context = need("context_length")
        window = _sliding_window(meta, p, value, arch)
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
            arch=arch,
            rope_freq_scale=1.0 / factor if factor else 1.0,
            **window,
        )
        try:
            return cls(**values)
        except ValueError as exc:
            raise ConfigError(f"inconsistent model config in GGUF metadata: {first_error(exc)}") from None


def _sliding_window(meta: dict[str, Any], p: str, value: Any, arch: str
                    ) -> dict[str, Any]:
    """The sliding-window fields, read as llama.cpp's gemma3 load_arch_hparams does.

    Families without local layers (swa_pattern 0) ignore the keys, as their llama.cpp loaders
    do (Phi-4-mini's files carry a window of 262144 that its graph never uses). Gemma 3's query
    scale is set here too: llama.cpp derives it from the layer count (27B: n_embd / n_head).
    """
    a = ARCHITECTURES.get(arch)
    if a is None or not a.swa_pattern:
        return {}
    out: dict[str, Any] = {}
    layers = value("block_count", int, None)
    if arch == "gemma3":
        softcap = value("final_logit_softcapping", float, 0.0)
        if softcap:
            raise ConfigError(f"'{p}final_logit_softcapping' is {softcap}: the tanh logit cap "
                              "is not implemented (Gemma 3 files have none)")
        hidden, heads = value("embedding_length", int, None), value("attention.head_count", int,
                                                                     None)
        key_length = value("attention.key_length", int, hidden // heads if heads > 0 else 0)
        if heads > 0 and key_length > 0:  # else the config's own checks name the problem
            out["query_scale"] = gemma3_query_scale(layers, hidden, heads, key_length)
    window = value("attention.sliding_window", int, 0)
    if window <= 0:  # llama.cpp: no key or 0 -> LLAMA_SWA_TYPE_NONE
        return out
    key = p + "attention.sliding_window_pattern"
    pattern = meta.get(key, a.swa_pattern)
    if isinstance(pattern, list):  # one flag per layer (load_swa_pattern's get_arr)
        if len(pattern) != layers or not all(isinstance(f, (bool, int)) for f in pattern):
            raise ConfigError(f"'{key}' must hold one boolean per layer ({layers}), got "
                              f"{describe(pattern)}")
        flags = tuple(bool(f) for f in pattern)
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        flags = swa_flags(pattern, max(layers, 0))
    else:
        raise ConfigError(f"'{key}' must be a non-negative integer or a boolean array, not "
                          f"{describe(pattern)}")
    out |= dict(sliding_window=window, swa_layers=flags,
                rope_freq_base_swa=value("rope.freq_base_swa", float, 10000.0))
    return out


def gemma3_query_scale(layers: int, hidden: int, heads: int, head_dim: int) -> float:
    """gemma3.cpp's f_attention_scale: 1/sqrt(key_length), except for the 27B (62 layers,
    LLM_TYPE_27B), which uses 1/sqrt(n_embd / n_head) (gemma_pytorch's config)."""
    return 1.0 / math.sqrt(hidden // heads if layers == 62 else head_dim)


def swa_flags(pattern: int, layers: int) -> tuple[bool, ...]:
    """llama_hparams::set_swa_pattern: layer il is local unless il % n == n - 1 (n = 0: all)."""
    return tuple(pattern == 0 or il % pattern < pattern - 1 for il in range(layers))


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
