"""`manifest.json`: the only contract between the shard compiler and the runtime.

The runtime needs nothing but this file and the files it names: model config, tokenizer file,
RoPE spec, every package's interface (names, shapes, dtypes, with "T" marking the RangeDim token
axis), sizes and hashes. Gates write their verdicts into `gates`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ane_spec.model.config import ModelConfig
from ane_spec.model.rope import RopeSpec

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"

Dim = int | Literal["T"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileRef(_Strict):
    """A file or package folder relative to the manifest, with its size and content hash."""

    path: str
    bytes: int
    sha256: str


class TensorSpec(_Strict):
    name: str
    shape: list[Dim]
    dtype: Literal["fp16", "fp32", "int32"]


class QuantStats(_Strict):
    """Agreement of the stored weights with the GGUF's values (cosine per tensor)."""

    format: str
    worst_cosine: float
    worst_tensor: str
    mean_cosine: float


class SourceInfo(_Strict):
    path: str
    bytes: int
    sha256: str


class BuildOptions(_Strict):
    topology: list[int]
    max_seq: int
    t_range: tuple[int, int] = (1, 4)
    layout: Literal["BCT1", "BC1T"]
    weights: Literal["int8-channel", "q8-block", "fp16"]
    head_chunks: int
    head_argmax: bool
    min_weight_cosine: float


class PackageEntry(_Strict):
    file: FileRef
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    states: list[TensorSpec] = Field(default_factory=list)
    quant: QuantStats
    fingerprint: str  # hash of everything the package was built from; equal means reusable


class ShardEntry(PackageEntry):
    layers: tuple[int, int]  # [first, last) layer indices


class HeadEntry(PackageEntry):
    chunks: list[tuple[int, int]]  # [start, end) vocab rows per chunk
    argmax: bool


class EmbeddingsEntry(_Strict):
    """token_embd rows for host lookup, kept as Q8_0 (int8 qs + fp16 scales) or fp16."""

    format: Literal["q8_0", "fp16"]
    vocab_size: int
    dim: int
    files: dict[str, FileRef]


class GateResult(_Strict):
    passed: bool
    backend: str
    precision: str | None = None
    decode_shape: Literal["fixed", "mixed"] | None = None  # where the figures depend on it
    figures: dict[str, Any] = Field(default_factory=dict)
    report: str | None = None
    at: str


class Manifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    tool_version: str
    created: str
    name: str
    source: SourceInfo
    model: ModelConfig
    tokenizer: FileRef
    build: BuildOptions
    rope: RopeSpec
    shards: list[ShardEntry]
    head: HeadEntry
    embeddings: EmbeddingsEntry
    gates: dict[str, GateResult] = Field(default_factory=dict)
    # Measured |logit(block row) - logit(one-token recomputation)| per backend, precision and
    # decode shape (`mil-fp16-mixed`), filled by probes and read by the mixed shape's exactness
    # guard. In the fixed shape it measures 0 on a row-invariant backend.
    drift: dict[str, float] = Field(default_factory=dict)
