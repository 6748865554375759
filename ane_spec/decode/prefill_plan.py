"""Which prompt chunks run through the prefill function, from the backend's measured costs.

A build with a prefill function (`build --prefill-t P`) can run a prompt P tokens per pass,
layers only, with the LM head on the last token's row alone. Whether a chunk pays for it depends
on the backend: on the Neural Engine a pass is bound by reading the weights, so a 64-row pass
costs little more than a 4-row one (seeds/003: 68.7 tok/s at T=4 against 16.7 at T=1), while
the CPU interpreter computes every row separately and a 5-token prompt should not pay for 64
rows. So the choice is made from three costs measured once per loaded model (`measure`):

- c4: a decode-shape pass (layers and head, 4 rows);
- cP: a prefill pass, layers only (a chunk before the prompt's last);
- cPh: a prefill pass with the head on its last row (the chunk holding the last token).

A chunk of r tokens goes through the prefill function when that is cheaper than the ceil(r/4)
decode passes the same tokens would take: cP < (P/4) c4 for a full chunk before the last, and
cPh < ceil(r/4) c4 for the last. A remainder of at most 4 tokens is always one decode pass (no
prefill pass can beat it by more than its own head). `--prefill on` uses the prefill function
for every chunk, `off` for none.

Exactness: the chunking is a pure function of the prompt's length, the reused prefix and this
policy, so a speculative run and a greedy run of the same prompt on the same loaded model
prefill alike, and speculative output equals greedy output as before. Whether a prompt
prefilled in P-row passes gives the same K/V bits as one prefilled at T=4 is the backend's
row invariance across shapes (`probe row-invariance`), not this module's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ane_spec.errors import AneSpecError
from ane_spec.runtime.decode_shape import PrefillMode
from ane_spec.runtime.pipeline import ShardPipeline

_REPS = 2  # timed passes of each kind, after one untimed (Core ML pays its JIT there)


@dataclass(frozen=True)
class PrefillCosts:
    """Seconds per pass on one loaded model (the least of _REPS after a warm-up)."""

    prefill_t: int
    decode_t: int
    decode_seconds: float        # c4: layers and head, decode_t rows
    prefill_seconds: float       # cP: layers only, prefill_t rows
    prefill_head_seconds: float  # cPh: layers, then the head on one row

    @property
    def ratio(self) -> float:
        """c(P) / c(4): what a P-row pass costs in decode passes."""
        return self.prefill_seconds / self.decode_seconds if self.decode_seconds > 0 else 1.0

    def pays(self, tokens: int, last: bool) -> bool:
        """Whether a chunk of `tokens` is cheaper through the prefill function."""
        decode = math.ceil(tokens / self.decode_t) * self.decode_seconds
        return (self.prefill_head_seconds if last else self.prefill_seconds) < decode

    def to_dict(self) -> dict[str, float | int]:
        return {"prefill_t": self.prefill_t, "decode_t": self.decode_t,
                "decode_ms": round(1000 * self.decode_seconds, 3),
                "prefill_ms": round(1000 * self.prefill_seconds, 3),
                "prefill_head_ms": round(1000 * self.prefill_head_seconds, 3),
                "ratio": round(self.ratio, 3),
                "prefill_tok_s": round(self.prefill_t / self.prefill_seconds, 1)
                if self.prefill_seconds > 0 else 0.0}


def measure(pipeline: ShardPipeline, reps: int = _REPS) -> PrefillCosts:
    """Time the three kinds of pass on a scratch state."""
    if not pipeline.prefill_t:
        raise AneSpecError("this build has no prefill function")
    state = pipeline.new_state()
    p, t = pipeline.prefill_t, pipeline.max_t
    kinds = {
        "decode": lambda: pipeline.run([0] * t, 0, state),
        "prefill": lambda: pipeline.run_prefill([0] * p, 0, state, head=False),
        "prefill_head": lambda: pipeline.run_prefill([0] * p, 0, state, head=True),
    }
    best: dict[str, float] = {}
    for name, run in kinds.items():
        times = []
        for rep in range(reps + 1):
            start = time.perf_counter()
            run()
            if rep:
                times.append(time.perf_counter() - start)
        best[name] = min(times)
    return PrefillCosts(p, t, best["decode"], best["prefill"], best["prefill_head"])


def prefill_costs(pipeline: ShardPipeline) -> PrefillCosts:
    """Cached on the pipeline: one measurement per loaded model per process."""
    if "prefill_costs" not in pipeline.measurements:
        pipeline.measurements["prefill_costs"] = measure(pipeline)
    return pipeline.measurements["prefill_costs"]


def plan_chunks(pipeline: ShardPipeline, start: int, end: int,
                mode: PrefillMode | None = None) -> list[tuple[int, int, bool]]:
    """The prompt's positions start..end-1 as passes: (first, last + 1, through the prefill
    function?). Decode-shape chunks hold up to max_t tokens, prefill chunks up to prefill_t.
    `mode`: None takes the pipeline's (`--prefill`)."""
    p, t = pipeline.prefill_t, pipeline.max_t
    mode = pipeline.prefill_mode if mode is None else mode
    chunks: list[tuple[int, int, bool]] = []
    pos = start
    while pos < end:
        left = end - pos
        use = bool(p) and mode != "off" and (
            mode == "on" or (left > t and prefill_costs(pipeline).pays(min(left, p),
                                                                      last=left <= p)))
        size = min(left, p if use else t)
        chunks.append((pos, pos + size, use))
        pos += size
    return chunks
