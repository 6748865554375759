"""How much a 4-token pass costs next to a 1-token pass, measured once per process.

Only a decode shape whose passes vary in width asks (`DecodeShapePolicy.fill_drafts` decides). On
the ANE a T=4 pass costs about what a T=1 pass costs (68.7 tok/s prefill at T=4 against
16.7-17.8 tok/s decode at T=1), so every empty draft slot is a free guess thrown away: fill the
block. On a CPU backend a T=4 pass can cost much more, so only confident drafts are worth it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ane_spec.runtime.pipeline import ShardPipeline

_REPS = 3


@dataclass(frozen=True)
class DraftPolicy:
    t1_seconds: float
    t4_seconds: float

    @property
    def ratio(self) -> float:
        return self.t4_seconds / self.t1_seconds if self.t1_seconds > 0 else 1.0


def measure_pass_costs(pipeline: ShardPipeline, reps: int = _REPS) -> DraftPolicy:
    """Median wall time of T=1 and T=4 passes on a scratch state (after one warm-up each,
    which on Core ML also pays the per-process JIT for that T)."""
    state = pipeline.new_state()
    times: dict[int, list[float]] = {1: [], 4: []}
    t_max = min(4, pipeline.max_t)
    for t in (1, t_max):
        for rep in range(reps + 1):
            start = time.perf_counter()
            pipeline.run([0] * t, 0, state, width=t)
            if rep:  # the first call of each shape is warm-up
                times[t].append(time.perf_counter() - start)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return DraftPolicy(median(times[1]), median(times[t_max]))


def draft_policy(pipeline: ShardPipeline) -> DraftPolicy:
    """Cached on the pipeline: one measurement per loaded model per process."""
    if "draft_policy" not in pipeline.measurements:
        pipeline.measurements["draft_policy"] = measure_pass_costs(pipeline)
    return pipeline.measurements["draft_policy"]
