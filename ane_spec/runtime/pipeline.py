"""Run a built model one block at a time: embed on the host, every shard in order, then the head.

The manifest is the only thing read: which packages, in which layout, with which RoPE spec and
context window. A `PipelineState` holds one backend state per shard, i.e. one conversation.

The decode shape (`decode_shape.DecodeShapePolicy`) decides how wide every pass is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ane_spec.ane_limits import q8_block_refusal

from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import LoadedManifest
from ane_spec.runtime.backend import Backend, LoadedProgram
from ane_spec.runtime.decode_shape import DecodeShape, DecodeShapePolicy
from ane_spec.runtime.fp16_argmax import NonFiniteLogits, argmax, chunked_argmax, require_finite
from ane_spec.runtime.host_inputs import HostInputs
from ane_spec.runtime.row_keys import finite_key_range, unsigned_keys


@dataclass
class PipelineState:
    shard_states: list[Any]


class BlockOutput:
    """One pass's outputs for its real rows, read from the head's buffers only when asked.

    Decoding needs rows 0..m (m accepted drafts), usually only their argmax, and one logits row
    of a 200,064-token vocabulary is a 0.8 MB gather and conversion: so rows are read one at a
    time and cached, a pass whose first draft is rejected reads one row, not four, and a row
    whose argmax alone is asked for is arg-maxed in the head's own buffers (`fp16_argmax`). A head
    built with --head-argmax has no logits, only each row's `argmax` and winning `max_logit`.

    Every path refuses a row with a non-finite logit (`fp16_argmax.NonFiniteLogits`), so a row
    yields one token or an error, however it is read: a logits read checks the whole row, the
    head-buffer argmax checks every chunk, and a --head-argmax row checks its winning maximum
    (the only value such a head reports: a NaN or -inf inside a chunk that lost is not seen).
    """

    def __init__(self, rows: int, read_row: Callable[[int], np.ndarray] | None, *,
                 argmax_row: Callable[[int], int] | None = None,
                 read_native: Callable[[int], np.ndarray] | None = None,
                 values_at: Callable[[int, np.ndarray], np.ndarray] | None = None,
                 argmax: np.ndarray | None = None, max_logit: np.ndarray | None = None,
                 backend_seconds: float = 0.0, host_seconds: float = 0.0):
        self.rows = rows
        self._read_row = read_row
        self._argmax_row = argmax_row
        self._read_native = read_native
        self._values_at = values_at
        self._logits: dict[int, np.ndarray] = {}
        self._argmax = {} if argmax is None else dict(enumerate(int(a) for a in argmax))
        self._max_logit = None if max_logit is None else np.asarray(max_logit)
        self.backend_seconds = backend_seconds
        self.host_seconds = host_seconds

    @classmethod
    def of_logits(cls, logits: np.ndarray) -> "BlockOutput":
        """Rows that are already logits [T, V] (tests; callers holding a dump)."""
        logits = np.asarray(logits, dtype=np.float32)
        return cls(len(logits), lambda i: logits[i])

    @property
    def has_logits(self) -> bool:
        return self._read_row is not None

    def row_logits(self, i: int) -> np.ndarray:
        """Row i's logits [V] (float32; negative i counts from the end)."""
        i = range(self.rows)[i]
        if self._read_row is None:
            raise AneSpecError("this build's head emits only argmax (--head-argmax): no logits")
        if i not in self._logits:
            row = self._read_row(i)
            require_finite(row, f"row {i} of the pass")
            self._logits[i] = row
        return self._logits[i]

    def row_argmax(self, i: int) -> int:
        i = range(self.rows)[i]
        if self._max_logit is not None and not np.isfinite(self._max_logit[i]):
            raise NonFiniteLogits(f"row {i} of the pass")  # a --head-argmax row
        if i not in self._argmax:
            try:
                if i in self._logits or self._argmax_row is None:
                    self._argmax[i] = argmax(self.row_logits(i))
                else:  # straight from the head's buffers, without a float32 copy of the row
                    self._argmax[i] = self._argmax_row(i)
            except NonFiniteLogits:
                raise NonFiniteLogits(f"row {i} of the pass") from None
        return self._argmax[i]

    def row_keys(self, i: int) -> np.ndarray:
        """Row i as `row_keys.unsigned_keys` (a new array, the caller's to edit), from the head's
        own dtype where it can: no float32 copy of the row."""
        i = range(self.rows)[i]
        if i in self._logits or self._read_native is None:
            return unsigned_keys(self.row_logits(i))  # row_logits refuses non-finite rows
        native = self._read_native(i)
        keys = unsigned_keys(native)
        # The NaN rule (fp16_argmax): NaN and inf keys lie outside the finite values' key range,
        # so two integer reductions check the row without a float pass over it.
        low, high = finite_key_range(native.dtype)
        if keys.size and (keys.min() < low or keys.max() > high):
            raise NonFiniteLogits(f"row {i} of the pass")
        return keys

    def row_values(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Row i's logits at `ids` (float32), without reading the whole row."""
        i = range(self.rows)[i]
        if i in self._logits or self._values_at is None:
            return self.row_logits(i)[ids]
        return self._values_at(i, ids)

    @property
    def logits(self) -> np.ndarray | None:
        """All rows [T, V], or None for a --head-argmax build."""
        if self._read_row is None:
            return None
        return np.stack([self.row_logits(i) for i in range(self.rows)])

    @property
    def argmax(self) -> np.ndarray:
        return np.array([self.row_argmax(i) for i in range(self.rows)], dtype=np.int64)

    @property
    def max_logit(self) -> np.ndarray:
        if self._max_logit is not None:
            return self._max_logit
        return np.array([self.row_logits(i)[self.row_argmax(i)] for i in range(self.rows)])


@dataclass
class Embeddings:
    """token_embd rows from the build's .npy files, dequantized only for the rows looked up."""

    qs: np.ndarray | None = None
    scales: np.ndarray | None = None
    table: np.ndarray | None = None

    @classmethod
    def load(cls, loaded: LoadedManifest) -> "Embeddings":
        e = loaded.manifest.embeddings
        files = {k: np.load(loaded.path(ref), mmap_mode="r") for k, ref in e.files.items()}
        if e.format == "q8_0":
            return cls(qs=files["qs"], scales=files["scales"])
        return cls(table=files["table"])

    def lookup(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if self.table is not None:
            return self.table[ids].astype(np.float32)
        qs = self.qs[ids].reshape(len(ids), -1, 32).astype(np.float32)
        return (qs * self.scales[ids].astype(np.float32)[..., None]).reshape(len(ids), -1)


@dataclass
class ShardPipeline:
    loaded: LoadedManifest
    backend: Backend
    decode_shape: DecodeShape = "fixed"
    shards: list[LoadedProgram] = field(init=False)
    head: LoadedProgram = field(init=False)
    # Per-process measurements that layers above make once per loaded model (the decode
    # engine's pass-cost policy), kept with the model they describe.
    measurements: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        m = self.loaded.manifest
        self.manifest = m
        self.config = m.model
        self.max_seq = m.build.max_seq
        self.max_t = m.build.t_range[1]
        self.shape = DecodeShapePolicy(self.decode_shape, self.max_t)
        self.layout = m.build.layout
        self.head_argmax = m.head.argmax
        self.input_dtype = np.float32 if self.backend.precision == "fp32" else np.float16
        self.host = HostInputs(m.rope, self.max_seq, self.max_t, self.input_dtype)
        self.embeddings = Embeddings.load(self.loaded)
        refusal = q8_block_refusal(m.build.weights, getattr(self.backend, "compute_units", ""))
        if refusal:  # before any package is compiled or loaded
            raise AneSpecError(refusal)
        # The manifest's hashes key Core ML's compiled-model cache (no re-hashing 2 GB shards).
        self.shards = [self.backend.load(self.loaded.path(s.file), sha256=s.file.sha256)
                       for s in m.shards]
        self.head = self.backend.load(self.loaded.path(m.head.file), sha256=m.head.file.sha256)

    @property
    def drift_key(self) -> str:
        """The manifest key of figures measured on this backend, precision and decode shape
        (`mil-fp16-fixed`, `coreml-mixed`): drift and gate results depend on all three."""
        return "-".join(x for x in (self.backend.name, self.backend.precision,
                                    self.decode_shape) if x)

    @cached_property
    def tokenizer_data(self):
        """The build's copy of the GGUF vocabulary and chat template (tokenizer.json)."""
        return self.loaded.tokenizer_data()

    @cached_property
    def tokenizer(self):
        from ane_spec.model.tokenizer import Tokenizer

        return Tokenizer.from_data(self.tokenizer_data)

    def new_state(self) -> PipelineState:
        return PipelineState([shard.make_state() for shard in self.shards])

    def copy_state(self, state: PipelineState) -> PipelineState:
        """A new state holding the same K/V, value for value."""
        copy = self.new_state()
        for shard, src, dst in zip(self.shards, state.shard_states, copy.shard_states):
            for name in shard.state_names:
                shard.write_state(dst, name, shard.read_state(src, name))
        return copy

    # --- layout ---------------------------------------------------------------------------

    def to_hidden(self, rows: np.ndarray) -> np.ndarray:
        """[T, d] float rows -> the packages' hidden layout."""
        x = rows.astype(self.input_dtype).T  # [d, T]
        return (x[None, :, :, None] if self.layout == "BCT1" else x[None, :, None, :]).copy()

    def token_major(self, x: np.ndarray) -> np.ndarray:
        """A [T, channels] view of a hidden-layout array or head output (no copy)."""
        return (x[0, :, :, 0] if self.layout == "BCT1" else x[0, :, 0, :]).T

    def from_hidden(self, x: np.ndarray) -> np.ndarray:
        """Hidden layout (or a head output) -> [T, channels] float32."""
        return np.ascontiguousarray(self.token_major(x), dtype=np.float32)

    # --- running -------------------------------------------------------------------------

    def run_shards(self, hidden: np.ndarray, inputs: dict[str, np.ndarray], state: PipelineState,
                   shard_range: range | None = None) -> np.ndarray:
        """Hidden states through the shards (all, or a range of them, for per-shard gates)."""
        for n in shard_range or range(len(self.shards)):
            hidden = self.shards[n].predict({"x": hidden, **inputs}, state.shard_states[n])["hidden"]
        return hidden

    def run(self, tokens: Sequence[int], position: int, state: PipelineState, *,
            width: int | None = None) -> BlockOutput:
        """One pass over `tokens` (1..T_max) written at slots position..position+T-1.

        `width`: rows the backend computes (default: the decode shape's). Rows past the tokens
        repeat the last token and write nothing; only the real rows' outputs are read."""
        t0 = time.perf_counter()
        if not 1 <= len(tokens) <= self.max_t:
            raise AneSpecError(f"a pass takes 1..{self.max_t} tokens, got {len(tokens)}")
        width = self.shape.pass_width(len(tokens)) if width is None else width
        inputs = self.host.block(position, len(tokens), width)
        padded = [*tokens, *[tokens[-1]] * (width - len(tokens))]
        return self._run(padded, inputs, state, len(tokens), t0)

    def run_rows(self, tokens: Sequence[int], positions: Sequence[int], writes: Sequence[bool],
                 state: PipelineState) -> BlockOutput:
        """One pass of arbitrary rows (token, position, writes its slot or not); every row is
        read. For probes that place the same token at different row indices."""
        t0 = time.perf_counter()
        if len(tokens) != len(positions):
            raise AneSpecError("every row needs one token and one position")
        return self._run(tokens, self.host.rows(positions, writes), state, len(tokens), t0)

    def _run(self, tokens: Sequence[int], inputs: dict[str, np.ndarray], state: PipelineState,
             rows: int, t0: float) -> BlockOutput:
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise AneSpecError(f"token ids {bad[:5]} are outside the vocabulary "
                               f"0..{self.config.vocab_size - 1}")
        hidden = self.to_hidden(self.embeddings.lookup(tokens))
        host = time.perf_counter() - t0

        t1 = time.perf_counter()
        outputs = self.head.predict({"x": self.run_shards(hidden, inputs, state)})
        backend = time.perf_counter() - t1

        t2 = time.perf_counter()
        result = self._read_head(outputs, rows)
        result.backend_seconds = backend
        result.host_seconds = host + time.perf_counter() - t2
        return result

    def _read_head(self, outputs: dict[str, np.ndarray], rows: int) -> BlockOutput:
        """The first `rows` rows of the head's outputs: padding rows are never read."""
        chunks = self.manifest.head.chunks
        if not self.head_argmax:
            views = [(start, end, self.token_major(outputs[f"logits_{i}"]))  # [T, V_i], no copy
                     for i, (start, end) in enumerate(chunks)]

            def gather(r: int, dtype: np.dtype) -> np.ndarray:
                row = np.empty(chunks[-1][1], dtype=dtype)
                for start, end, view in views:
                    row[start:end] = view[r]
                return row

            def read_row(r: int) -> np.ndarray:
                return gather(r, np.float32)

            def argmax_row(r: int) -> int:
                return chunked_argmax([(start, view[r]) for start, _, view in views])

            def read_native(r: int) -> np.ndarray:  # the head's dtype: no float32 copy
                return gather(r, views[0][2].dtype)

            def values_at(r: int, ids: np.ndarray) -> np.ndarray:
                values = np.empty(len(ids), dtype=np.float32)
                for start, end, view in views:
                    inside = (ids >= start) & (ids < end)
                    values[inside] = view[r][ids[inside] - start]
                return values

            return BlockOutput(rows, read_row, argmax_row=argmax_row, read_native=read_native,
                               values_at=values_at)
        maxima = np.stack([self.from_hidden(outputs[f"max_{i}"])[:rows, 0]
                           for i in range(len(chunks))], axis=1)           # [rows, chunks]
        index = np.stack([self.from_hidden(outputs[f"argmax_{i}"])[:rows, 0]
                          for i in range(len(chunks))], axis=1).astype(np.int64)
        winner = maxima.argmax(axis=1)  # first chunk on ties, like a global argmax
        starts = np.array([s for s, _ in chunks])
        picked = np.arange(len(winner))
        return BlockOutput(rows, None, argmax=starts[winner] + index[picked, winner],
                           max_logit=maxima[picked, winner])


def prefill_logits(pipeline: ShardPipeline, tokens: Sequence[int],
                   state: PipelineState | None = None) -> np.ndarray:
    """Logits [T, V] for `tokens` from position 0, run in blocks of T_max (the last one shorter,
    padded in the fixed decode shape). Pass `state` to keep the filled KV slots for decoding."""
    if pipeline.head_argmax:
        raise AneSpecError("this build's head emits only argmax (--head-argmax); rebuild "
                           "without it to dump logits")
    if len(tokens) > pipeline.max_seq:
        raise AneSpecError(f"{len(tokens)} tokens do not fit the build's context window of "
                           f"{pipeline.max_seq}")
    state = state or pipeline.new_state()
    rows = []
    for start in range(0, len(tokens), pipeline.max_t):
        rows.append(pipeline.run(tokens[start:start + pipeline.max_t], start, state).logits)
    return np.concatenate(rows, axis=0)
