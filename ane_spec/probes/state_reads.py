"""Does reading a K/V state leave memory behind? One layer's K state read many times through the
path a daemon slot capture takes, with the resident memory of the process that holds the states
watched before and after.

coremltools 9.0's `State::readState` has no @autoreleasepool of its own (CoreMLPython.mm): what
Core ML autoreleases during a read goes to the calling thread's pool, and the Core ML worker's
thread has none that drains, so without the pool runtime/autorelease.py puts around each read,
every read could leave a state-sized object behind for the worker's life. A daemon reads states
on every slot swap (daemon/kv_state.py, `StateLayout.capture`), so such a leak grows without
bound. This probe makes the leak visible: the growth over `reads` reads is near zero when each
read's objects are freed, and about `reads` times their size when they are not.

The reads go through `state_rows.read_rows`, as `StateLayout.capture` does: on the Core ML
backend that is the worker's `read_rows` (Core ML's read, then the slice and cast, then the
reply through shared memory), and the memory watched is the worker's (`resident_bytes`), since
the states and Core ML's copies live there; on a backend without a worker, this process's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ane_spec.peak_memory import current_rss_bytes
from ane_spec.runtime.state_rows import read_rows

STATE_READS = 1000
# Reads before the first sample: the first reads may grow the heap once (the reply slab, the
# allocator's pools, Core ML's own caches) by an amount that does not recur.
WARMUP_READS = 20
# The growth over STATE_READS reads that still passes: the larger of BOUND_READS reads' worth of
# the state and LEAK_FLOOR_BYTES. A leak of one copy of the state per read grows by STATE_READS
# (1,000) copies, a hundred times BOUND_READS, so any leak of a tenth of a state or more per read
# fails on a build whose states are large enough to clear the floor. The floor is there for
# noise that does not scale with the reads: malloc arenas and Python's pools settle in steps of
# a few MiB, and RSS also moves with pages the system reclaims or the process touches for the
# first time. It costs sensitivity only on small builds: a leak under 32 KiB a read (32 MiB over
# 1,000) passes; a Phi-4-mini K state at 2,048 tokens is 4 MiB, a SmolLM2-135M one 768 KiB.
BOUND_READS = 10
LEAK_FLOOR_BYTES = 32 << 20
# The layer graph's K/V states are [1, kv_heads, max_seq, head_dim] (shards/programs.py).
SEQ_AXIS = 2


@dataclass(frozen=True)
class StateReads:
    """RSS of the process that holds the states: at the start, after the warm-up reads, after
    `reads` more."""

    state: str
    shape: tuple[int, ...]
    state_bytes: int  # as the backend stores it (fp16 on Core ML)
    reads: int
    warmup_reads: int
    rss_start: int
    rss_before: int
    rss_after: int
    seconds: float
    where: str

    @property
    def growth(self) -> int:
        return self.rss_after - self.rss_before

    @property
    def bytes_per_read(self) -> float:
        return self.growth / self.reads

    @property
    def bound(self) -> int:
        return max(BOUND_READS * self.state_bytes, LEAK_FLOOR_BYTES)

    @property
    def leaks(self) -> bool:
        return self.growth >= self.bound

    @property
    def reads_per_second(self) -> float:
        return self.reads / self.seconds if self.seconds > 0 else math.inf

    def summary(self) -> str:
        rss = (f"{self.where} RSS {_mib(self.rss_before)} -> {_mib(self.rss_after)} MiB "
               f"over {self.reads:,} reads of {self.state} ({_kib(self.state_bytes)} KiB)")
        per_read = f"{self.bytes_per_read:+,.0f} B per read"
        bound = f"bound {_mib(self.bound)} MiB"
        if self.leaks:
            return (f"{self.where} RSS grew {_mib(self.growth)} MiB over {self.reads:,} reads of "
                    f"{self.state}: {per_read} ({bound}; the state is "
                    f"{self.state_bytes:,} B): reading a state leaves memory behind, as what "
                    "Core ML autoreleases in readState does without a pool around the call")
        return (f"{rss}: {self.growth / 2**20:+.1f} MiB, {per_read} ({bound}); "
                f"{self.reads_per_second:,.0f} reads/s")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"growth_bytes": self.growth,
                               "bytes_per_read": round(self.bytes_per_read, 1),
                               "bound_bytes": self.bound,
                               "reads_per_s": round(self.reads_per_second, 1)}


def first_k_state(pipeline: Any) -> tuple[int, str, tuple[int, ...]]:
    """(shard index, name, shape) of the first layer's K state (the first state where a build
    names none `*_k`)."""
    specs = {(k, s.name): tuple(int(d) for d in s.shape)
             for k, shard in enumerate(pipeline.manifest.shards) for s in shard.states}
    found = [(k, name) for k, program in enumerate(pipeline.shards)
             for name in program.state_names]
    if not found:
        raise ValueError("the build's shards have no states")
    k, name = next(((k, n) for k, n in found if n.endswith("_k")), found[0])
    return k, name, specs[(k, name)]


def measure_state_reads(pipeline: Any, reads: int = STATE_READS,
                        warmup: int = WARMUP_READS) -> StateReads:
    """One conversation state; its first K state read `warmup` times, then `reads` times, every
    read of every token row, as a slot capture of a full conversation reads it."""
    k, name, shape = first_k_state(pipeline)
    program = pipeline.shards[k]
    backend = pipeline.backend
    worker_rss = getattr(backend, "resident_bytes", None)
    rss, where = ((worker_rss, "Core ML worker") if worker_rss is not None
                  else (current_rss_bytes, "this process"))
    dtype = np.dtype(np.float32 if backend.precision == "fp32" else np.float16)
    axis = SEQ_AXIS if len(shape) == 4 and shape[SEQ_AXIS] == pipeline.max_seq else None
    rows = shape[axis] if axis is not None else 0
    state = pipeline.new_state().shard_states[k]

    def read() -> None:
        read_rows(program, state, name, rows, axis, dtype)

    rss_start = rss()
    for _ in range(warmup):
        read()
    rss_before = rss()
    t0 = time.perf_counter()
    for _ in range(reads):
        read()
    seconds = time.perf_counter() - t0
    rss_after = rss()
    return StateReads(name, shape, math.prod(shape) * dtype.itemsize, reads, warmup, rss_start,
                      rss_before, rss_after, round(seconds, 4), where)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _kib(n: int) -> str:
    return f"{n / 2**10:,.0f}"
