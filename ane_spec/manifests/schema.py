"""`manifest.json`: the only contract between the shard compiler and the runtime.

The runtime needs nothing but this file and the files it names: model config, tokenizer file,
RoPE spec, every package's interface (names, shapes, dtypes, with "T" marking the RangeDim token
axis), sizes and hashes. Gates write their verdicts into `gates`.

A manifest is read back from disk, so it is validated as hostile input: numbers must be finite,
artifact paths must be plain relative paths (the store also resolves them inside the build
folder), and the parts must agree with each other: the shards cover exactly `model.num_layers`
layers, the head's chunks cover the vocabulary, the RoPE spec fits the context window. A
manifest that says 10^9 layers is refused here instead of sizing anything.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from ane_spec.content_digest import Digest
from ane_spec.model.config import ModelConfig
from ane_spec.model.rope import RopeSpec
from ane_spec.model.swa_ring import ring_rows

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
# The revision of the graphs the compiler emits, recorded in each manifest (0: before it was).
# The compiler bumps it when the emitted graphs change, so fingerprints stop matching and shards
# are rebuilt. 2: finite-safe KV write and select mask; 3: RangeDim default T=4 (residency is
# planned at the shape that runs); 4: llama, qwen2 and qwen3 layers (phi3 programs unchanged);
# 5: hidden slots score -32768 (-65504 overflowed `score - max` in fp16).
GRAPH_REVISION = 5
# The oldest graphs the runtime still runs: before 5 an fp16 row whose largest score passed 16
# could overflow the mask, and before 2 one overflowing row poisoned every KV slot, so output
# could differ from greedy decoding.
OLDEST_RUNNABLE_GRAPH_REVISION = 5

# Phi-4-mini's window is 131072 tokens; 8x that bounds what a manifest may make the runtime
# allocate for RoPE tables and masks (~200 MB at phi's head size) whatever the file claims.
MAX_SEQ_LIMIT = 1 << 20
# The token axis is RangeDim(1..4); anything wider was never built by this compiler.
MAX_T_LIMIT = 16
# The prefill function's fixed T (`build --prefill-t`); bounds the masks a manifest may make the
# host build per pass ([P, S] each).
MAX_PREFILL_T = 512
MAX_PATH_CHARS = 1024
# A 262,144-token vocabulary in 16,384-row argmax chunks, one chunk per package, is 16
# packages; 256 bounds what a manifest may make the runtime load.
MAX_HEAD_PACKAGES = 256

Dim = Annotated[int, Field(ge=1)] | Literal["T"]
# 256-bit content hashes as hex: sha256's, and BLAKE3's default output length.
Sha256 = Blake3 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Count = Annotated[int, Field(ge=1)]


class _Strict(BaseModel):
    # NaN and infinities are refused in every float field of the manifest.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def check_relative_path(path: str) -> str:
    """A path inside the build folder, spelled plainly: relative, '/'-separated, no '.', '..' or
    empty parts, no NUL. The store additionally resolves it and refuses symlinks."""
    if not path or len(path) > MAX_PATH_CHARS:
        raise ValueError(f"artifact path must be 1 to {MAX_PATH_CHARS} characters")
    if "\0" in path or "\\" in path:
        raise ValueError("artifact path contains a NUL or a backslash")
    if path.startswith("/") or any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError("artifact path must be relative to the build folder, without '..'")
    return path


class _Digested(_Strict):
    """Something hashed, with its content hash: BLAKE3 in builds since the hash was switched
    (content_digest.py says why), sha256 in those before (still verified as such). Exactly one
    of the two; the other is left out of the JSON."""

    blake3: Blake3 | None = None
    sha256: Sha256 | None = None

    @model_validator(mode="after")
    def _one_digest(self) -> "_Digested":
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("needs exactly one of blake3 and sha256")
        return self

    @model_serializer(mode="wrap")
    def _without_the_other_digest(self, handler: SerializerFunctionWrapHandler) -> dict:
        fields = handler(self)
        digests = {k: fields.pop(k) for k in ("blake3", "sha256") if k in fields}
        return {**fields, **{k: v for k, v in digests.items() if v is not None}}

    @property
    def algorithm(self) -> Digest:
        return "blake3" if self.blake3 is not None else "sha256"

    @property
    def digest(self) -> str:
        """The content hash's hex digits, whichever algorithm made them: also what keys a
        package's compiled copy in the compiled-model cache."""
        return self.blake3 if self.blake3 is not None else self.sha256  # type: ignore[return-value]


class FileRef(_Digested):
    """A file or package folder relative to the manifest, with its size and content hash."""

    path: str
    bytes: int = Field(ge=0)

    _plain_path = field_validator("path")(check_relative_path)


class TensorSpec(_Strict):
    name: str = Field(max_length=256)
    shape: list[Dim] = Field(max_length=8)
    dtype: Literal["fp16", "fp32", "int32"]


class TensorQuant(_Strict):
    """What one GGUF tensor (or LM-head chunk of one) became, and why."""

    format: Literal["int8-channel", "lut8", "q8-block", "fp16"]
    cosine: float  # of the stored values against the file's own, dequantized
    reason: str = Field(max_length=400)  # e.g. "lut8: int8-channel cos 0.998710 < 0.999"


class QuantStats(_Strict):
    """Agreement of the stored weights with the GGUF's values (cosine per tensor)."""

    format: str          # what the build requested: auto, int8-channel, q8-block or fp16
    worst_cosine: float  # finite (every float in a manifest is); may round past 1.0
    worst_tensor: str
    mean_cosine: float
    # Per tensor (builds before per-tensor formats have none): its format, cosine and reason.
    tensors: dict[str, TensorQuant] = Field(default_factory=dict)


class SourceInfo(_Digested):
    """The GGUF a build was made from: its path, size and content hash."""

    path: str
    bytes: int
    # What the GGUF says of itself, for the servers' model listings (Ollama's `details`):
    # its file type as llama.cpp names it ("Q8_0", "Q4_K_M"), and its parameter count (every
    # tensor's elements). None in builds from before they were recorded.
    file_type: str | None = Field(None, max_length=64)
    parameters: int | None = Field(None, ge=0)


class BuildOptions(_Strict):
    topology: list[Count]
    max_seq: int = Field(ge=32, le=MAX_SEQ_LIMIT, multiple_of=32)
    t_range: tuple[Count, Annotated[int, Field(ge=1, le=MAX_T_LIMIT)]] = (1, 4)
    # The T every input's RangeDim defaults to: the one shape MLComputePlan plans, so the shape
    # the residency gate covers (and the only one the ANE is assured at). Builds made before this
    # was recorded defaulted to 1.
    default_t: Annotated[int, Field(ge=1, le=MAX_T_LIMIT)] = 1

    @model_validator(mode="after")
    def _default_in_range(self) -> "BuildOptions":
        if not self.t_range[0] <= self.default_t <= self.t_range[1]:
            raise ValueError(f"build.default_t {self.default_t} is outside t_range "
                             f"{list(self.t_range)}")
        return self
    layout: Literal["BCT1", "BC1T"]
    weights: Literal["auto", "int8-channel", "q8-block", "fp16"]
    head_chunks: Count
    head_argmax: bool
    min_weight_cosine: float = Field(gt=0.0, le=1.0)
    # How the layers hide slots (shards/layer_graph.py): "select" (exact whatever a row holds)
    # or "additive" (clip and an added mask only). Builds from before it was recorded: select.
    mask_form: Literal["select", "additive"] = "select"
    # How the layers write their K/V rows (shards/layer_graph.write_rows): "scatter" rewrites
    # every slot each pass, "slice" only a window of the pass's width over the slots it writes
    # (its programs take kv_write_start). Builds from before it was recorded: scatter.
    kv_write: Literal["scatter", "slice"] = "scatter"
    # How the LM head lays out its logits (shards/programs.HeadLayout): "channels", the hidden
    # layout's [1, V_i, T, 1] / [1, V_i, 1, T]; "vocab-last", [1, T, V_i] as Anemll's heads emit
    # them. Builds from before it was recorded: channels.
    head_layout: Literal["channels", "vocab-last"] = "channels"
    # Slots of each sliding-window layer's K/V ring (model/swa_ring.py); 0: those layers keep
    # full-length states (and builds from before rings, which did not record it).
    swa_ring: int = Field(0, ge=0)
    # Every layer package's functions: the decode/verify program (RangeDim token axis, Core
    # ML's default function) and, where prefill_t > 0, the same layers at a fixed T = prefill_t
    # for prompts, sharing its weights and its states. Builds from before it: decode only.
    decode_function: str = Field("main", pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    prefill_function: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    prefill_t: int = Field(0, ge=0, le=MAX_PREFILL_T)

    @model_validator(mode="after")
    def _prefill_consistent(self) -> "BuildOptions":
        if (self.prefill_t > 0) != (self.prefill_function is not None):
            raise ValueError("build.prefill_t and build.prefill_function go together")
        if self.prefill_t and self.prefill_t <= self.t_range[1]:
            raise ValueError(f"build.prefill_t {self.prefill_t} is not wider than the decode "
                             f"function's {self.t_range[1]} rows")
        if self.prefill_t > self.max_seq:
            raise ValueError(f"build.prefill_t {self.prefill_t} exceeds build.max_seq "
                             f"{self.max_seq}")
        if self.prefill_function == self.decode_function:
            raise ValueError("build.prefill_function and decode_function must differ")
        return self

    @model_validator(mode="after")
    def _head_layout_with_logits(self) -> "BuildOptions":
        if self.head_layout != "channels" and self.head_argmax:
            raise ValueError("build.head_layout vocab-last needs a logits head (head_argmax "
                             "false)")
        return self

    @property
    def widest_pass(self) -> int:
        """The most rows one pass writes: a prefill chunk, or a decode/verify block."""
        return max(self.t_range[1], self.prefill_t)


class PackageEntry(_Strict):
    file: FileRef
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    states: list[TensorSpec] = Field(default_factory=list)
    quant: QuantStats
    fingerprint: Sha256  # hash of everything the package was built from; equal means reusable


class ShardEntry(PackageEntry):
    layers: tuple[Annotated[int, Field(ge=0)], Count]  # [first, last) layer indices


class HeadEntry(PackageEntry):
    """One LM-head package. A head over the build's --max-head-mb is split into several, each
    computing a contiguous run of the head's chunks; the manifest lists them in vocabulary
    order (`Manifest.heads`)."""

    # [start, end) vocab rows of each chunk this package computes, in the whole vocabulary
    chunks: list[tuple[Annotated[int, Field(ge=0)], Count]] = Field(min_length=1)
    argmax: bool


def head_output_names(first_chunk: int, count: int, argmax: bool) -> list[str]:
    """The outputs of a head package computing chunks first_chunk.. first_chunk + count - 1:
    named by their index in the whole head, so several packages' outputs merge into one."""
    chunks = range(first_chunk, first_chunk + count)
    if argmax:
        return [name for i in chunks for name in (f"max_{i}", f"argmax_{i}")]
    return [f"logits_{i}" for i in chunks]


class EmbeddingsEntry(_Strict):
    """token_embd rows for host lookup, kept as Q8_0 (int8 qs + fp16 scales) or fp16."""

    format: Literal["q8_0", "fp16"]
    vocab_size: Count
    dim: Count
    files: dict[str, FileRef]

    @model_validator(mode="after")
    def _roles(self) -> "EmbeddingsEntry":
        expected = {"q8_0": {"qs", "scales"}, "fp16": {"table"}}[self.format]
        if set(self.files) != expected:
            raise ValueError(f"{self.format} embeddings need exactly the files "
                             f"{sorted(expected)}")
        return self


class LayerActivations(_Strict):
    """Largest |value| the fp32 reference reached in one layer on the calibration prompts,
    unscaled (model/activation_range.py)."""

    residual: float = Field(ge=0.0)     # the residual stream, after each add into it
    ffn_up: float = Field(ge=0.0)       # gate and up outputs
    ffn_down_in: float = Field(ge=0.0)  # silu(gate) * up


class ActivationCalibration(_Strict):
    prompts: Count
    tokens: Count
    seconds: float = Field(ge=0.0)
    embedding: float = Field(ge=0.0)
    layers: list[LayerActivations]
    # fp16's maximum over the peak as the program holds it: the stream's after scaling, the
    # FFN intermediates' (not scaled by the fold). Below 1 means the fp16 program overflows on
    # the calibration prompts. None: unbounded (an all-zero activation).
    residual_margin: float | None = Field(None, gt=0.0)
    ffn_margin: float | None = Field(None, gt=0.0)


class ResidualScale(_Strict):
    """`--residual-scale`: the residual stream is multiplied by 2**log2_factor, folded into the
    embeddings and the weights that add into the stream (shards/residual_scale.py)."""

    setting: str = Field(pattern=r"^(auto|off|2\^-?\d+)$")
    log2_factor: int = Field(ge=-12, le=12)
    stream_eps: float = Field(ge=0.0)  # eps * 4**log2_factor, what the stream's norms use
    # Per package ("embeddings", a shard's path): stored values the fold could not scale
    # exactly (pushed into fp16's subnormals).
    inexact_values: dict[str, Annotated[int, Field(ge=0)]] = Field(default_factory=dict)
    calibration: ActivationCalibration | None = None  # None with `off`


class GateResult(_Strict):
    passed: bool
    backend: str
    precision: str | None = None
    decode_shape: Literal["fixed", "mixed"] | None = None  # where the figures depend on it
    figures: dict[str, Any] = Field(default_factory=dict)
    report: str | None = None
    at: str

    _plain_path = field_validator("report")(
        lambda path: None if path is None else check_relative_path(path))


class Manifest(_Strict):
    schema_version: int = SCHEMA_VERSION
    tool_version: str
    graph_revision: int = Field(0, ge=0)
    created: str
    name: str
    source: SourceInfo
    model: ModelConfig
    tokenizer: FileRef
    build: BuildOptions
    rope: RopeSpec
    # The sliding-window layers' RoPE (Gemma 3); None for models without such layers.
    rope_local: RopeSpec | None = None
    shards: list[ShardEntry]
    # The LM head's packages in vocabulary order: one, unless the head was over --max-head-mb.
    # Manifests written before heads could be split hold one `head`; it is read as [head].
    heads: list[HeadEntry] = Field(min_length=1, max_length=MAX_HEAD_PACKAGES)
    embeddings: EmbeddingsEntry
    gates: dict[str, GateResult] = Field(default_factory=dict)
    # Measured |logit(block row) - logit(one-token recomputation)| per backend, precision and
    # decode shape (`mil-fp16-mixed`), filled by probes and read by the mixed shape's exactness
    # guard. In the fixed shape it measures 0 on a row-invariant backend.
    drift: dict[str, Annotated[float, Field(ge=0.0)]] = Field(default_factory=dict)
    # None: built before residual scaling existed (or by a build that recorded none); the
    # stream is then unscaled.
    residual_scale: ResidualScale | None = None

    @model_validator(mode="before")
    @classmethod
    def _one_head(cls, data: Any) -> Any:
        """A manifest from before split heads names its one package `head`."""
        if isinstance(data, dict) and "head" in data and "heads" not in data:
            data = {k: v for k, v in data.items() if k != "head"} | {"heads": [data["head"]]}
        return data

    @property
    def head_chunks(self) -> list[tuple[int, int]]:
        """Every chunk of the LM head, across its packages, in vocabulary order."""
        return [tuple(c) for h in self.heads for c in h.chunks]

    @model_validator(mode="after")
    def _parts_agree(self) -> "Manifest":
        """Cross-checks between sections: each one alone can look valid."""
        c, b = self.model, self.build
        ranges = [tuple(s.layers) for s in self.shards]
        _check_tiling("shards' layers", ranges, c.num_layers)
        if b.topology != [end - a for a, end in ranges]:
            raise ValueError("build.topology does not match the shards' layer ranges")
        _check_tiling("heads' chunks", self.head_chunks, c.vocab_size)
        if len(self.head_chunks) != b.head_chunks or \
                any(h.argmax != b.head_argmax for h in self.heads):
            raise ValueError("heads' chunks/argmax do not match build.head_chunks/head_argmax")
        first = 0
        for n, h in enumerate(self.heads):
            # The runtime merges the packages' outputs by name: each must name its own chunks.
            want = head_output_names(first, len(h.chunks), h.argmax)
            if [o.name for o in h.outputs] != want:
                raise ValueError(f"heads[{n}] outputs {[o.name for o in h.outputs][:4]}...; its "
                                 f"chunks {first}..{first + len(h.chunks) - 1} need {want[:4]}...")
            first += len(h.chunks)
        paths = [p.file.path for p in [*self.shards, *self.heads]]
        if len(set(paths)) != len(paths):
            raise ValueError("two packages name the same file")
        if (self.embeddings.vocab_size, self.embeddings.dim) != (c.vocab_size, c.hidden_size):
            raise ValueError(f"embeddings are {self.embeddings.vocab_size} x "
                             f"{self.embeddings.dim}; the model is {c.vocab_size} x "
                             f"{c.hidden_size}")
        if b.max_seq > c.context_length:
            raise ValueError(f"build.max_seq {b.max_seq} exceeds model.context_length "
                             f"{c.context_length}")
        if (self.rope_local is not None) != c.has_local_layers:
            raise ValueError("rope_local is needed exactly when the model has sliding-window "
                             "layers")
        for r in (self.rope, self.rope_local):
            if r is not None:
                _check_rope(r, b.max_seq, c.rope_dims)
        _check_ring(self)
        _check_kv_write(self)
        rs = self.residual_scale
        if rs is not None and rs.calibration is not None and (
                len(rs.calibration.layers) != c.num_layers):
            raise ValueError(f"residual_scale.calibration has {len(rs.calibration.layers)} "
                             f"layers; the model has {c.num_layers}")
        return self


def _check_ring(m: "Manifest") -> None:
    """The recorded ring size is the one this ane-spec computes for the model and build, and
    every local layer's states have it (global layers: max_seq)."""
    c, b = m.model, m.build
    if b.swa_ring:
        if not c.has_local_layers:
            raise ValueError("build.swa_ring is set but the model has no sliding-window layers")
        want = ring_rows(c.sliding_window, b.widest_pass)
        if b.swa_ring != want or b.swa_ring >= b.max_seq:
            raise ValueError(f"build.swa_ring {b.swa_ring} is not the ring this ane-spec keeps "
                             f"for a window of {c.sliding_window} and passes of up to "
                             f"{b.widest_pass} rows ({want} slots, shorter than build.max_seq "
                             f"{b.max_seq}): rebuild")
    for shard in m.shards:
        for spec in shard.states:
            layer = _state_layer(spec.name)
            if layer is None or layer >= c.num_layers or len(spec.shape) != 4:
                continue
            rows = b.swa_ring if b.swa_ring and c.is_local(layer) else b.max_seq
            if spec.shape[2] != rows:
                raise ValueError(f"state '{spec.name}' has {spec.shape[2]} slots; build.swa_ring "
                                 f"{b.swa_ring} and max_seq {b.max_seq} say {rows}")


# The slice form's window-start input (shards/programs.KV_WRITE_START; named here so that
# reading a manifest does not import the compiler).
KV_WRITE_START = "kv_write_start"


def _check_kv_write(m: "Manifest") -> None:
    """Every shard takes the window starts exactly when build.kv_write is slice: the host feeds
    the form the manifest names, so a manifest naming the other one is refused when read."""
    slice_form = m.build.kv_write == "slice"
    for n, shard in enumerate(m.shards):
        if any(i.name == KV_WRITE_START for i in shard.inputs) != slice_form:
            raise ValueError(f"shards[{n}] {'lacks' if slice_form else 'takes'} the input "
                             f"'{KV_WRITE_START}', but build.kv_write is {m.build.kv_write}")


def _state_layer(name: str) -> int | None:
    """The layer of a K/V state named layer_{i}_k / layer_{i}_v."""
    parts = name.split("_")
    if len(parts) == 3 and parts[0] == "layer" and parts[1].isdigit() and parts[2] in ("k", "v"):
        return int(parts[1])
    return None


def _check_rope(r: RopeSpec, max_seq: int, rope_dims: int) -> None:
    """One RoPE section against the build and model it must serve."""
    if (r.context_window, r.rope_dims) != (max_seq, rope_dims):
        raise ValueError("rope.context_window/rope_dims do not match build.max_seq and "
                         "model.rope_dims")
    if len(r.factors) != r.rope_dims // 2:
        raise ValueError(f"rope.factors has {len(r.factors)} entries, expected "
                         f"{r.rope_dims // 2}")
    for name, v in (("freq_base", r.freq_base), ("attn_factor", r.attn_factor),
                    ("freq_scale", r.freq_scale), *(("factors", f) for f in r.factors)):
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"rope.{name} must be positive and finite, got {v}")


def _check_tiling(where: str, ranges: list[tuple[int, int]], total: int) -> None:
    """[start, end) ranges must follow each other from 0 and end exactly at `total`."""
    start = 0
    for a, end in ranges:
        if a != start or end <= a:
            raise ValueError(f"{where}: ranges do not tile 0..{total}")
        start = end
    if start != total:
        raise ValueError(f"{where}: ranges cover 0..{start}, expected 0..{total}")
