"""Read a Phi-4-mini GGUF file: validated config, lazy tensors, tokenizer data.

The file is memory-mapped once (gguf_format.py); every tensor accessor returns a view into that
map, so opening even a 4 GB file costs only its metadata. Validation happens up front so that a
truncated, foreign or mis-shaped file fails at `open_gguf` with a message naming the problem,
not later inside a matmul.
"""

from __future__ import annotations

import hashlib
import mmap
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ane_spec.errors import ConfigError, GGUFError
from ane_spec.model.config import ARCH, ModelConfig
from ane_spec.model.gguf_format import GGUFContents, read_gguf
from ane_spec.model.quant import bf16_to_float32, q8_0_blocks, q8_0_dequantize
from ane_spec.model.rope import RopeSpec, make_rope_spec
from ane_spec.model.tokenizer import TokenizerData

SUPPORTED_TYPES = {
    GGMLQuantizationType.F32: "F32",
    GGMLQuantizationType.F16: "F16",
    GGMLQuantizationType.BF16: "BF16",
    GGMLQuantizationType.Q8_0: "Q8_0",
}


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

    def rows(self, index: np.ndarray | list[int], dtype: np.dtype = np.float32) -> np.ndarray:
        """Dequantize selected rows only (embedding lookup, chunked head): `[len(index), in]`."""
        idx = np.asarray(index, dtype=np.int64).reshape(-1)
        if self.is_q8_0:
            qs, d = self.q8_0()
            return q8_0_dequantize(qs[idx], d[idx], dtype)
        return self._widen(self.raw.reshape(self.shape[0], -1)[idx]).astype(dtype, copy=False)

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

    def dequantize(self, dtype: np.dtype = np.float32) -> np.ndarray:
        """The whole tensor as floats: allocates, so call it per tensor, not per model."""
        if self.is_q8_0:
            qs, d = self.q8_0()
            return q8_0_dequantize(qs, d, dtype).reshape(self.shape)
        return self._widen(self.raw).astype(dtype, copy=False).reshape(self.shape)

    def _widen(self, raw: np.ndarray) -> np.ndarray:
        if self.type == GGMLQuantizationType.BF16:
            return bf16_to_float32(raw).reshape(raw.shape[0], -1)
        return raw


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a phi3 file must hold, with its numpy shape."""
    d, f = config.hidden_size, config.ffn_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (config.vocab_size, d),
        "output_norm.weight": (d,),
    }
    if not config.tied_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (d,),
            f"blk.{i}.attn_qkv.weight": (config.qkv_rows, d),
            f"blk.{i}.attn_output.weight": (d, d),
            f"blk.{i}.ffn_norm.weight": (d,),
            f"blk.{i}.ffn_up.weight": (2 * f, d),
            f"blk.{i}.ffn_down.weight": (d, f),
        }
    return shapes


OPTIONAL_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


class GGUFModel:
    """An opened, validated Phi-4-mini GGUF file."""

    def __init__(self, path: Path, contents: GGUFContents, tensors: dict[str, Tensor],
                 config: ModelConfig):
        self.path = path
        self.version = contents.version
        self.metadata = contents.metadata
        # The whole file as uint8, zero-copy: every tensor's `raw` is a slice of it.
        self.buffer = np.frombuffer(contents.mapping, dtype=np.uint8)
        self.tensors = tensors
        self.config = config

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

    def rope_spec(self, context_window: int) -> RopeSpec:
        """RoPE for a context window; the window picks the factor set, as in llama.cpp."""
        c = self.config
        if not 0 < context_window <= c.context_length:
            raise ConfigError(f"context window {context_window} is outside 1..{c.context_length} "
                              "(the model's context_length)")
        return make_rope_spec(
            rope_dims=c.rope_dims, freq_base=c.rope_freq_base, attn_factor=c.rope_attn_factor,
            original_context_length=c.original_context_length, context_window=context_window,
            short_factors=self.rope_factors("short"), long_factors=self.rope_factors("long"))

    @cached_property
    def tokenizer_data(self) -> TokenizerData:
        return tokenizer_data_from_metadata(self.metadata, self.path.name)

    @property
    def file_type(self) -> str:
        types = {t.type_name for n, t in self.tensors.items() if n.endswith("attn_qkv.weight")}
        return "/".join(sorted(types)) or "unknown"

    def content_hashes(self) -> tuple[str, dict[str, str]]:
        """sha256 of the whole file and of each tensor's bytes, in one pass over the file.

        The build records the first and fingerprints each shard with the second, so a re-run
        rebuilds only what the changed tensors feed."""
        whole = hashlib.sha256()
        per_tensor: dict[str, str] = {}
        pos = 0
        for t in sorted(self.tensors.values(), key=lambda t: t.file_offset):
            whole.update(self.buffer[pos:t.file_offset])
            h = hashlib.sha256()
            step = 1 << 26
            for start in range(t.file_offset, t.file_offset + t.nbytes, step):
                block = self.buffer[start:min(start + step, t.file_offset + t.nbytes)]
                whole.update(block)
                h.update(block)
            t.release()
            per_tensor[t.name] = h.hexdigest()
            pos = t.file_offset + t.nbytes
        whole.update(self.buffer[pos:])
        return whole.hexdigest(), per_tensor

    def close(self) -> None:
        # The mapping is unmapped when the last view into it is gone.
        self.buffer = np.empty(0, np.uint8)
        self.tensors = {}

    def __enter__(self) -> "GGUFModel":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: str | os.PathLike[str]) -> GGUFModel:
    """Open and validate a GGUF file as a Phi-4-mini (`phi3`) model."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    contents = read_gguf(os.fspath(path), path.name)
    metadata = contents.metadata
    arch = metadata.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{path.name}: architecture is {arch!r}; only '{ARCH}' "
                        "(Phi-3/Phi-4-mini) is supported")

    tensors = _map_tensors(contents, path.name)
    tokens = metadata.get("tokenizer.ggml.tokens")
    if "token_embd.weight" not in tensors:
        raise GGUFError(f"{path.name}: missing tensor 'token_embd.weight'")
    vocab = len(tokens) if tokens is not None else tensors["token_embd.weight"].shape[0]
    try:
        config = ModelConfig.from_gguf_metadata(
            metadata, vocab_size=vocab, tied_embeddings="output.weight" not in tensors)
    except ConfigError as exc:
        raise GGUFError(f"{path.name}: {exc}") from None
    _check_tensor_shapes(tensors, config, path.name)
    return GGUFModel(path, contents, tensors, config)


def _map_tensors(contents: GGUFContents, name: str) -> dict[str, Tensor]:
    size = len(contents.mapping)
    tensors: dict[str, Tensor] = {}
    for info in contents.tensors:
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise GGUFError(f"{name}: tensor '{info.name}' has unknown ggml type "
                            f"{info.ggml_type}") from None
        if qtype not in SUPPORTED_TYPES:
            raise GGUFError(
                f"{name}: tensor '{info.name}' has type {qtype.name}; supported types "
                f"are {', '.join(SUPPORTED_TYPES.values())} (requantize the file to Q8_0)")
        if info.name in tensors:
            raise GGUFError(f"{name}: tensor '{info.name}' appears twice")
        shape = tuple(int(x) for x in reversed(info.dims))
        block, type_size = GGML_QUANT_SIZES[qtype]
        if shape[-1] % block:
            raise GGUFError(f"{name}: tensor '{info.name}' rows of {shape[-1]} are not a "
                            f"multiple of the {qtype.name} block size {block}")
        n_bytes = int(np.prod(shape)) // block * type_size
        if info.offset + n_bytes > size:
            raise GGUFError(f"{name}: file is truncated: tensor '{info.name}' ends at byte "
                            f"{info.offset + n_bytes:,} but the file has {size:,} bytes")
        if qtype == GGMLQuantizationType.F32:
            raw = np.frombuffer(contents.mapping, np.float32, int(np.prod(shape)), info.offset)
        elif qtype == GGMLQuantizationType.F16:
            raw = np.frombuffer(contents.mapping, np.float16, int(np.prod(shape)), info.offset)
        else:  # Q8_0, BF16: bytes, one row of the matrix per row of the array
            raw = np.frombuffer(contents.mapping, np.uint8, n_bytes, info.offset)
        raw = raw.reshape(shape) if qtype in (GGMLQuantizationType.F32,
                                              GGMLQuantizationType.F16) else (
            raw.reshape(int(np.prod(shape[:-1])), -1))
        tensors[info.name] = Tensor(info.name, qtype, shape, raw, info.offset, contents.mapping)
    return tensors


def _check_tensor_shapes(tensors: dict[str, Tensor], config: ModelConfig, name: str) -> None:
    for tname, shape in expected_tensor_shapes(config).items():
        t = tensors.get(tname)
        if t is None:
            raise GGUFError(f"{name}: missing tensor '{tname}' (expected shape {shape})")
        if t.shape != shape:
            raise GGUFError(f"{name}: tensor '{tname}' has shape {t.shape}, expected {shape}")
    for tname in OPTIONAL_TENSORS:
        t = tensors.get(tname)
        if t is not None and t.shape != (config.rope_dims // 2,):
            raise GGUFError(f"{name}: tensor '{tname}' has shape {t.shape}, expected "
                            f"({config.rope_dims // 2},)")


def tokenizer_data_from_metadata(meta: dict[str, Any], source: str) -> TokenizerData:
    from ane_spec.errors import TokenizerError

    prefix = "tokenizer.ggml."
    if prefix + "tokens" not in meta:
        raise TokenizerError(f"{source}: no tokenizer in the file ('{prefix}tokens' is absent)")

    def opt_int(key: str) -> int | None:
        v = meta.get(prefix + key)
        return None if v is None else int(v)

    try:
        return TokenizerData(
            model=meta.get(prefix + "model", "gpt2"),
            pre=meta.get(prefix + "pre", "gpt-4o"),
            tokens=list(meta[prefix + "tokens"]),
            token_types=[int(x) for x in meta.get(prefix + "token_type",
                                                  [1] * len(meta[prefix + "tokens"]))],
            merges=list(meta.get(prefix + "merges", [])),
            bos_token_id=opt_int("bos_token_id"),
            eos_token_id=opt_int("eos_token_id"),
            unknown_token_id=opt_int("unknown_token_id"),
            padding_token_id=opt_int("padding_token_id"),
            add_bos_token=bool(meta.get(prefix + "add_bos_token", False)),
            add_eos_token=bool(meta.get(prefix + "add_eos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )
    except ValueError as exc:
        raise TokenizerError(f"{source}: invalid tokenizer metadata: {exc}") from None


