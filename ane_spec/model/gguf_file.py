"""Read a GGUF file of a supported architecture: validated config, lazy tensors, tokenizer data.

The file is memory-mapped once (gguf_format.py); every tensor accessor returns a view into that
map, so opening even a 4 GB file costs only its metadata. Validation happens up front so that a
truncated, foreign or mis-shaped file fails at `open_gguf` with a message naming the problem,
not later inside a matmul.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from pydantic import ValidationError

from ane_spec.content_digest import DIGEST, new_hasher
from ane_spec.errors import ConfigError, GGUFError, TokenizerError, describe, untrusted
from ane_spec.model.architectures import get_architecture
from ane_spec.model.config import ModelConfig, first_error
from ane_spec.model.gguf_format import GGUFContents, file_identity, read_gguf
from ane_spec.model.pre_tokenizers import default_add_bos, forced_add_bos
from ane_spec.model.quant import (
    DEQUANTIZABLE,
    FLOAT_TYPES,
    bf16_to_float32,
    dequantize_rows,
    q8_0_blocks,
    q8_0_dequantize,
)
from ane_spec.model.rope import RopeSpec, make_rope_spec
from ane_spec.model.tokenizer_data import TokenizerData, strip_rule_for_name

# Every type gguf-py can dequantize (quant.py): the float types, the legacy and K-quants, the
# IQ, ternary and FP4 types. Q8_0 and the float types keep zero-copy fast paths.
SUPPORTED_TYPES = {t: t.name for t in sorted(DEQUANTIZABLE, key=lambda t: t.value)}


@dataclass(frozen=True)
class Tensor:
    """One tensor of the file, backed by the memmap. `shape` is numpy order (out, in)."""

    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]
    raw: np.ndarray  # uint8 bytes for quantized/bf16 types, typed elements otherwise
    file_offset: int = 0
    mapping: mmap.mmap | None = None

    @property
    def type_name(self) -> str:
        return SUPPORTED_TYPES[self.type]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def is_q8_0(self) -> bool:
        return self.type == GGMLQuantizationType.Q8_0

    def q8_0(self) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy Q8_0 views: int8 `qs` `[out, in/32, 32]` and fp16 scales `[out, in/32]`.

        `qs[r].reshape(-1)` is row r of the int8 `[out, in]` matrix; the block axis is kept
        because the 2-byte scales between blocks make a flat `[out, in]` view impossible.
        """
        if not self.is_q8_0:
            raise GGUFError(f"tensor '{self.name}' is {self.type_name}, not Q8_0")
        blocks = q8_0_blocks(self.raw, self.shape[-1])
        return blocks["qs"], blocks["d"]

    @property
    def is_float(self) -> bool:
        """F32, F16 or BF16: values, not blocks (nothing to requantize from)."""
        return self.type in FLOAT_TYPES

    def rows(self, index: np.ndarray | list[int], dtype: np.dtype = np.float32) -> np.ndarray:
        """Dequantize selected rows only (embedding lookup, chunked head): `[len(index), in]`.

        Costs the selected rows only, whatever the type: a block type's rows are whole blocks
        (gguf_format checked that every row is a whole number of blocks), so the row's bytes go
        through gguf-py's own `dequantize` and nothing else of the tensor is touched."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if self.is_q8_0:
            qs, d = self.q8_0()
            return q8_0_dequantize(qs[idx], d[idx], dtype)
        if self.type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                         GGMLQuantizationType.BF16):
            return self._widen(self.raw.reshape(self.shape[0], -1)[idx]).astype(dtype, copy=False)
        rows = self.raw.reshape(self.shape[0], -1)[idx]
        return dequantize_rows(rows, self.type, self.shape[-1]).astype(dtype, copy=False)

    def rows_per_chunk(self, budget_elements: int = 1 << 22) -> int:
        """Rows whose float32 values take about `budget_elements` x 4 bytes (16 MB)."""
        return max(1, budget_elements // max(1, self.shape[-1]))

    def row_chunks(self, rows_per_chunk: int, dtype: np.dtype = np.float32
                   ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (first row, float rows) in chunks, dropping each chunk's pages from this
        process's memory once read, so sweeping a 650 MB table keeps RSS at one chunk."""
        for r0 in range(0, self.shape[0], rows_per_chunk):
            r1 = min(self.shape[0], r0 + rows_per_chunk)
            yield r0, self.rows(np.arange(r0, r1), dtype)
            self.release(r0, r1)

    def release(self, first_row: int = 0, last_row: int | None = None) -> None:
        """Tell the kernel this process is done with these rows' pages (they stay in the page
        cache). Memmapped pages count in RSS, and a build touches gigabytes of them."""
        if self.mapping is None:
            return
        last_row = self.shape[0] if last_row is None else last_row
        row_bytes = self.nbytes // self.shape[0] if len(self.shape) > 1 else self.nbytes
        start = self.file_offset + first_row * (row_bytes if len(self.shape) > 1 else 0)
        end = self.file_offset + (last_row * row_bytes if len(self.shape) > 1 else self.nbytes)
        page = mmap.PAGESIZE
        start -= start % page
        end = min(len(self.mapping), -(-end // page) * page)
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def dequantize(self, dtype: np.dtype = np.float32,
                   empty: Callable[..., np.ndarray] = np.empty) -> np.ndarray:
        """The whole tensor as floats: allocates the whole float tensor (with `empty(shape,
        dtype)` for block types), so it is for vectors, tests and the reference; the build
        reads matrices with `rows`/`row_chunks`."""
        if self.is_q8_0:
            qs, d = self.q8_0()
            return q8_0_dequantize(qs, d, dtype, empty).reshape(self.shape)
        if not self.is_float:
            rows = self.raw.reshape(-1, self.raw.shape[-1])
            out = empty((rows.shape[0], self.shape[-1]), dtype)
            step = self.rows_per_chunk()
            for r0 in range(0, rows.shape[0], step):
                out[r0:r0 + step] = dequantize_rows(rows[r0:r0 + step], self.type,
                                                    self.shape[-1])
            return out.reshape(self.shape)
        return self._widen(self.raw).astype(dtype, copy=False).reshape(self.shape)

    def _widen(self, raw: np.ndarray) -> np.ndarray:
        if self.type == GGMLQuantizationType.BF16:
            return bf16_to_float32(raw).reshape(raw.shape[0], -1)
        return raw


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of `config.arch` must hold, with its numpy shape (llama.cpp's
    load_arch_tensors; optional tensors are in `optional_tensor_shapes`)."""
    shapes = _model_tensor_shapes(config)
    for i in range(config.num_layers):
        shapes |= layer_tensor_shapes(config, i)
    return shapes


def expected_tensor_count(config: ModelConfig) -> int:
    """len(expected_tensor_shapes(config)), without listing num_layers layers' names."""
    return len(_model_tensor_shapes(config)) + config.num_layers * len(
        layer_tensor_shapes(config, 0))


def _model_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = config.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.vocab_size, d),
        "output_norm.weight": (d,),
    }
    if not config.tied_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes


def layer_tensor_shapes(config: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    """The tensors of layer `i` for `config.arch`, with their numpy shapes."""
    a, d, f = config.architecture, config.hidden_size, config.ffn_size
    q, kv, p = config.q_dim, config.kv_dim, f"blk.{i}."
    shapes: dict[str, tuple[int, ...]] = {p + "attn_norm.weight": (d,)}
    if a.fused_qkv:
        shapes[p + "attn_qkv.weight"] = (config.qkv_rows, d)
    else:
        shapes |= {p + "attn_q.weight": (q, d), p + "attn_k.weight": (kv, d),
                   p + "attn_v.weight": (kv, d)}
    if a.qkv_bias:
        shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)}
    if a.qk_norm:
        shapes |= {p + "attn_q_norm.weight": (config.head_dim,),
                   p + "attn_k_norm.weight": (config.head_dim,)}
    shapes[p + "attn_output.weight"] = (d, q)
    if a.post_norms:
        shapes[p + "post_attention_norm.weight"] = (d,)
    shapes[p + "ffn_norm.weight"] = (d,)
    if a.fused_gate_up:
        shapes[p + "ffn_up.weight"] = (2 * f, d)
    else:
        shapes |= {p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d)}
    shapes[p + "ffn_down.weight"] = (d, f)
    if a.post_norms:
        shapes[p + "post_ffw_norm.weight"] = (d,)
    return shapes


def optional_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """RoPE frequency-factor tensors the architecture may carry: `[rope_dims / 2]` each."""
    half = (config.rope_dims // 2,)
    return {"longrope": {"rope_factors_long.weight": half, "rope_factors_short.weight": half},
            "freqs": {"rope_freqs.weight": half},
            "none": {}}[config.architecture.rope_factors]


class GGUFModel:
    """An opened, validated GGUF file of a supported architecture."""

    def __init__(self, path: Path, contents: GGUFContents, tensors: dict[str, Tensor],
                 config: ModelConfig):
        self.path = path
        self.version = contents.version
        self.metadata = contents.metadata
        # The whole file as uint8, zero-copy: every tensor's `raw` is a slice of it.
        self.buffer = np.frombuffer(contents.mapping, dtype=np.uint8)
        self._mapping = contents.mapping if isinstance(contents.mapping, mmap.mmap) else None
        self.tensors = tensors
        self.config = config
        self.identity = contents.identity

    def check_unchanged(self) -> None:
        """Refuse to go on if the file was modified, truncated or replaced since it was opened:
        its tensors are read through the mapping, which would mix old and new contents."""
        try:
            now = file_identity(os.stat(self.path))
        except OSError:
            now = None
        if now != self.identity:
            raise GGUFError(f"{self.path.name} changed during the build (its size, modification "
                            "time or inode differ from when it was opened); run it again")

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name}: no tensor named '{name}'") from None

    def layer(self, i: int, part: str) -> Tensor:
        return self.tensor(f"blk.{i}.{part}.weight")

    @property
    def lm_head(self) -> Tensor:
        """The tied embedding matrix, unless the file carries its own `output.weight`."""
        return self.tensors.get("output.weight") or self.tensors["token_embd.weight"]

    def rope_factors(self, which: str) -> np.ndarray:
        """`long` or `short` LongRoPE factors; all ones when the file has none (plain RoPE)."""
        t = self.tensors.get(f"rope_factors_{which}.weight")
        if t is None:
            return np.ones(self.config.rope_dims // 2, dtype=np.float32)
        return t.dequantize(np.float32)

    def rope_spec(self, context_window: int, *, local: bool = False) -> RopeSpec:
        """RoPE for a context window; for LongRoPE the window picks the factor set, as in
        llama.cpp; llama's `rope_freqs` apply at every window. `local=True`: the tables of the
        sliding-window layers (llama_model::get_rope_freq_base/scale: base_swa, scale 1)."""
        c = self.config
        if not 0 < context_window <= c.context_length:
            raise ConfigError(f"context window {context_window} is outside 1..{c.context_length} "
                              "(the model's context_length)")
        if local:
            ones = np.ones(c.rope_dims // 2, dtype=np.float32)
            return make_rope_spec(rope_dims=c.rope_dims, freq_base=c.rope_freq_base_swa,
                                  attn_factor=c.rope_attn_factor, freq_scale=1.0,
                                  original_context_length=c.original_context_length,
                                  context_window=context_window, short_factors=ones,
                                  long_factors=ones, factor_set="none")
        common = dict(rope_dims=c.rope_dims, freq_base=c.rope_freq_base,
                      attn_factor=c.rope_attn_factor, freq_scale=c.rope_freq_scale,
                      original_context_length=c.original_context_length,
                      context_window=context_window)
        if c.architecture.rope_factors == "longrope":
            return make_rope_spec(**common, short_factors=self.rope_factors("short"),
                                  long_factors=self.rope_factors("long"))
        freqs = self.tensors.get("rope_freqs.weight")
        factors = (freqs.dequantize(np.float32) if freqs is not None
                   else np.ones(c.rope_dims // 2, dtype=np.float32))
        return make_rope_spec(**common, short_factors=factors, long_factors=factors,
                              factor_set="freqs" if freqs is not None else "none")

    @cached_property
    def tokenizer_data(self) -> TokenizerData:
        return tokenizer_data_from_metadata(self.metadata, self.path.name)

    @property
    def file_type(self) -> str:
        types = {t.type_name for n, t in self.tensors.items()
                 if n.endswith(("attn_qkv.weight", "attn_q.weight"))}
        return "/".join(sorted(types)) or "unknown"

    @property
    def file_type_name(self) -> str:
        """`general.file_type` as llama.cpp and Ollama name it ("Q8_0", "Q4_K_M", "F16"), else
        the stored type of the attention matrices (also for a code gguf-py does not know)."""
        value = self.metadata.get("general.file_type")
        if isinstance(value, int) and not isinstance(value, bool):
            try:
                return LlamaFileType(value).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        return self.file_type

    @property
    def parameter_count(self) -> int:
        """Every tensor's elements, as Ollama counts a model's parameters."""
        return sum(math.prod(t.shape) for t in self.tensors.values())

    def content_hashes(self, stop: StopFlag | None = None
                       ) -> tuple[str, dict[str, str]]:
        """The whole file's content hash (content_digest.DIGEST: BLAKE3), and an XXH3-128 digest
        of each tensor's bytes, in one pass over the file.

        The build records the first (the file's identity: it was sha256, as `sha256sum` and
        publishers state it, until that was 2.5 of a Phi-4-mini build's ~26 CPU seconds; `b3sum`
        prints this one) and fingerprints each shard with the second, so a re-run rebuilds
        only what the changed tensors feed. The fingerprints only ever meet other builds of
        this project, in the build's own folder, so they need no second cryptographic pass:
        sha256 of each tensor was 2.4 s of CPU on a 4.1 GB file (1.7 GB/s here), XXH3 is 0.2 s
        (25 GB/s), and 128 bits leave no chance collision among a folder's builds. `stop`, once
        set, ends the pass at its next 64 MB block with HashingStopped (a build hashing beside
        its conversion ended)."""
        whole = new_hasher(DIGEST)
        per_tensor: dict[str, str] = {}
        pos = 0
        for t in sorted(self.tensors.values(), key=lambda t: t.file_offset):
            whole.update(self.buffer[pos:t.file_offset])
            h = xxhash.xxh3_128()
            step = 1 << 26
            for start in range(t.file_offset, t.file_offset + t.nbytes, step):
                end = min(start + step, t.file_offset + t.nbytes)
                if stop is not None and stop.is_set():
                    raise HashingStopped(f"hashing {self.path.name} stopped")
                block = self.buffer[start:end]
                whole.update(block)
                h.update(block)
                # Block by block, not tensor by tensor: a 650 MB embedding table's pages would
                # all count in RSS at once, and a build may hash while it holds a whole shard
                # of converted weights (build.py hashes while the calibration finishes).
                self._release(start, end)
            per_tensor[t.name] = h.hexdigest()
            pos = t.file_offset + t.nbytes
        whole.update(self.buffer[pos:])
        return whole.hexdigest(), per_tensor

    def _release(self, start: int, end: int) -> None:
        """Give back the file pages of bytes [start, end) (see Tensor.release)."""
        mapping = self._mapping
        if mapping is None:
            return
        page = mmap.PAGESIZE
        start -= start % page
        end = min(len(mapping), -(-end // page) * page)
        if end > start:
            mapping.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        # The mapping is unmapped when the last view into it is gone.
        self.buffer = np.empty(0, np.uint8)
        self._mapping = None
        self.tensors = {}

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StopFlag(Protocol):
    """What content_hashes asks between blocks: a threading.Event, or any flag like it."""

    def is_set(self) -> bool: ...


class HashingStopped(Exception):
    """`content_hashes` was asked to stop; nothing will read its result."""


def open_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open and validate a GGUF file of a supported architecture (architectures/)."""
    path = Path(path)
    if not path.exists():
        raise GGUFError(f"{path}: no such file")
    if not path.is_file():
        raise GGUFError(f"{path}: not a regular file")
    contents = read_gguf(os.fspath(path), path.name)
    metadata = contents.metadata
    try:
        arch = get_architecture(metadata.get("general.architecture")).name
    except GGUFError as exc:
        raise GGUFError(f"{path.name}: {exc}") from None

    tensors = _map_tensors(contents, path.name)
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path.name}: missing tensor 'token_embd.weight'")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is not None:  # its length is the vocabulary size, so its type is checked here
        bad = tokens if not isinstance(tokens, list) else next(
            (t for t in tokens if not isinstance(t, str)), None)
        if bad is not None:
            raise GGUFError(f"{path.name}: 'tokenizer.ggml.tokens' must be an array of strings"
                            + (f", not {describe(bad)}" if bad is tokens else
                               f"; it holds {describe(bad)}"))
    vocab = len(tokens) if tokens is not None else tensors["token_embd.weight"].shape[0]
    try:
        config = ModelConfig.from_gguf_metadata(
            metadata, vocab_size=vocab, tied_embeddings="output.weight" not in tensors,
            arch=arch)
    except ConfigError as exc:
        raise GGUFError(f"{path.name}: {exc}") from None
    _check_tensor_shapes(tensors, config, path.name)
    return GGUFModel(path, contents, tensors, config)


def _map_tensors(contents: GGUFContents, name: str) -> dict[str, Tensor]:
    """Views into the mapping; gguf_format has checked types, sizes and offsets already."""
    tensors: dict[str, Tensor] = {}
    for info in contents.tensors:
        qtype = info.ggml_type
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{name}: tensor {untrusted(info.name)} has type {qtype.name}, which gguf-py "
                f"cannot dequantize; supported types are {', '.join(SUPPORTED_TYPES.values())}")
        shape = tuple(int(x) for x in reversed(info.dims)) or (1,)  # a 0-dim tensor is a scalar
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            dtype = np.float32 if qtype == GGMLQuantizationType.F32 else np.float16
            raw = np.frombuffer(contents.mapping, dtype, math.prod(shape), info.offset)
            raw = raw.reshape(shape)
        else:  # block types and BF16: bytes, one row of the matrix per row of the array
            block, type_size = GGML_QUANT_SIZES[qtype]
            raw = np.frombuffer(contents.mapping, np.uint8, info.nbytes, info.offset)
            raw = raw.reshape(math.prod(shape[:-1]), shape[-1] // block * type_size)
        tensors[info.name] = Tensor(info.name, qtype, shape, raw, info.offset, contents.mapping)
    return tensors


def _check_tensor_shapes(tensors: dict[str, Tensor], config: ModelConfig, name: str) -> None:
    # Count first: block_count = 2^31 must not make us list 13 billion expected tensor names.
    needed = expected_tensor_count(config)
    if needed > len(tensors):
        raise GGUFError(f"{name}: {config.arch}.block_count is {config.num_layers:,}, which needs "
                        f"{needed:,} tensors; the file has {len(tensors):,}")
    for tname, shape in expected_tensor_shapes(config).items():
        t = tensors.get(tname)
        if t is None:
            raise GGUFError(f"{name}: missing tensor '{tname}' (expected shape {shape})")
        if t.shape != shape:
            raise GGUFError(f"{name}: tensor '{tname}' has shape {t.shape}, expected {shape}")
    for tname, shape in optional_tensor_shapes(config).items():
        t = tensors.get(tname)
        if t is not None and t.shape != shape:
            raise GGUFError(f"{name}: tensor '{tname}' has shape {t.shape}, expected {shape}")


def fim_token_ids(get: Any) -> dict[str, int]:
    """tokenizer.ggml.fim_*_token_id by kind; the deprecated prefix/suffix/middle_token_id keys
    count when present, read after the new ones as llama.cpp reads them."""
    out: dict[str, int] = {}
    for kind, key in (("pre", "fim_pre_token_id"), ("suf", "fim_suf_token_id"),
                      ("mid", "fim_mid_token_id"), ("pad", "fim_pad_token_id"),
                      ("rep", "fim_rep_token_id"), ("sep", "fim_sep_token_id"),
                      ("pre", "prefix_token_id"), ("suf", "suffix_token_id"),
                      ("mid", "middle_token_id")):
        v = get(key, int, "an integer")
        if v is not None:
            out[kind] = v
    return out


def tokenizer_data_from_metadata(meta: dict[str, Any], source: str) -> TokenizerData:
    """`tokenizer.ggml.*` as TokenizerData; every key is type-checked and named on error."""
    prefix = "tokenizer.ggml."
    if prefix + "tokens" not in meta:
        raise TokenizerError(f"{source}: no tokenizer in the file ('{prefix}tokens' is absent)")

    def get(key: str, kind: type, what: str, default: Any = None) -> Any:
        full = key if key.startswith("tokenizer.") else prefix + key
        if full not in meta:
            return default
        value = meta[full]
        # bool is an int in Python; GGUF keeps them apart, and so does this check.
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise TokenizerError(f"{source}: '{full}' must be {what}, not {describe(value)}")
        return value

    def array(key: str, kind: type, what: str, default: list | None = None) -> list:
        value = get(key, list, f"an array of {what}", default)
        bad = next((v for v in value if not isinstance(v, kind)
                    or (kind is not bool and isinstance(v, bool))), None)
        if bad is not None:
            raise TokenizerError(f"{source}: '{prefix}{key}' must be an array of {what}; it "
                                 f"holds {describe(bad)}")
        return value

    tokens = array("tokens", str, "strings")
    model = get("model", str, "a string", "gpt2")
    # SentencePiece has no pre-tokenizer (llama.cpp: DEFAULT, unused); for gpt2, gpt-4o is
    # Phi-4-mini's.
    pre = get("pre", str, "a string", "default" if model == "llama" else "gpt-4o")
    if model == "gemma4":
        pre = "gemma4"  # llama.cpp reads a gemma4 vocabulary with this pre-tokenizer, always
    spm = model == "llama"

    def default_id(key: str, spm_default: int) -> int | None:
        """SentencePiece's default <unk>/<s>/</s> ids, where in range (llama.cpp)."""
        value = get(key, int, "an integer")
        if value is None and spm and spm_default < len(tokens):
            return spm_default
        return value

    add_bos = get("add_bos_token", bool, "a boolean", default_add_bos(pre, model))
    fields = dict(
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=array("token_type", int, "integers", [1] * len(tokens)),
        merges=array("merges", str, "strings", []),
        bos_token_id=default_id("bos_token_id", 1),
        eos_token_id=default_id("eos_token_id", 2),
        unknown_token_id=default_id("unknown_token_id", 0),
        padding_token_id=get("padding_token_id", int, "an integer"),
        add_bos_token=add_bos or forced_add_bos(pre, model),
        add_eos_token=get("add_eos_token", bool, "a boolean", False),
        chat_template=get("tokenizer.chat_template", str, "a string"),
        eot_token_id=get("eot_token_id", int, "an integer"),
        eom_token_id=get("eom_token_id", int, "an integer"),
        fim_token_ids=fim_token_ids(get),
        scores=(array("scores", (int, float), "numbers")
                if prefix + "scores" in meta else None),
        add_space_prefix=get("add_space_prefix", bool, "a boolean", spm),
        strip_rule=strip_rule_for_name(meta.get("general.name")
                                       if isinstance(meta.get("general.name"), str) else None),
    )
    try:
        return TokenizerData(**fields)
    except TokenizerError as exc:
        raise TokenizerError(f"{source}: {exc}") from None
    except ValidationError as exc:
        raise TokenizerError(f"{source}: invalid tokenizer metadata: {first_error(exc)}") from None
