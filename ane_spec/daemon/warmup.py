"""The daemon's warm-up: the passes that make Core ML specialise every program it will run, each
a step /health reports, and what the first pass of each function cost.

Core ML specialises (JIT-compiles) a program once per process and input shape, on its first
prediction (ane-platform-notes: about 115 s cold at Phi size), so the daemon runs one pass of
each program at each shape it will serve before it takes requests: the decode function of every
shard at every width the decode shape uses, the head, and, for a build with a prefill function
that the server will use (`--prefill auto|on`), that function of every shard at its one shape,
T = P. The seconds of those first passes, by function and shape, are the warm-up's `jit`
figures: the second function's JIT is what a prefill build adds to a start.

A prefill function whose first prediction kills the Core ML worker (a failed ANE compile shows
this way, coremltools #2758) does not take the server down with it: the step reports it and the
server goes on with the prefill function off, prompts running at the decode shape
(`Engine._disable_prefill`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ane_spec.runtime.pipeline import PipelineState, ShardPipeline


@dataclass
class Warmup:
    done: int = 0
    total: int = 1
    step: str = "starting"
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    # Seconds of the first pass of each function at each shape ("decode T=4", "prefill T=64"):
    # its shards (and, for the decode function, the head) summed.
    jit: dict[str, float] = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "done": self.done, "total": self.total,
                "fraction": round(self.done / self.total, 4),
                "elapsed_seconds": round(self.seconds, 3), "jit_seconds": self.jit_seconds()}

    def jit_seconds(self) -> dict[str, float]:
        return {k: round(v, 3) for k, v in self.jit.items()}

    def jit_line(self) -> str:
        """`decode T=4 1.20s, prefill T=64 3.40s`: the first passes, by function and shape."""
        return ", ".join(f"{k} {v:.2f}s" for k, v in self.jit.items()) or "none"


@dataclass(frozen=True)
class WarmStep:
    name: str
    run: Callable[[], Any]
    jit: str | None = None  # the function and shape whose first pass this step is part of
    prefill: bool = False   # a pass of the prefill function (see Engine._disable_prefill)


def prefill_in_use(pipeline: ShardPipeline) -> bool:
    """Whether prompts may run through the build's prefill function (it has one, not --prefill
    off)."""
    return bool(pipeline.prefill_t) and pipeline.prefill_mode != "off"


def scratch_state(pipeline: ShardPipeline) -> Callable[[], PipelineState]:
    """The warm-up passes' one scratch state, made on first use, and made again after the
    backend's worker died (a state made in a dead worker is gone)."""
    box: list[tuple[int, PipelineState]] = []
    worker = getattr(pipeline.backend, "worker", None)  # Core ML's; None in process

    def state() -> PipelineState:
        if not box or worker is not None and (not worker.alive
                                               or box[0][0] != worker.generation):
            made = pipeline.new_state()  # starts a fresh worker if the last one died
            box[:] = [(0 if worker is None else worker.generation, made)]
        return box[0][1]

    return state


def jit_steps(pipeline: ShardPipeline, state: Callable[[], PipelineState]) -> list[WarmStep]:
    """One pass per program at every shape it will run: the prefill function of each shard (if
    in use) first, so that if it kills the worker nothing else was specialised in vain; then
    each shard's decode function and the head at every width of the decode shape."""
    p = pipeline
    steps: list[WarmStep] = []
    n = len(p.shards)
    if prefill_in_use(p):
        jit = f"prefill T={p.prefill_t}"
        steps += [WarmStep(f"{jit} shard {k + 1}/{n}",
                           lambda k=k: _warm_prefill_shard(p, k, state()), jit, prefill=True)
                  for k in range(n)]
    for t in p.shape.jit_widths:
        jit = f"decode T={t}"
        steps += [WarmStep(f"T={t} shard {k + 1}/{n}",
                           lambda t=t, k=k: _warm_shard(p, t, k, state()), jit)
                  for k in range(n)]
        steps.append(WarmStep(f"T={t} head", lambda t=t: _warm_head(p, t), jit))
    return steps


def _warm_shard(p: ShardPipeline, t: int, k: int, state: PipelineState) -> None:
    hidden = p.to_hidden(p.embeddings.lookup([0] * t))
    p.run_shards(hidden, p.host.block(0, t), state, range(k, k + 1))


def _warm_prefill_shard(p: ShardPipeline, k: int, state: PipelineState) -> None:
    if not prefill_in_use(p):  # switched off by an earlier step's failure
        return
    hidden, inputs = p.prefill_inputs([0] * p.prefill_t, 0, state)
    p.run_shards(hidden, inputs, state, range(k, k + 1), prefill=True)


def _warm_head(p: ShardPipeline, t: int) -> None:
    p.head.predict({"x": p.to_hidden(p.embeddings.lookup([0] * t))})
