"""The host-side inputs of one pass, built in one place for every backend.

Slots are append-only: a row at position q writes slot q (when it writes at all) and may see
slots 0..q. Slots past q may hold rejected drafts from an earlier pass; the mask hides them and a
later pass overwrites them, so no state copy or rollback is ever needed.

A pass can be wider than the tokens it carries. In the fixed decode shape every pass runs at
T = 4 and the rows past the real ones are padding: they repeat the last real row's position, so
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ane_spec.errors import AneSpecError
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

    def __post_init__(self) -> None:
        if (self.rope_local is None) != (self.window <= 0):
            raise AneSpecError("local-layer inputs need both the local RoPE and a window > 0")
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
        if not 1 <= t <= width <= self.max_t:
            raise AneSpecError(f"a pass holds 1..{self.max_t} rows, got {t} real rows in a pass "
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
        if not 1 <= len(pos) <= self.max_t or wr.shape != pos.shape:
            raise AneSpecError(f"a pass holds 1..{self.max_t} rows, each with one write flag")
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
        write = np.zeros((self.max_seq, t), dtype=self.dtype)
        write[positions[writes], np.flatnonzero(writes)] = 1.0
        inputs = {
            "rope_cos": self.cos[positions],
            "rope_sin": self.sin[positions],
            "attn_mask": mask.reshape(1, 1, t, self.max_seq),
            "kv_write_mask": write.reshape(1, 1, self.max_seq, t),
        }
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
        ring.write(positions[writes])  # the layers scatter before they attend
        local = np.where(ring.visible(positions), 0.0, MASK_VALUE).astype(self.dtype)
        write = np.zeros((self.ring, t), dtype=self.dtype)
        write[ring.slot(positions[writes]), np.flatnonzero(writes)] = 1.0
        inputs["attn_mask"] = np.concatenate(
            [inputs["attn_mask"], local.reshape(1, 1, t, self.ring)], axis=3)
        inputs["kv_write_mask"] = np.concatenate(
            [inputs["kv_write_mask"], write.reshape(1, 1, self.ring, t)], axis=2)
