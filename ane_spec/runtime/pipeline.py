"""Run a built model one block at a time: embed on the host, every shard in order, then the head.

The manifest is the only thing read: which packages, in which layout, with which RoPE spec and
context window. A `PipelineState` holds one backend state per shard, i.e. one conversation.

The decode shape (`decode_shape.DecodeShapePolicy`) decides how wide every pass is.

A build with a prefill function (`build.prefill_t` P > 0) has a second program in every layer
package: the same layers at a fixed T = P, sharing the decode program's weights and its state.
`run_prefill` runs a prompt chunk of up to P tokens through it, layers only; only the chunk that
holds the prompt's last token runs the LM head, on that one row, at the decode shape's width
(which chunks use it is the decode layer's choice: `decode/prefill_plan.py`).
"""

from __future__ import annotations

import math

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from ane_spec.ane_limits import q8_block_refusal

from ane_spec.errors import AneSpecError, ManifestError
from ane_spec.manifests.schema import GRAPH_REVISION, OLDEST_RUNNABLE_GRAPH_REVISION
from ane_spec.manifests.store import LoadedManifest
from ane_spec.runtime.backend import Backend, LoadedProgram, start_backend
from ane_spec.runtime.decode_shape import (
    DecodeShape, DecodeShapePolicy, PrefillMode, check_prefill_mode,
)
from ane_spec.runtime.fp16_argmax import NonFiniteLogits, argmax
from ane_spec.model.swa_ring import RingSlots
from ane_spec.runtime.head_packages import SplitHead
from ane_spec.runtime.hidden_layout import (
    head_token_major,
    repeat_row,
    token_axis,
    token_major,
)
from ane_spec.runtime.host_inputs import HostInputs


@dataclass
class PipelineState:
    shard_states: list[Any]
    # A ring build's record of the position each local-layer ring slot holds (the same for
    # every local layer and shard: they are all written by the same passes); None otherwise.
    ring: RingSlots | None = None


class BlockOutput:
    """One pass's outputs for its real rows, read from the head's buffers only when asked.

    Decoding needs rows 0..m (m accepted drafts), usually only their argmax, and one logits row
    of a 200,064-token vocabulary is a 0.4 MB gather: so rows are read one at a time, in the
    head's own dtype (`read_row`), and cached; a pass whose first draft is rejected reads one row,
    not four, and greedy choice arg-maxes the half floats without a float32 copy
    (`fp16_argmax`). A head built with --head-argmax has no logits, only each row's `argmax` and
    winning `max_logit`.

    The NaN rule (`fp16_argmax.NonFiniteLogits`): every row is checked whole when it is first
    read, whatever asks for it, so a row yields one token or an error however it is used; a
    --head-argmax row checks its winning maximum (the only value such a head reports: a NaN or
    -inf inside a chunk that lost is not seen).

    `read_argmax` (Core ML's worker process, where the rows live): a row's argmax by the same
    function on the same row, without bringing the row across; it refuses a non-finite row too.
    """

    def __init__(self, rows: int, read_row: Callable[[int], np.ndarray] | None, *,
                 read_argmax: Callable[[int], int] | None = None,
                 argmax: np.ndarray | None = None, max_logit: np.ndarray | None = None,
                 backend_seconds: float = 0.0, host_seconds: float = 0.0):
        self.rows = rows
        self._read_row = read_row
        self._read_argmax = read_argmax
        self._native: dict[int, np.ndarray] = {}
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

    def row_native(self, i: int) -> np.ndarray:
        """Row i [V] in the head's dtype (float16 or float32), checked finite; read-only: it is
        the cache every other view of the row comes from."""
        i = range(self.rows)[i]
        if self._read_row is None:
            raise AneSpecError("this build's head emits only argmax (--head-argmax): no logits")
        if i not in self._native:
            row = np.ascontiguousarray(self._read_row(i))
            try:
                best = argmax(row)  # refuses a non-finite row, in the same pass over it
            except NonFiniteLogits:
                raise NonFiniteLogits(f"row {i} of the pass") from None
            row.flags.writeable = False
            self._native[i], self._argmax[i] = row, best
        return self._native[i]

    def row_logits(self, i: int) -> np.ndarray:
        """Row i's logits [V] (float32; negative i counts from the end)."""
        i = range(self.rows)[i]
        if i not in self._logits:
            self._logits[i] = self.row_native(i).astype(np.float32)
        return self._logits[i]

    def row_argmax(self, i: int) -> int:
        i = range(self.rows)[i]
        if self._max_logit is not None and not np.isfinite(self._max_logit[i]):
            raise NonFiniteLogits(f"row {i} of the pass")  # a --head-argmax row
        if i not in self._argmax:
            if self._read_argmax is None:
                self.row_native(i)
            else:  # the same function on the same row, where the row lives (a worker)
                try:
                    self._argmax[i] = self._read_argmax(i)
                except NonFiniteLogits:
                    raise NonFiniteLogits(f"row {i} of the pass") from None
        return self._argmax[i]

    def row_values(self, i: int, ids: np.ndarray) -> np.ndarray:
        """Row i's logits at `ids` (float32), without a float32 copy of the row."""
        return self.row_native(i)[ids].astype(np.float32)

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
        return np.array([self.row_native(i)[self.row_argmax(i)] for i in range(self.rows)],
                        dtype=np.float32)


@dataclass
class Embeddings:
    """token_embd rows from the build's .npy files, dequantized only for the rows looked up."""

    qs: np.ndarray | None = None
    scales: np.ndarray | None = None
    table: np.ndarray | None = None
    # Gemma 3 multiplies each looked-up row by sqrtf(hidden) in fp32 (gemma3.cpp `inp_scaled`).
    # Done here, as llama.cpp does it, rather than folded into the stored table: sqrt(d) is not
    # a power of two, so folding would requantize the Q8_0 rows (or round every fp16 block
    # scale), while an fp32 multiply before the one fp16 rounding of the input costs nothing.
    scale: np.float32 | None = None

    @classmethod
    def load(cls, loaded: LoadedManifest) -> "Embeddings":
        m = loaded.manifest
        e = m.embeddings
        files = {k: np.load(loaded.path(ref), mmap_mode="r") for k, ref in e.files.items()}
        scale = (np.float32(math.sqrt(m.model.hidden_size))
                 if m.model.architecture.embed_scale else None)
        if e.format == "q8_0":
            return cls(qs=files["qs"], scales=files["scales"], scale=scale)
        return cls(table=files["table"], scale=scale)

    def lookup(self, tokens: Sequence[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if self.table is not None:
            rows = self.table[ids].astype(np.float32)
        else:
            qs = self.qs[ids].reshape(len(ids), -1, 32).astype(np.float32)
            rows = (qs * self.scales[ids].astype(np.float32)[..., None]).reshape(len(ids), -1)
        return rows if self.scale is None else rows * self.scale


@dataclass
class ShardPipeline:
    loaded: LoadedManifest
    backend: Backend
    decode_shape: DecodeShape = "fixed"
    # Core ML loads its programs in a worker process: at once (the CLI, probes), or when the
    # caller says (`start()`: the daemon, from its warm-up, so /health answers meanwhile).
    defer_start: bool = False
    # Which prompt chunks use the build's prefill function (decode/prefill_plan.py): auto
    # (where the measured costs say it pays), on (all), off (none).
    prefill_mode: PrefillMode = "auto"
    shards: list[LoadedProgram] = field(init=False)
    heads: list[LoadedProgram] = field(init=False)  # the LM head's packages, vocabulary order
    head: SplitHead = field(init=False)             # all of them as one program
    # Per-process measurements that layers above make once per loaded model (the decode
    # engine's pass-cost policy), kept with the model they describe.
    measurements: dict[str, Any] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        m = self.loaded.manifest
        runnable = range(OLDEST_RUNNABLE_GRAPH_REVISION, GRAPH_REVISION + 1)
        if m.graph_revision not in runnable:
            runs = (f"revision {runnable[0]}" if len(runnable) == 1
                    else f"revisions {runnable[0]}..{runnable[-1]}")
            raise ManifestError(
                f"{self.loaded.file}: built with graph revision {m.graph_revision}; this ane-spec "
                f"runs {runs} (older graphs can let one overflowing row change the output; newer "
                "ones need a newer ane-spec): rebuild with `ane-spec build --force`")
        self.manifest = m
        check_prefill_mode(self.prefill_mode)
        self.config = m.model
        self.max_seq = m.build.max_seq
        self.max_t = m.build.t_range[1]
        self.shape = DecodeShapePolicy(self.decode_shape, self.max_t)
        self.layout = m.build.layout
        self.head_layout = m.build.head_layout
        self.head_argmax = m.build.head_argmax
        self.input_dtype = np.float32 if self.backend.precision == "fp32" else np.float16
        self.host = HostInputs(m.rope, self.max_seq, self.max_t, self.input_dtype,
                               rope_local=m.rope_local,
                               window=m.model.sliding_window if m.rope_local else 0,
                               ring=m.build.swa_ring, prefill_t=m.build.prefill_t,
                               kv_write=m.build.kv_write)
        self.embeddings = Embeddings.load(self.loaded)
        refusal = q8_block_refusal(m.build.weights, getattr(self.backend, "compute_units", ""))
        if refusal:  # before any package is compiled or loaded
            raise AneSpecError(refusal)
        # The manifest's hashes key Core ML's compiled-model cache (no re-hashing 2 GB shards).
        self.shards = [self.backend.load(self.loaded.path(s.file), digest=s.file.digest,
                                         function=m.build.decode_function)
                       for s in m.shards]
        # The same packages' prefill functions: one state (made by the decode program) serves
        # both, as the packages declare the same states for both.
        self.prefill_t = m.build.prefill_t
        self.prefill_shards = [
            self.backend.load(self.loaded.path(s.file), digest=s.file.digest,
                              function=m.build.prefill_function)
            for s in m.shards] if self.prefill_t else []
        self.heads = [self.backend.load(self.loaded.path(h.file), digest=h.file.digest)
                      for h in m.heads]
        self.head = SplitHead(self.heads, m.heads, self.loaded.file)
        if not self.defer_start:
            self.start()

    def start(self) -> None:
        """Have the backend load every program now (Core ML: in its worker process)."""
        start_backend(self.backend)

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
        return PipelineState([shard.make_state() for shard in self.shards], self.host.new_ring())

    def can_resume(self, state: PipelineState, n: int) -> bool:
        """Whether `state`, holding a conversation's K/V, can go on writing at position n (its
        first n tokens kept). Always with full-length states; a ring must still hold the
        positions the row at n sees (`RingSlots.holds_window`): a shorter prefix of a long
        conversation has lost them to later positions and must be recomputed."""
        return state.ring is None or state.ring.holds_window(n)

    def copy_state(self, state: PipelineState) -> PipelineState:
        """A new state holding the same K/V, value for value: read back after the write, so a
        write that did not land fails here rather than making both sides of a probe equally
        wrong (the probes compare runs that start from copies)."""
        copy = self.new_state()
        copy.ring = None if state.ring is None else state.ring.copy()
        for k, (shard, src, dst) in enumerate(zip(self.shards, state.shard_states,
                                                  copy.shard_states)):
            for name in shard.state_names:
                value = shard.read_state(src, name)
                shard.write_state(dst, name, value)
                # Bit for bit: NaN is not equal to itself, and a probe may copy a NaN cache.
                back = np.asarray(shard.read_state(dst, name))
                if back.shape != value.shape or back.dtype != value.dtype or \
                        back.tobytes() != np.asarray(value).tobytes():
                    raise AneSpecError(f"shard {k}: state '{name}' written with write_state "
                                       "reads back different values: the write did not land")
        return copy

    # --- layout ---------------------------------------------------------------------------

    def to_hidden(self, rows: np.ndarray) -> np.ndarray:
        """[T, d] float rows -> the packages' hidden layout."""
        x = rows.astype(self.input_dtype).T  # [d, T]
        return (x[None, :, :, None] if self.layout == "BCT1" else x[None, :, None, :]).copy()

    def token_major(self, x: np.ndarray) -> np.ndarray:
        """A [T, channels] view of a hidden-layout array or head output (no copy)."""
        return token_major(x, self.layout)

    def head_major(self, x: np.ndarray) -> np.ndarray:
        """A [T, V_i] view of one logits output of the head, in its build.head_layout."""
        return head_token_major(x, self.layout, self.head_layout)

    def from_hidden(self, x: np.ndarray) -> np.ndarray:
        """Hidden layout (or a head output) -> [T, channels] float32."""
        return np.ascontiguousarray(self.token_major(x), dtype=np.float32)

    # --- running -------------------------------------------------------------------------

    def run_shards(self, hidden: np.ndarray, inputs: dict[str, np.ndarray], state: PipelineState,
                   shard_range: range | None = None, *, prefill: bool = False) -> np.ndarray:
        """Hidden states through the shards (all, or a range of them, for per-shard gates): their
        decode programs, or with `prefill` their prefill programs (on the same states)."""
        programs = self.prefill_shards if prefill else self.shards
        for n in shard_range or range(len(programs)):
            hidden = programs[n].predict({"x": hidden, **inputs}, state.shard_states[n])["hidden"]
        return hidden

    def require_prefill(self) -> int:
        """The prefill function's width P; refuses a build without one."""
        if not self.prefill_t:
            raise AneSpecError("this build has no prefill function (built with --prefill-t 0, "
                               "or before it existed): prompts run at the decode shape")
        return self.prefill_t

    def prefill_inputs(self, tokens: Sequence[int], position: int,
                       state: PipelineState) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """The hidden states and host inputs of one prefill chunk: `tokens` (1..P) at slots
        position.., padded to P with rows that repeat the last token and write nothing."""
        self.require_prefill()
        if not 1 <= len(tokens) <= self.prefill_t:
            raise AneSpecError(f"a prefill pass takes 1..{self.prefill_t} tokens, got "
                               f"{len(tokens)}")
        inputs = self.host.block(position, len(tokens), self.prefill_t, state.ring)
        padded = [*tokens, *[tokens[-1]] * (self.prefill_t - len(tokens))]
        self._check_tokens(padded)
        return self.to_hidden(self.embeddings.lookup(padded)), inputs

    def run_prefill(self, tokens: Sequence[int], position: int, state: PipelineState, *,
                    head: bool) -> BlockOutput | None:
        """One pass of the prefill function over `tokens` (1..P) written at slots position..
        (padding rows write nothing), layers only. With `head`, the LM head then runs on the
        chunk's last real row alone, repeated to the decode shape's width as a decode pass pads
        (`pass_width(1)` rows; only row 0 is read): its logits are a one-row BlockOutput, the
        prompt's first new token. Without, None: nothing past the layers is computed."""
        t0 = time.perf_counter()
        hidden, inputs = self.prefill_inputs(tokens, position, state)
        last, width = len(tokens) - 1, self.shape.pass_width(1)
        host = time.perf_counter() - t0
        t1 = time.perf_counter()
        run_pass = getattr(self.backend, "run_pass", None)
        if run_pass is not None and not (head and self.head_argmax):
            # Core ML: the layers (and the row through the head) in one call to the worker
            from ane_spec.runtime.coreml_worker import HeadRows

            chunks = self.manifest.head_chunks
            kept = run_pass(self.prefill_shards, state.shard_states, hidden, inputs,
                            self.heads if head else [],
                            HeadRows(tuple(f"logits_{i}" for i in range(len(chunks))),
                                     tuple((int(a), int(b)) for a, b in chunks), self.layout,
                                     self.head_layout),
                            [0], head_row=(last, width))
            if not head:
                return None
            result = BlockOutput(1, kept.read_row, read_argmax=kept.argmax)
        else:
            out = self.run_shards(hidden, inputs, state, prefill=True)
            if not head:
                return None
            outputs = self.head.predict({"x": repeat_row(out, last, width, self.layout)})
            result = None
        backend = time.perf_counter() - t1
        t2 = time.perf_counter()
        if result is None:
            result = self._read_head(outputs, 1)
        result.backend_seconds = backend
        result.host_seconds = host + time.perf_counter() - t2
        return result

    def prefill_hidden(self, tokens: Sequence[int], position: int,
                       state: PipelineState) -> np.ndarray:
        """One pass of the prefill function over `tokens` (1..P) at slots position.., layers
        only: the pass's output in the hidden layout, all P rows (the real rows first; padding
        rows follow and mean nothing). For gates and probes that read every row's logits
        (`head_rows`); decoding reads only the last row's (`run_prefill`)."""
        hidden, inputs = self.prefill_inputs(tokens, position, state)
        return self.run_shards(hidden, inputs, state, prefill=True)

    def head_rows(self, hidden: np.ndarray, rows: Sequence[int], *,
                  width: int | None = None) -> BlockOutput:
        """The LM head's outputs for some hidden rows of a pass (indices along its token axis),
        the head run on them as decode passes run it: up to max_t rows at a time, each group
        padded to the decode shape's width by repeating its last row. Row i of the result is
        `rows[i]`. For the prefill function's rows, whose pass is wider than the head's.
        `width` pads every group to that width instead (probes comparing rows read one at a
        time with rows read together, where the mixed decode shape would run T=1 and T=4)."""
        axis = token_axis(self.layout)
        groups: list[BlockOutput] = []
        for first in range(0, len(rows), self.max_t):
            group = [int(r) for r in rows[first:first + self.max_t]]
            padded_to = width or self.shape.pass_width(len(group))
            picked = group + [group[-1]] * (padded_to - len(group))
            x = np.ascontiguousarray(np.take(hidden, picked, axis=axis))
            groups.append(self._read_head(self.head.predict({"x": x}), len(group)))
        if self.head_argmax:
            return BlockOutput(len(rows), None,
                               argmax=np.concatenate([g.argmax for g in groups]),
                               max_logit=np.concatenate([g.max_logit for g in groups]))
        return BlockOutput(len(rows),
                           lambda i: groups[i // self.max_t].row_native(i % self.max_t))

    def prefill_rows(self, tokens: Sequence[int], positions: Sequence[int],
                     writes: Sequence[bool], state: PipelineState) -> np.ndarray:
        """One pass of the prefill function over P arbitrary rows (token, position, writes its
        slot or not), layers only: its output in the hidden layout (`head_rows` reads logits).
        `run_rows` at the prefill function's width, for probes."""
        if len(tokens) != len(positions) or len(tokens) != self.require_prefill():
            raise AneSpecError(f"a prefill pass holds {self.prefill_t} rows, each with one "
                               "token and one position")
        inputs = self.host.rows(positions, writes, state.ring)
        self._check_tokens(tokens)
        return self.run_shards(self.to_hidden(self.embeddings.lookup(tokens)), inputs, state,
                               prefill=True)

    def run(self, tokens: Sequence[int], position: int, state: PipelineState, *,
            width: int | None = None) -> BlockOutput:
        """One pass over `tokens` (1..T_max) written at slots position..position+T-1.

        `width`: rows the backend computes (default: the decode shape's). Rows past the tokens
        repeat the last token and write nothing; only the real rows' outputs are read."""
        t0 = time.perf_counter()
        if not 1 <= len(tokens) <= self.max_t:
            raise AneSpecError(f"a pass takes 1..{self.max_t} tokens, got {len(tokens)}")
        width = self.shape.pass_width(len(tokens)) if width is None else width
        # Records the pass's ring writes before it runs, and keeps them if it fails: the slots
        # then count as holding the new positions (hidden until written again), never as still
        # holding what a partial write may have overwritten, so `can_resume` stays safe.
        inputs = self.host.block(position, len(tokens), width, state.ring)
        padded = [*tokens, *[tokens[-1]] * (width - len(tokens))]
        return self._run(padded, inputs, state, len(tokens), t0)

    def run_rows(self, tokens: Sequence[int], positions: Sequence[int], writes: Sequence[bool],
                 state: PipelineState) -> BlockOutput:
        """One pass of arbitrary rows (token, position, writes its slot or not); every row is
        read. For probes that place the same token at different row indices."""
        t0 = time.perf_counter()
        if len(tokens) != len(positions):
            raise AneSpecError("every row needs one token and one position")
        return self._run(tokens, self.host.rows(positions, writes, state.ring), state,
                         len(tokens), t0)

    def _check_tokens(self, tokens: Sequence[int]) -> None:
        bad = [t for t in tokens if not 0 <= t < self.config.vocab_size]
        if bad:
            raise AneSpecError(f"token ids {bad[:5]} are outside the vocabulary "
                               f"0..{self.config.vocab_size - 1}")

    def _run(self, tokens: Sequence[int], inputs: dict[str, np.ndarray], state: PipelineState,
             rows: int, t0: float) -> BlockOutput:
        self._check_tokens(tokens)
        hidden = self.to_hidden(self.embeddings.lookup(tokens))
        host = time.perf_counter() - t0

        t1 = time.perf_counter()
        run_pass = None if self.head_argmax else getattr(self.backend, "run_pass", None)
        if run_pass is not None:
            # Core ML in its worker process: the whole pass is one call, and the logits stay
            # there; a row crosses when it is read, an argmax without its row, the argmax of
            # the rows greedy decoding reads with the reply (runtime/coreml_worker.py): the same
            # values as `_read_head` reads here.
            from ane_spec.runtime.coreml_worker import HeadRows

            chunks = self.manifest.head_chunks
            kept = run_pass(self.shards, state.shard_states, hidden, inputs, self.heads,
                            HeadRows(tuple(f"logits_{i}" for i in range(len(chunks))),
                                     tuple((int(a), int(b)) for a, b in chunks), self.layout,
                                     self.head_layout),
                            list(tokens[:rows]))
        else:
            outputs = self.head.predict({"x": self.run_shards(hidden, inputs, state)})
        backend = time.perf_counter() - t1

        t2 = time.perf_counter()
        result = (BlockOutput(rows, kept.read_row, read_argmax=kept.argmax)
                  if run_pass is not None
                  else self._read_head(outputs, rows))
        result.backend_seconds = backend
        result.host_seconds = host + time.perf_counter() - t2
        return result

    def _read_head(self, outputs: dict[str, np.ndarray], rows: int) -> BlockOutput:
        """The first `rows` rows of the head's outputs: padding rows are never read."""
        chunks = self.manifest.head_chunks
        if not self.head_argmax:
            views = [(start, end, self.head_major(outputs[f"logits_{i}"]))  # [T, V_i], no copy
                     for i, (start, end) in enumerate(chunks)]

            def read_row(r: int) -> np.ndarray:
                # Core ML's [1, V_i, T, 1] buffers keep a row's logits T apart: one strided copy
                # per chunk into a row in the head's own dtype (a vocab-last head's are
                # contiguous: one plain copy).
                row = np.empty(chunks[-1][1], dtype=views[0][2].dtype)
                for start, end, view in views:
                    row[start:end] = view[r]
                return row

            return BlockOutput(rows, read_row)
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
                   state: PipelineState | None = None, *, prefill: bool = False) -> np.ndarray:
    """Logits [T, V] for `tokens` from position 0. Pass `state` to keep the filled KV slots for
    decoding.

    By default in decode-shape passes of T_max tokens (the last one shorter, padded in the fixed
    decode shape). With `prefill`, in passes of the build's prefill function (P tokens, the last
    chunk padded to P), every row then run through the LM head (`head_rows`): what decoding
    computes for the chunk's last row, for every row, so gates can compare each position."""
    if pipeline.head_argmax:
        raise AneSpecError("this build's head emits only argmax (--head-argmax); rebuild "
                           "without it to dump logits")
    if len(tokens) > pipeline.max_seq:
        raise AneSpecError(f"{len(tokens)} tokens do not fit the build's context window of "
                           f"{pipeline.max_seq}")
    state = state or pipeline.new_state()
    rows = []
    if prefill:
        p = pipeline.require_prefill()
        for start in range(0, len(tokens), p):
            chunk = tokens[start:start + p]
            hidden = pipeline.prefill_hidden(chunk, start, state)
            rows.append(pipeline.head_rows(hidden, range(len(chunk))).logits)
        return np.concatenate(rows, axis=0)
    for start in range(0, len(tokens), pipeline.max_t):
        rows.append(pipeline.run(tokens[start:start + pipeline.max_t], start, state).logits)
    return np.concatenate(rows, axis=0)
