"""A conversation's K/V states as host arrays: capture from a pipeline state, install into one.

Only slots 0..n-1 of a conversation of n tokens mean anything (the session never trusts a slot
past its tokens), so a capture keeps just those rows of the sequence axis: a 300-token chat in a
2048-slot build costs 15% of the state. Installing writes them back and zeros the rest, which is
what a fresh state holds there: a restored slot is "a fresh state plus the same tokens".

Values are kept in the dtype the backend stores them in, so a capture and an install round-trip
bit for bit: fp16 on Core ML (states are fp16 only) and in the interpreter's fp16 mode, float32
in its fp32 mode. `LoadedProgram.read_state` returns float32 copies; converting back to the
stored dtype is exact because every value came from it. Through the Core ML worker the slicing,
the cast and the zero padding happen in the worker, and rows cross through shared memory
(runtime/state_rows.py): a 300-token capture at Phi-4-mini's shape moves 300 rows of fp16, not
the whole float32 state.

A build with KV rings (model/swa_ring.py) keeps its local layers' states whole (R slots, any
conversation length), and a capture carries the ring's per-slot positions beside the arrays
(`ring_positions`): past the n tokens they are forgotten, so an install knows exactly which
positions its slots hold and a later prefix check (`ShardPipeline.can_resume`) stays exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ane_spec.model.swa_ring import RingSlots
from ane_spec.runtime.pipeline import PipelineState, ShardPipeline
from ane_spec.runtime.state_rows import read_rows, write_rows

# The layer graph's K/V states are [1, kv_heads, max_seq, head_dim] (shards/programs.py).
SEQ_AXIS = 2


@dataclass(frozen=True)
class StateEntry:
    shard: int
    name: str
    shape: tuple[int, ...]
    seq_axis: int | None  # None: an unexpected shape, kept whole


class StateLayout:
    """Every state tensor of a pipeline, in one fixed order (shard, then its state names)."""

    def __init__(self, pipeline: ShardPipeline):
        self.pipeline = pipeline
        self.max_seq = pipeline.max_seq
        self.dtype = np.dtype(np.float32 if pipeline.backend.precision == "fp32" else np.float16)
        specs = {(k, s.name): tuple(int(d) for d in s.shape)
                 for k, shard in enumerate(pipeline.manifest.shards) for s in shard.states}
        entries = []
        for k, program in enumerate(pipeline.shards):
            for name in program.state_names:
                shape = specs[(k, name)]
                axis = (SEQ_AXIS if len(shape) == 4 and shape[SEQ_AXIS] == self.max_seq
                        else None)
                entries.append(StateEntry(k, name, shape, axis))
        self.entries: tuple[StateEntry, ...] = tuple(entries)
        host = pipeline.host
        self.ring, self.window = host.ring, host.window  # ring slots (0: none), local window

    def shape(self, entry: StateEntry, n: int) -> tuple[int, ...]:
        """The shape a capture of n tokens keeps of this state."""
        if entry.seq_axis is None:
            return entry.shape
        return tuple(n if i == entry.seq_axis else d for i, d in enumerate(entry.shape))

    def nbytes(self, n: int) -> int:
        return sum(math.prod(self.shape(e, n)) for e in self.entries) * self.dtype.itemsize

    def capture(self, state: PipelineState, n: int) -> list[np.ndarray]:
        """Copies of the first n token rows of every state tensor, in the stored dtype. A
        backend that can (the Core ML worker) slices and casts where the state lives, so only
        those rows cross (runtime/state_rows.py)."""
        return [read_rows(self.pipeline.shards[e.shard], state.shard_states[e.shard], e.name,
                          n, e.seq_axis, self.dtype)
                for e in self.entries]

    def ring_positions(self, state: PipelineState, n: int) -> list[int] | None:
        """The positions a capture of n tokens holds in each ring slot (-1: none), or None
        without a ring."""
        if state.ring is None:
            return None
        ring = state.ring.copy()
        ring.forget_from(n)
        return ring.positions()

    def make_ring(self, positions: list[int] | None, n: int) -> RingSlots | None:
        """The ring record for an install of n tokens (ValueError: positions that this build's
        ring cannot hold, or none where it needs them)."""
        if not self.ring:
            if positions is not None:
                raise ValueError("ring positions for a build without KV rings")
            return None
        if positions is None:
            raise ValueError("this build's KV rings need their slots' positions")
        ring = RingSlots.from_positions(self.ring, self.window, positions)
        ring.forget_from(n)
        return ring

    def clear(self, state: PipelineState) -> None:
        """Zero every state tensor: what a fresh state holds (the zeros are made where the state
        lives: no full-size array crosses to the Core ML worker)."""
        state.ring = self.pipeline.host.new_ring()
        for e in self.entries:
            write_rows(self.pipeline.shards[e.shard], state.shard_states[e.shard], e.name,
                       None, 0, e.seq_axis, e.shape, self.dtype)

    def install(self, state: PipelineState, arrays: list[np.ndarray], n: int,
                ring: list[int] | None = None) -> None:
        """Write captured rows into `state` (zeros past them), and a ring build's positions
        (`ring_positions` of the capture). Only the rows cross to the Core ML worker."""
        state.ring = self.make_ring(ring, n)
        for e, rows in zip(self.entries, arrays, strict=True):
            write_rows(self.pipeline.shards[e.shard], state.shard_states[e.shard], e.name,
                       rows, n, e.seq_axis, e.shape, self.dtype)
