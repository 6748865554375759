"""Write a GGUF file with the metadata keys and tensor layout llama.cpp reads for `config.arch`.

For phi3 that is exactly Phi-4-mini's layout. The one GGUF writer of the project: the synthetic
fixtures (random weights, `synthetic.py`) and the trained tiny model
(`scripts/train_tiny_model.py`) both go through `write_gguf`, so they share every key, tensor
order and encoding. Tensors arrive as row-chunk generators and are
encoded and written one chunk at a time, so a 3.8B-parameter file needs a few hundred MB.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize as gguf_quantize

from ane_spec.errors import ConfigError
from ane_spec.model.config import ModelConfig, swa_flags
from ane_spec.model.gguf_file import expected_tensor_shapes, optional_tensor_shapes
from ane_spec.model.quant import Q8_0_BLOCK, Q8_0_BLOCK_BYTES, q8_0_quantize
from ane_spec.model.tokenizer_data import TokenizerData

#: `general.file_type` per matrix type (llama_ftype: MOSTLY_Q8_0 = 7, MOSTLY_F16 = 1, MOSTLY_BF16 = 32)
FILE_TYPES = {GGMLQuantizationType.Q8_0: 7, GGMLQuantizationType.F16: 1,
              GGMLQuantizationType.BF16: 32}

Chunks = Callable[[], Iterator[np.ndarray]]


@dataclass(frozen=True)
class TensorSource:
    """One tensor to write: numpy shape `(out, in)`, stored type, and float32 row chunks."""

    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    chunks: Chunks

    @classmethod
    def from_array(cls, values: np.ndarray, qtype: GGMLQuantizationType) -> "TensorSource":
        values = np.ascontiguousarray(values, dtype=np.float32)
        return cls(tuple(values.shape), qtype, lambda: iter([values]))


def longrope_factor_tensors(config: ModelConfig) -> dict[str, TensorSource]:
    """Phi-4-mini's two LongRoPE factor tables, scaled to `rope_dims / 2` entries.

    Short factors are all 1.0, as in Phi-4-mini. The long ones grow with the frequency index as
    the real model's do (1.0 .. ~50); a file only uses them in a window above
    `original_context_length`.
    """
    half = config.rope_dims // 2
    f32 = GGMLQuantizationType.F32
    return {"rope_factors_long.weight": TensorSource.from_array(np.geomspace(1.0, 16.0, half), f32),
            "rope_factors_short.weight": TensorSource.from_array(np.ones(half), f32)}


def llama3_rope_freqs(config: ModelConfig, factor: float = 32.0, low_freq_factor: float = 1.0,
                      high_freq_factor: float = 4.0, original_context: int = 8192
                      ) -> dict[str, TensorSource]:
    """Llama 3.1+'s `rope_freqs.weight`, computed as convert_hf_to_gguf does for
    rope_type "llama3": 1 for high frequencies, `factor` for low ones, smooth in between."""
    half = config.rope_dims // 2
    freqs = config.rope_freq_base ** -(np.arange(0, config.rope_dims, 2) / config.rope_dims)
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    out = np.empty(half)
    for j, freq in enumerate(freqs):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            out[j] = 1.0
        elif wavelen > low_wavelen:
            out[j] = factor
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor
                                                                       - low_freq_factor)
            out[j] = 1 / ((1 - smooth) / factor + smooth)
    return {"rope_freqs.weight": TensorSource.from_array(out, GGMLQuantizationType.F32)}


def write_gguf(path: str | os.PathLike[str], config: ModelConfig, vocab: TokenizerData,
                    tensors: Mapping[str, TensorSource], *, name: str,
                    progress: Callable[[str, int, int], None] | None = None) -> Path:
    """Write a phi3 GGUF at `path` atomically (a temp file renamed at the end).

    `tensors` must hold exactly the two LongRoPE tables and every tensor `config` implies, with
    their shapes; they are written in the given order. Matrices share one stored type, which sets
    `general.file_type`.
    """
    _check_tensors(config, vocab, tensors, name)
    matrix_types = {t.qtype for t in tensors.values() if len(t.shape) == 2}
    file_type = FILE_TYPES[matrix_types.pop()]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        writer = GGUFWriter(tmp, config.arch)
        _add_metadata(writer, config, vocab, name, file_type)
        for tname, t in tensors.items():
            writer.add_tensor_info(tname, _stored_shape(t.shape, t.qtype), _stored_dtype(t.qtype),
                                   _nbytes(t.shape, t.qtype), raw_dtype=t.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        fout = writer.fout[0]
        total = len(tensors)
        for n, (tname, t) in enumerate(tensors.items()):
            writer.write_padding(fout, fout.tell())
            rows = 0
            for chunk in t.chunks():
                rows += chunk.shape[0] if chunk.ndim == 2 else 1
                _encode(chunk, t.qtype).tofile(fout)
            expected_rows = t.shape[0] if len(t.shape) == 2 else 1
            if rows != expected_rows:
                raise ConfigError(f"tensor {tname}: its chunks gave {rows} rows, "
                                  f"expected {expected_rows}")
            writer.write_padding(fout, fout.tell())
            if progress:
                progress(tname, n + 1, total)
        writer.close()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _check_tensors(config: ModelConfig, vocab: TokenizerData,
                   tensors: Mapping[str, TensorSource], name: str) -> None:
    # llama.cpp (llama-vocab.cpp) gives Phi-3 special tokens extra attributes when general.name
    # contains "phi3" or "phi-3", and then aborts the load if "</s>", "<unk>" or "<s>" is
    # missing, which a Phi-4-mini vocabulary lacks. Real Phi-4-mini files are named otherwise.
    if "phi3" in name.lower() or "phi-3" in name.lower():
        raise ConfigError(f"model name {name!r} contains 'phi3'/'phi-3': llama.cpp would then "
                          "require Phi-3's </s>, <unk> and <s> tokens and refuse the file")
    if len(vocab.tokens) != config.vocab_size:
        raise ConfigError(f"the vocabulary has {len(vocab.tokens)} tokens but the config says "
                          f"vocab_size {config.vocab_size}")
    required = expected_tensor_shapes(config)
    expected = optional_tensor_shapes(config) | required
    missing, extra = sorted(set(required) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ConfigError(f"tensor set differs from the {config.arch} layout: missing "
                          f"{missing[:3]}, unexpected {extra[:3]}")
    for tname, t in tensors.items():
        if t.shape != expected[tname]:
            raise ConfigError(f"tensor {tname} has shape {t.shape}, expected {expected[tname]}")
        if len(t.shape) == 1 and t.qtype != GGMLQuantizationType.F32:
            raise ConfigError(f"tensor {tname} is a vector and must be stored as F32")
    if len({t.qtype for t in tensors.values() if len(t.shape) == 2}) != 1:
        raise ConfigError("all matrices must share one stored type (it sets general.file_type)")


def _add_metadata(w: GGUFWriter, c: ModelConfig, vocab: TokenizerData, name: str,
                  file_type: int) -> None:
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_context_length(c.context_length)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.ffn_size)
    w.add_block_count(c.num_layers)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    if c.q_dim != c.hidden_size or c.architecture.swa_pattern:  # Gemma 3's converter always does
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_eps)
    w.add_rope_dimension_count(c.rope_dims)
    w.add_rope_freq_base(c.rope_freq_base)
    if c.rope_freq_scale != 1.0:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(1.0 / c.rope_freq_scale)
    if c.architecture.rope_factors == "longrope":  # Phi-4-mini's keys, as its converter writes
        w.add_rope_scaling_attn_factors(c.rope_attn_factor)
        w.add_rope_scaling_orig_ctx_len(c.original_context_length)
        w.add_sliding_window(262144)
    elif c.rope_attn_factor != 1.0:
        w.add_rope_scaling_attn_factors(c.rope_attn_factor)
    if c.sliding_window:
        _add_sliding_window(w, c)

    w.add_tokenizer_model(vocab.model)
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.token_types)
    w.add_token_merges(vocab.merges)
    for key, value in (("bos", vocab.bos_token_id), ("eos", vocab.eos_token_id),
                       ("unk", vocab.unknown_token_id), ("pad", vocab.padding_token_id)):
        if value is not None:
            getattr(w, f"add_{key}_token_id")(value)
    w.add_add_bos_token(vocab.add_bos_token)
    w.add_add_eos_token(vocab.add_eos_token)
    if vocab.scores is not None:  # SentencePiece merges go by them
        w.add_token_scores(vocab.scores)
    if vocab.model == "llama" or vocab.add_space_prefix:  # the reader's default is the model's
        w.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def _add_sliding_window(w: GGUFWriter, c: ModelConfig) -> None:
    """The window, the local RoPE base, and the layer pattern as its converter writes it: no
    pattern key when the family's default gives the flags, else the period, else the flags."""
    w.add_sliding_window(c.sliding_window)
    w.add_rope_freq_base_swa(c.rope_freq_base_swa)
    if c.swa_layers == swa_flags(c.architecture.swa_pattern, c.num_layers):
        return
    period = next((n for n in range(c.num_layers + 1)
                   if swa_flags(n, c.num_layers) == c.swa_layers), None)
    w.add_sliding_window_pattern(period if period is not None else list(c.swa_layers))


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
