"""The host-side inputs of one pass, built in one place for every backend.

Slots are append-only: a row at position q writes slot q (when it writes at all) and may see
slots 0..q. Slots past q may hold rejected drafts from an earlier pass; the mask hides them and a
later pass overwrites them, so no state copy or rollback is ever needed.

A pass can be wider than the tokens it carries. In the fixed decode shape every pass runs at
T = 4, and a prompt chunk of the prefill function (`prefill_t` > 0) at T = prefill_t; the rows
past the real ones are padding: they repeat the last real row's position, so
their RoPE rows and masks stay in range at the end of the context, and their `kv_write_mask`
column is all zero, so they write nothing. `keep = 1 - rowsum(write)` then counts real rows only.

Models with sliding-window layers (Gemma 3) carry their local layers' inputs in the same three
arrays, after the global ones: `rope_cos`/`rope_sin` are [T, rot] (global tables, then the
local RoPE's), `attn_mask` is [1, 2, T, S] (the causal mask, then the local one, where row q sees
slots q - W < s <= q only: llama.cpp's is_masked_swa hides s when q - s >= W). One input set
for every shard (programs.py says why); other models' inputs are what they always were.

A build with KV rings (`ring` > 0, model/swa_ring.py) keeps each local layer's K/V in R slots,
position q in slot q mod R. The local mask and write mask then cover the ring's slots and ride
after the global ones along the slot axis: `attn_mask` [1, 1, T, S + R], `kv_write_mask`
[1, 1, S + R, T]. The local visibility is computed from the position each ring slot holds after
the pass's writes (`RingSlots`, one per conversation, which `block`/`rows` update): slot j is
visible to row p iff it holds q with p - W < q <= p, llama.cpp's swa rule as above.

A slice-write build (`kv_write="slice"`, manifest build.kv_write) writes K/V through windows
of `width` slots (4 in a decode pass, P in a prefill chunk: the program's width) instead of the
whole state: `kv_write_mask` is then [1, 1, n * width, T], one [width, T] one-hot per window
(its rows are the window's slots), and `kv_write_start` [T, n] int32 holds each window's first
slot, repeated in every row. The window covers the slots the pass writes; rows that write
nothing keep a zero column as before, and a window slot no row writes keeps its value, so the
state after a pass is the scatter's (layer_graph.window_rows). Where the written slots start
less than `width` before the end of the state, the window starts at S - width instead (never
past the state, and still over every written slot). n = 1, or with a ring 3: the global
layers' window, then the ring's two, which a pass needs when its block wraps past the ring's
last slot (slots R-a.. in one window at R - width, 0..b-1 in the other at 0); a block that
does not wrap uses the first, and the second writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.manifests.schema import KV_WRITE_START
from ane_spec.model.rope import RopeSpec
from ane_spec.model.swa_ring import RingSlots

# The attn_mask value of a hidden slot (visible slots are 0), one feed for both mask forms
# (manifest build.mask_form). The select form selects on its sign, so no score can outweigh it;
# the additive form adds it, and needs exactly this value: -32768 (= layer_graph.HIDDEN_SCORE)
# gives hidden slots 0 weight with no fp16 overflow for every |score| < 16368 (the reasoning is
# in layer_graph's docstring). A power of two: exact in fp16 and fp32 alike.
MASK_VALUE = -32768.0


@dataclass
class HostInputs:
    """Precomputed RoPE tables for every slot; per call, only slices and two small masks."""

    rope: RopeSpec
    max_seq: int
    max_t: int = 4
    # fp16 is what the packages declare and the ANE runs; fp32 lets an fp32 backend measure the
    # graph's own math without the rounding of its inputs.
    dtype: type = np.float16
    # The sliding-window layers' RoPE and window (None / 0: the model has no such layers).
    rope_local: RopeSpec | None = None
    window: int = 0
    # Slots of the local layers' KV ring (0: their states are full-length).
    ring: int = 0
    # The prefill function's fixed width (0: the build has none): the one width above max_t a
    # pass may have.
    prefill_t: int = 0
    # How the build's layers write K/V (manifest build.kv_write): "slice" takes windows.
    kv_write: str = "scatter"

    def __post_init__(self) -> None:
        if (self.rope_local is None) != (self.window <= 0):
            raise AneSpecError("local-layer inputs need both the local RoPE and a window > 0")
        if self.kv_write not in ("scatter", "slice"):
            raise AneSpecError(f"unknown K/V write form {self.kv_write!r}")
        if self.ring and not self.window < self.ring < self.max_seq:
            raise AneSpecError(f"a KV ring of {self.ring} slots needs a window below it "
                               f"({self.window}) and a context above it ({self.max_seq})")
        self.cos, self.sin = self._tables(self.rope)
        # Row q of a mask hides slots q+1.. : every such row is one window of a single ramp
        # (S zeros, then S - 1 hidden), so a pass's mask is one gather, with no [T, S] compare.
        # Row q reads ramp[S-1-q : 2S-1-q], so slot s is ramp index S-1-q+s.
        ramp = np.full(2 * self.max_seq - 1, MASK_VALUE, dtype=self.dtype)
        ramp[: self.max_seq] = 0.0
        self._mask_rows = np.lib.stride_tricks.sliding_window_view(ramp, self.max_seq)[::-1]
        if self.rope_local is not None:
            cos_local, sin_local = self._tables(self.rope_local)
            self.cos = np.concatenate([self.cos, cos_local], axis=1)
            self.sin = np.concatenate([self.sin, sin_local], axis=1)
            # Visible: q - W < s <= q, i.e. ramp indices S-W .. S-1.
            local = np.full(2 * self.max_seq - 1, MASK_VALUE, dtype=self.dtype)
            local[max(0, self.max_seq - self.window): self.max_seq] = 0.0
            self._local_rows = np.lib.stride_tricks.sliding_window_view(
                local, self.max_seq)[::-1]

    def _tables(self, rope: RopeSpec) -> tuple[np.ndarray, np.ndarray]:
        cos, sin = rope.tables(np.arange(self.max_seq), np.float64)
        return cos.astype(self.dtype), sin.astype(self.dtype)

    def new_ring(self) -> RingSlots | None:
        """A fresh conversation's ring positions (None without a ring)."""
        return RingSlots(self.ring, self.window) if self.ring else None

    def block(self, position: int, t: int, width: int | None = None,
              ring: RingSlots | None = None) -> dict[str, np.ndarray]:
        """`t` real rows at positions position..position+t-1, all writing, padded to `width`.
        `ring`: the conversation's ring positions, updated with this pass's writes; without one
        a ring build assumes a state filled in order up to this pass (`RingSlots.filled_to`)."""
        width = t if width is None else width
        if not (1 <= t <= width and (width <= self.max_t or width == self.prefill_t)):
            widths = f"1..{self.max_t}" + (f" or {self.prefill_t}" if self.prefill_t else "")
            raise AneSpecError(f"a pass holds {widths} rows, got {t} real rows in a pass "
                               f"of {width}")
        if position < 0 or position + t > self.max_seq:
            raise AneSpecError(f"positions {position}..{position + t - 1} do not fit the "
                               f"context window of {self.max_seq} slots")
        positions = position + np.minimum(np.arange(width), t - 1)
        return self._inputs(positions, np.arange(width) < t, ring)

    def rows(self, positions: Sequence[int], writes: Sequence[bool],
             ring: RingSlots | None = None) -> dict[str, np.ndarray]:
        """Any rows: each at its own position, writing its slot or not. Probes use this to put
        the same token at every row index of a pass."""
        pos = np.asarray(positions, dtype=np.int64)
        wr = np.asarray(writes, dtype=bool)
        width_ok = 1 <= len(pos) <= self.max_t or len(pos) == self.prefill_t
        if not width_ok or wr.shape != pos.shape:
            widths = f"1..{self.max_t}" + (f" or {self.prefill_t}" if self.prefill_t else "")
            raise AneSpecError(f"a pass holds {widths} rows, each with one write flag")
        if pos.min() < 0 or pos.max() >= self.max_seq:
            raise AneSpecError(f"positions {pos.tolist()} do not fit the context window of "
                               f"{self.max_seq} slots")
        if len(set(pos[wr].tolist())) != int(wr.sum()):
            raise AneSpecError(f"two rows of one pass write the same slot: {pos[wr].tolist()}")
        if self.ring and len(set((pos[wr] % self.ring).tolist())) != int(wr.sum()):
            raise AneSpecError(f"two rows of one pass write the same ring slot: "
                               f"{pos[wr].tolist()} mod {self.ring}")
        return self._inputs(pos, wr, ring)

    def _inputs(self, positions: np.ndarray, writes: np.ndarray,
                ring: RingSlots | None = None) -> dict[str, np.ndarray]:
        t = len(positions)
        mask = self._mask_rows[positions]  # [t, S]: 0 at slots <= the row's position
        inputs = {
            "rope_cos": self.cos[positions],
            "rope_sin": self.sin[positions],
            "attn_mask": mask.reshape(1, 1, t, self.max_seq),
        }
        if self.kv_write == "slice":
            start = window_start(positions[writes], self.window_width(t), self.max_seq)
            inputs["kv_write_mask"] = self._window_mask(start, positions, writes)
            inputs[KV_WRITE_START] = np.full((t, 1), start, dtype=np.int32)
        else:
            write = np.zeros((self.max_seq, t), dtype=self.dtype)
            write[positions[writes], np.flatnonzero(writes)] = 1.0
            inputs["kv_write_mask"] = write.reshape(1, 1, self.max_seq, t)
        if self.ring:
            self._ring_inputs(inputs, positions, writes, ring)
        elif self.rope_local is not None:
            local = self._local_rows[positions].reshape(1, 1, t, self.max_seq)
            inputs["attn_mask"] = np.concatenate([inputs["attn_mask"], local], axis=1)
        return inputs

    def _ring_inputs(self, inputs: dict[str, np.ndarray], positions: np.ndarray,
                     writes: np.ndarray, ring: RingSlots | None) -> None:
        """Append the ring's visibility and write masks to the global ones (slot axis)."""
        t = len(positions)
        if ring is None:
            ring = RingSlots.filled_to(self.ring, self.window, int(positions.max()))
        elif (ring.rows, ring.window) != (self.ring, self.window):
            raise AneSpecError(f"a state's ring of {ring.rows} slots (window {ring.window}) "
                               f"does not fit this build's ({self.ring}, window {self.window})")
        slots = ring.slot(positions[writes])
        if self.kv_write == "slice":  # before the ring records the writes: a refusal leaves it
            first, second, in_second = ring_windows(slots, self.window_width(t), self.ring)
        ring.write(positions[writes])  # the layers scatter before they attend
        local = np.where(ring.visible(positions), 0.0, MASK_VALUE).astype(self.dtype)
        inputs["attn_mask"] = np.concatenate(
            [inputs["attn_mask"], local.reshape(1, 1, t, self.ring)], axis=3)
        if self.kv_write == "slice":
            ring_slots = np.full(t, -1, dtype=np.int64)  # -1: the row writes no ring slot
            ring_slots[writes] = slots
            parts = [inputs["kv_write_mask"]]
            for start, chosen in ((first, ~in_second), (second, in_second)):
                picked = writes.copy()
                picked[writes] = chosen
                parts.append(self._window_mask(start, ring_slots, picked))
            inputs["kv_write_mask"] = np.concatenate(parts, axis=2)
            inputs[KV_WRITE_START] = np.tile(np.array(
                [inputs[KV_WRITE_START][0, 0], first, second], dtype=np.int32), (t, 1))
            return
        write = np.zeros((self.ring, t), dtype=self.dtype)
        write[slots, np.flatnonzero(writes)] = 1.0
        inputs["kv_write_mask"] = np.concatenate(
            [inputs["kv_write_mask"], write.reshape(1, 1, self.ring, t)], axis=2)

    def window_width(self, t: int) -> int:
        """The slots of a slice-form window in a pass of t rows: the program's width (the
        decode program's max_t, or the prefill function's P), as programs.kv_write_window."""
        return self.max_t if t <= self.max_t else self.prefill_t

    def _window_mask(self, start: int, slots: np.ndarray, writes: np.ndarray) -> np.ndarray:
        """[1, 1, width, t]: row r's column is one-hot at its slot's place in the window
        starting at `start`, or zero where the row writes nothing."""
        t = len(slots)
        width = self.window_width(t)
        at = slots[writes] - start
        if ((at < 0) | (at >= width)).any():  # numpy would wrap a negative place silently
            raise AneSpecError(f"slots {slots[writes].tolist()} are not all in the window of "
                               f"{width} from {start}")
        write = np.zeros((width, t), dtype=self.dtype)
        write[at, np.flatnonzero(writes)] = 1.0
        return write.reshape(1, 1, -1, t)


def window_start(slots: np.ndarray, width: int, size: int) -> int:
    """The first slot of a `width`-slot window of a `size`-slot state that covers `slots`: the
    lowest written slot, or size - width where that would run past the state's end (0 when
    nothing is written: the window then writes nothing)."""
    if not len(slots):
        return 0
    lo, hi = int(slots.min()), int(slots.max())
    if hi - lo >= width:
        raise AneSpecError(f"one pass writes slots {lo}..{hi}; a slice-write build "
                           f"(--kv-write slice) writes a window of {width} slots a pass")
    return min(lo, size - width)


def ring_windows(slots: np.ndarray, width: int, rows: int) -> tuple[int, int, np.ndarray]:
    """Two windows of a `rows`-slot ring covering `slots`: (first start, second start, which
    slots the second takes). Slots within one window go to the first (the second then writes
    nothing, at the same place); a block that wraps puts its slots at the ring's end in a
    window at rows - width and the wrapped ones in a window at 0."""
    slots = np.asarray(slots, dtype=np.int64)
    if not len(slots) or int(slots.max() - slots.min()) < width:
        start = window_start(slots, width, rows)
        return start, start, np.zeros(len(slots), dtype=bool)
    second = slots < rows - width
    if (slots[second] >= width).any():
        raise AneSpecError(f"one pass writes ring slots {sorted(slots.tolist())}; a slice-write "
                           f"build (--kv-write slice) writes them in two windows of {width} "
                           f"slots, at the ring's end and its start")
    return rows - width, 0, second
