"""Sliding-window KV rings: how many slots a local layer keeps, and which position each holds.

A local (sliding-window) layer's row at position p sees key positions p - W < q <= p only
(llama.cpp's `is_masked_swa` hides q when p - q >= W). So its K/V state need not be max_seq
long: a ring of R slots where position q lives in slot q mod R serves any context, and a long
context costs the global layers only. The compiler sizes the ring's state, the host feeds its
write and visibility masks (`runtime/host_inputs.py`), and `RingSlots` tracks, per conversation,
the position each slot holds.

Why R >= W + T is enough (`ring_rows`), T being the widest pass the build runs: a decode or
verify block of MAX_T = 4 rows, or, where the build has a prefill function, a prompt chunk of
P rows (`build --prefill-t`, default 64; the manifest's `build.widest_pass`). Every pass writes
its rows BEFORE its attention reads the state (the layer scatters, then attends to what the
scatter returned), and a pass of width t <= T writes positions n..n+t-1 at most (a prefill
chunk's padding rows write nothing). Writing position n+i overwrites position n+i-R. The
earliest row of the pass, p = n, needs positions n-W+1..n; the latest overwritten one is
n+t-1-R. So nothing a row of the pass needs is overwritten iff n+t-1-R < n-W+1, i.e.
R >= W + t - 1, for every t up to T: R >= W + T - 1. A P-row pass also needs its P positions
in distinct slots, which R > P gives. Verification with rejections adds nothing: a rejected
draft at position q <= n+3 (verify passes are at most MAX_T wide, also after a P-row prefill)
has overwritten q-R <= n+3-R, and every later query is at some p >= n+1 (the pass's first row,
the pending token, is always kept), which needs only positions > p-W >= n+1-W: still above what
was lost, as R >= W + 3. The draft's own stale slot holds a position greater than any query
until that position is written again (position q always lives in slot q mod R), so the causal
half of the visibility rule (q_j <= p) hides it; a later pass that starts below it, a decode
block or a prompt chunk of the next turn, writes its true position into that same slot before
any of its rows reads it. A prompt chunk's padding rows repeat its last real row's position:
they see what that row sees and write nothing. R = W + T is therefore one slot more than the
minimum W + T - 1; the spare row keeps the rule simple to state and to check.

Then rounded up to a multiple of 32 (STATE_ALIGN): a state dimension that is not one fails on
the ANE (coremltools #2631; the residency lint warns of it, and --max-seq is refused for the
same reason). Gemma 3's windows are 512 and 1024: W + 64 (the default prefill function) is
576 and 1088 slots, already multiples of 32; a build without one (--prefill-t 0) keeps W + 4
rounded up, 544 and 1056. More slots than W + T change nothing above: every bound there is "at
least".

Resuming a ring at an earlier position (a shorter shared prefix, a prefix copy into another
slot) is a different matter: positions the prefix's next rows need may have been overwritten by
positions past it. `RingSlots.holds_window` says whether they were; where not, the caller must
recompute instead of reusing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ane_spec.model.config import ModelConfig

# What a slot that holds no position says. Negative, and far enough below every window that no
# visibility test can pass for it even without the explicit check (p - W < -1 holds for p < W-1).
NO_POSITION = -1
# State dimensions the ANE takes (module docstring).
STATE_ALIGN = 32


def ring_rows(window: int, max_t: int) -> int:
    """The ring size of a local layer: W + T rounded up to a multiple of STATE_ALIGN, `max_t`
    being T, the widest pass (module docstring: W + T - 1 is the least that keeps a pass of T
    rows exact)."""
    if window <= 0 or max_t <= 0:
        raise ValueError(f"a ring needs a window and a pass width > 0 (got {window}, {max_t})")
    return -(-(window + max_t) // STATE_ALIGN) * STATE_ALIGN


def uses_ring(window: int, max_t: int, max_seq: int) -> bool:
    """A ring saves state only when it is shorter than the full-length state."""
    return window > 0 and ring_rows(window, max_t) < max_seq


@dataclass
class RingSlots:
    """The position each ring slot holds, for one conversation (one `PipelineState`).

    `held[j]` is the last position written to slot j (NO_POSITION: none since the state was
    fresh). It changes only through `write`, called with the positions a pass writes before the
    pass runs; a rollback needs no call (module docstring: stale drafts hide themselves)."""

    rows: int
    window: int
    held: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.rows <= self.window:
            raise ValueError(f"a ring of {self.rows} slots cannot hold a window of {self.window}")
        if self.held is None:
            self.held = np.full(self.rows, NO_POSITION, dtype=np.int64)
        self.held = np.asarray(self.held, dtype=np.int64).copy()
        if self.held.shape != (self.rows,):
            raise ValueError(f"a ring of {self.rows} slots needs {self.rows} positions, "
                             f"got {self.held.shape}")

    @classmethod
    def filled_to(cls, rows: int, window: int, last: int) -> "RingSlots":
        """A ring written in order at positions 0..last: slot j holds the largest q <= last
        with q = j mod rows. What a state filled by plain in-order passes holds (probes that
        build a pass's inputs without a conversation use it)."""
        j = np.arange(rows)
        top = last - (last - j) % rows
        return cls(rows, window, np.where(top >= 0, top, NO_POSITION))

    def copy(self) -> "RingSlots":
        return RingSlots(self.rows, self.window, self.held)

    def slot(self, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64) % self.rows

    def write(self, positions: np.ndarray) -> None:
        """Record that a pass writes these positions (each to slot position mod rows)."""
        positions = np.asarray(positions, dtype=np.int64)
        if len(set(self.slot(positions).tolist())) != len(positions):
            raise ValueError(f"positions {positions.tolist()} share a ring slot of {self.rows}")
        self.held[self.slot(positions)] = positions

    def visible(self, positions: np.ndarray) -> np.ndarray:
        """[t, rows] bool: slot j is visible to a row at position p iff it holds a position q
        with p - W < q <= p (llama.cpp's is_masked_swa, the reference's rule)."""
        p = np.asarray(positions, dtype=np.int64)[:, None]
        q = self.held[None, :]
        return (q != NO_POSITION) & (p - q < self.window) & (q <= p)

    def holds_window(self, n: int) -> bool:
        """Whether a conversation can go on at position n from this ring: every position the
        row at n needs from before it (n - W < q < n) is still in its slot. Later rows need
        positions >= n - W + 1 as well, each either one of these or written after n."""
        need = np.arange(max(0, n - self.window + 1), n)
        return bool((self.held[self.slot(need)] == need).all())

    def forget_from(self, n: int) -> None:
        """Mark slots holding positions >= n as holding nothing (a capture of n tokens: what
        lies past them is not part of the conversation)."""
        self.held[self.held >= n] = NO_POSITION

    def positions(self) -> list[int]:
        return [int(q) for q in self.held]

    @classmethod
    def from_positions(cls, rows: int, window: int, held: Sequence[int]) -> "RingSlots":
        """A ring from saved positions (a spilled copy or a slot file); ValueError when they
        cannot be what a ring of this size holds."""
        arr = np.asarray(list(held), dtype=np.int64)
        if arr.shape != (rows,):
            raise ValueError(f"{len(arr)} ring positions for a ring of {rows} slots")
        written = arr[arr != NO_POSITION]
        if (written < 0).any() or ((written % rows) != np.flatnonzero(arr != NO_POSITION)).any():
            raise ValueError("a ring position is not in its slot (position mod ring size)")
        return cls(rows, window, arr)


def kv_state_bytes(c: "ModelConfig", max_seq: int, ring: int) -> int:
    """One conversation's fp16 K/V states over every layer: each global layer (and every layer
    when `ring` is 0) keeps max_seq slots, each local layer `ring` slots."""
    per_slot = 2 * c.num_kv_heads * c.head_dim * 2  # K and V, fp16
    return sum(per_slot * (ring if ring and c.is_local(i) else max_seq)
               for i in range(c.num_layers))
