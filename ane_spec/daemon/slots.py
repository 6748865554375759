"""KV slots: several conversations' caches kept at once, spilled to host memory, saved to disk.

A *slot* is one resident `PipelineState` (every shard's K/V states) plus the tokens its slots
0..n-1 hold. `acquire(prompt)` picks the slot a request runs in. The cached conversation
(resident or spilled) with the longest common token prefix is a *hit* when the request continues
it: the prefix covers that conversation's last prompt (a next turn, a regenerated answer; the
reply itself may re-tokenize differently) or all but fewer than MIN_SHARED of its tokens. A hit
runs in place when resident, or is restored into the least-recently-used resident slot.
Anything else is a *miss*: it takes the least-recently-used resident slot (an empty one first),
and when another conversation shares a useful prefix with it (at least MIN_SHARED tokens: an
app's system prompt) that prefix's K/V is copied in, so the other conversation stays intact.
With KV rings (sliding-window layers, model/swa_ring.py) that copy is made only while the
source's ring still holds the positions the prefix's next tokens see (`_continues`); otherwise
the prompt is recomputed.

A conversation that a slot's new occupant pushes out is *spilled* instead of dropped: its K/V
rows are copied to host memory (`kv_state`), up to a byte budget, the least recently used
spilled copy going first. Restoring one writes the rows back, far cheaper than the prefill that
rebuilt them (`scripts/bench_slots.py` measures both).

Every path ends with a state whose slots 0..p-1 hold exactly the K/V a fresh state would hold
after prefilling the same p tokens, and slots past p are never read before they are written, so
the output of a request does not depend on which slot served it.

Scopes: with `--draft-memory per-key` a request only reuses caches of its own scope (see
`ane_spec.daemon.draft_scopes`), so the time to first token cannot reveal another key's prompts.

Threads: only the engine's worker calls the mutating methods; `snapshot()` (for /slots) reads a
list the worker republishes after every change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.daemon.kv_state import StateLayout
from ane_spec.daemon.slot_files import (
    SlotFileError, SlotQuota, load_slot, save_slot, saved_files, slot_path,
)
from ane_spec.decode.session import common_prefix
from ane_spec.errors import AneSpecError
from ane_spec.runtime.pipeline import PipelineState, ShardPipeline

log = logging.getLogger("ane_spec.daemon")

# Below this many tokens a conversation is cheaper to prefill again than to copy: a copy moves
# the whole state, a prefill of 16 tokens is 4 T=4 passes.
MIN_SHARED = 16

class SlotError(AneSpecError):
    """A /slots action that cannot be done (an unknown slot, an empty one, a bad file)."""


class SlotNotFound(SlotError):
    """No resident slot or spilled conversation has that id."""


@dataclass
class _Cached:
    """What both kinds of entry share: a conversation's tokens and bookkeeping."""

    id: int
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = 0  # the last request's prompt: a later one covering it continues it
    scope: str | None = None
    tick: int = 0          # last use, for LRU
    last_used: float = 0.0  # wall clock, for /slots
    hits: int = 0


@dataclass
class Slot(_Cached):
    state: PipelineState | None = None
    running_since: float | None = None  # wall clock; set while a request runs in it
    running_prompt: int = 0


@dataclass
class Spilled(_Cached):
    arrays: list[np.ndarray] = field(default_factory=list)
    ring: list[int] | None = None  # a ring build's per-slot positions (kv_state)
    nbytes: int = 0


class SlotManager:
    def __init__(self, pipeline: ShardPipeline, slots: int, spill_bytes: int,
                 record: Callable[[str], None] = lambda event: None,
                 states: Sequence[PipelineState] = ()):
        """`slots` resident slots (the first ones on `states`, e.g. a session's own state, the
        rest on new states); `record(event)` counts the events of `metrics.SLOT_COUNTERS`."""
        if slots < 1:
            raise AneSpecError(f"--kv-slots must be >= 1, got {slots}")
        self.layout = StateLayout(pipeline)
        self.spill_budget = spill_bytes
        self.record = record
        given = list(states)[:slots]
        self.resident = [Slot(i, state=given[i] if i < len(given) else pipeline.new_state())
                         for i in range(slots)]
        self.spilled: list[Spilled] = []
        self._next_id = slots
        self._tick = 0
        self._published: dict[str, Any] = {}
        self._publish()

    # --- serving -----------------------------------------------------------------------------

    def acquire(self, prompt: Sequence[int], scope: str | None = None) -> Slot:
        """The resident slot a request for `prompt` runs in, filled as the module docstring
        says. The caller runs the session on (slot.state, slot.tokens), then `release`s it."""
        self._tick += 1
        cands = [c for c in (*self.resident, *self.spilled) if c.scope == scope and c.tokens]
        best, shared = None, 0
        for c in cands:
            n = common_prefix(c.tokens, prompt)
            # longest prefix; ties: resident (no copy), then the most recent
            if (n, isinstance(c, Slot), c.tick) > (shared, isinstance(best, Slot),
                                                    best.tick if best else -1):
                best, shared = c, n
        if best is not None and shared and (shared >= best.prompt_len
                                            or len(best.tokens) - shared < MIN_SHARED):
            self.record("hit")
            best.hits += 1
            if isinstance(best, Slot):
                slot = best
            else:  # out of the spill store first: spilling the victim must not evict it
                self.spilled.remove(best)
                slot = self._victim()
                self._install(slot, best, event="restore")
        else:
            self.record("miss")
            slot = self._victim()
            own = common_prefix(slot.tokens, prompt) if slot.scope == scope else 0
            if slot.scope != scope:
                slot.tokens = []
            slot.prompt_len = 0
            if (best is not None and best is not slot and shared >= MIN_SHARED and shared > own
                    and self._continues(best, shared)):
                self._install(slot, best, upto=shared, event="copy")
        slot.scope, slot.tick, slot.last_used = scope, self._tick, time.time()
        slot.running_since, slot.running_prompt = slot.last_used, len(prompt)
        self._publish()
        return slot

    def release(self, slot: Slot, tokens: list[int], prompt_len: int) -> None:
        """After a request: the tokens its slots now hold (the session's kv_tokens) and how
        many of them were its prompt."""
        slot.tokens = list(tokens)
        slot.prompt_len = min(prompt_len, len(slot.tokens))
        slot.last_used = time.time()
        slot.running_since = None
        self._publish()

    def drop_resident(self, pipeline: ShardPipeline) -> int:
        """The backend lost every state (its worker process died): each resident slot gets a
        fresh state and forgets its conversation; spilled copies live in host memory and stay.
        Returns how many conversations were dropped."""
        dropped = 0
        for slot in self.resident:
            dropped += bool(slot.tokens)
            slot.state = pipeline.new_state()
            slot.tokens, slot.prompt_len, slot.scope = [], 0, None
            slot.running_since, slot.running_prompt = None, 0
        for _ in range(dropped):
            self.record("drop")
        self._publish()
        return dropped

    # --- /slots actions ----------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        now = time.time()
        published = self._published
        return published | {"slots": [
            row | {"idle_seconds": None if row["state"] == "running" or not row["last_used"]
                   else round(now - row["last_used"], 3)}
            | ({"running_seconds": round(now - row["running_since"], 3)}
               if row.get("running_since") else {})
            for row in published["slots"]]}

    def save(self, slot_id: int, directory: Path | None, name: str | None,
             quota: SlotQuota | None = None) -> dict[str, Any]:
        if directory is None:
            raise SlotError("saving needs --slot-save-path DIR")
        entry = self._find(slot_id)
        if not entry.tokens:
            raise SlotError(f"slot {slot_id} is empty: nothing to save")
        path = slot_path(directory, name or f"slot-{slot_id}")
        arrays = (entry.arrays if isinstance(entry, Spilled)
                  else self.layout.capture(entry.state, len(entry.tokens)))
        ring = (entry.ring if isinstance(entry, Spilled)
                else self.layout.ring_positions(entry.state, len(entry.tokens)))
        t0 = time.perf_counter()
        size = save_slot(path, self.layout, entry.tokens, arrays, entry.scope, quota, ring)
        self.record("save")
        return {"id": slot_id, "filename": path.name, "tokens": len(entry.tokens),
                "bytes": size, "seconds": round(time.perf_counter() - t0, 4)}

    def restore(self, slot_id: int, directory: Path | None, name: str) -> dict[str, Any]:
        """Load a saved file into resident slot `slot_id` (its conversation is spilled)."""
        if directory is None:
            raise SlotError("restoring needs --slot-save-path DIR")
        slot = self._find(slot_id)
        if not isinstance(slot, Slot):
            raise SlotError(f"slot {slot_id} is not resident; restore into 0.."
                            f"{len(self.resident) - 1}")
        path = slot_path(directory, name)
        t0 = time.perf_counter()
        tokens, arrays, scope, ring = load_slot(path, self.layout)
        self._spill(slot)
        self._tick += 1
        self._install(slot, Spilled(-1, tokens, len(tokens), arrays=arrays, ring=ring))
        slot.tick, slot.last_used, slot.scope = self._tick, time.time(), scope
        self.record("load")
        self._publish()
        return {"id": slot_id, "filename": path.name, "tokens": len(tokens),
                "seconds": round(time.perf_counter() - t0, 4)}

    def erase(self, slot_id: int) -> dict[str, Any]:
        """Forget a conversation: a resident slot's states are zeroed too, so nothing it held
        (a restored file's K/V included) survives in it."""
        entry = self._find(slot_id)
        if isinstance(entry, Slot):
            entry.tokens, entry.prompt_len, entry.hits = [], 0, 0
            self.layout.clear(entry.state)
        else:
            self.spilled.remove(entry)
        self._publish()
        return {"id": slot_id, "erased": True}

    def load_saved(self, directory: Path) -> list[str]:
        """At start: saved files, newest first, into the resident slots and then the spill
        budget. A file that cannot be used is skipped with a warning; returns what loaded."""
        files = sorted(saved_files(directory).items(), key=lambda f: f[1].st_mtime,
                       reverse=True)
        loaded = []
        for name, info in files:
            try:
                if self._load_one(directory / name, info):
                    loaded.append(name)
            except SlotFileError as exc:
                log.warning("not restoring a saved slot: %s", exc)
            except Exception as exc:  # noqa: BLE001 - one bad file must not keep the rest out
                # (or, raised through the warm-up, the server down for good)
                log.warning("not restoring saved slot %s: %s: %s", name, type(exc).__name__,
                            exc)
        self._publish()
        return loaded

    def forget_resident(self) -> None:
        """After a job failed in a way nobody foresaw: what it was writing into a resident
        state is unknown, so every resident slot forgets its conversation (the next request
        there prefills again; slots past a conversation's tokens are never read). Spilled
        copies are host-memory copies and stay."""
        for slot in self.resident:
            slot.tokens, slot.prompt_len, slot.scope = [], 0, None
            slot.running_since, slot.running_prompt = None, 0
        self._publish()

    # --- internals ---------------------------------------------------------------------------

    def _load_one(self, path: Path, info) -> bool:  # noqa: ANN001 - an os.stat_result
        """One saved file into an empty resident slot or the spill store; False when neither
        has room."""
        tokens, arrays, scope, ring = load_slot(path, self.layout)
        self._tick += 1
        entry = Spilled(self._new_id(), tokens, len(tokens), scope, arrays=arrays, ring=ring,
                        nbytes=sum(a.nbytes for a in arrays), tick=-self._tick,
                        last_used=info.st_mtime)
        empty = next((s for s in self.resident if not s.tokens), None)
        if empty is not None:
            self._install(empty, entry)
            empty.tick, empty.last_used, empty.scope = entry.tick, entry.last_used, scope
        elif not self._keep(entry):
            log.warning("not restoring %s: no resident slot and no spill budget left",
                        path.name)
            return False
        self.record("load")
        return True

    def _find(self, slot_id: int) -> Slot | Spilled:
        for entry in (*self.resident, *self.spilled):
            if entry.id == slot_id:
                return entry
        raise SlotNotFound(f"no slot {slot_id}")

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _victim(self) -> Slot:
        """The least recently used resident slot (an empty one first), its conversation spilled
        to host memory."""
        slot = min(self.resident, key=lambda s: (bool(s.tokens), s.tick))
        self._spill(slot)
        return slot

    def _spill(self, slot: Slot) -> None:
        if len(slot.tokens) < MIN_SHARED:
            return
        n = len(slot.tokens)
        entry = Spilled(self._new_id(), list(slot.tokens), slot.prompt_len, slot.scope,
                        slot.tick, slot.last_used, slot.hits, nbytes=self.layout.nbytes(n))
        if entry.nbytes > self.spill_budget:
            self.record("drop")
            return
        entry.arrays = self.layout.capture(slot.state, n)
        entry.ring = self.layout.ring_positions(slot.state, n)
        if self._keep(entry):
            self.record("spill")

    def _keep(self, entry: Spilled) -> bool:
        """Add a spilled copy within the budget, dropping the least recently used ones (and any
        copy this one extends, which it makes redundant)."""
        if entry.nbytes > self.spill_budget:
            self.record("drop")
            return False
        self.spilled = [s for s in self.spilled if not (
            s.scope == entry.scope and len(s.tokens) <= len(entry.tokens)
            and entry.tokens[:len(s.tokens)] == s.tokens)]
        while sum(s.nbytes for s in self.spilled) + entry.nbytes > self.spill_budget:
            self.spilled.remove(min(self.spilled, key=lambda s: s.tick))
            self.record("drop")
        self.spilled.append(entry)
        return True

    def _continues(self, source: Slot | Spilled, n: int) -> bool:
        """Whether the first n tokens of `source` can be continued from its K/V. A build with
        KV rings (sliding-window layers) holds only the last W + 4 positions of each local
        layer: a prefix shorter than the conversation is usable only while the ring still holds
        the positions its next tokens see (n - W < q < n). Otherwise the copy is refused and the
        request recomputes its prompt (a miss without a copy)."""
        ring = (source.ring if isinstance(source, Spilled)
                else self.layout.ring_positions(source.state, len(source.tokens)))
        return ring is None or self.layout.make_ring(ring, n).holds_window(n)

    def _install(self, slot: Slot, source: Slot | Spilled, *, upto: int | None = None,
                 event: str | None = None) -> None:
        """Make `slot` hold the first `upto` (default: all) tokens of `source`, and record
        `event`: "restore" (a spilled conversation moves in), "copy" (a prefix of one that
        stays where it is) or None (a file's contents: the caller records the load)."""
        n = len(source.tokens) if upto is None else upto
        arrays = (source.arrays if isinstance(source, Spilled)
                  else self.layout.capture(source.state, n))
        ring = (source.ring if isinstance(source, Spilled)
                else self.layout.ring_positions(source.state, n))
        if isinstance(source, Spilled) and n < len(source.tokens):
            arrays = [a if e.seq_axis is None else a[:, :, :n]
                      for e, a in zip(self.layout.entries, arrays)]
        self.layout.install(slot.state, arrays, n, ring)
        slot.tokens = list(source.tokens[:n])
        slot.prompt_len = min(source.prompt_len, n)
        slot.hits = source.hits
        if event is not None:
            self.record(event)

    def _publish(self) -> None:
        def row(c: _Cached, state: str, nbytes: int | None) -> dict[str, Any]:
            return {"id": c.id, "state": state, "tokens": len(c.tokens), "hits": c.hits,
                    "last_used": round(c.last_used, 3) if c.last_used else None,
                    "bytes": nbytes}

        def resident(s: Slot) -> dict[str, Any]:
            if s.running_since is None:
                return row(s, "resident" if s.tokens else "empty", None)
            # Running: its state is being written; the engine adds the live token count.
            return row(s, "running", None) | {"tokens": s.running_prompt,
                                              "prompt_tokens": s.running_prompt,
                                              "running_since": s.running_since}

        rows = [resident(s) for s in self.resident]
        rows += [row(s, "spilled", s.nbytes) for s in sorted(self.spilled, key=lambda s: -s.tick)]
        self._published = {
            "resident_slots": len(self.resident),
            "host_bytes_per_full_slot": self.layout.nbytes(self.layout.max_seq),
            "spilled": len(self.spilled),
            "spill_bytes": sum(s.nbytes for s in self.spilled),
            "spill_budget_bytes": self.spill_budget,
            "slots": rows,
        }
