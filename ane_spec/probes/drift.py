"""How far a T=4 row's logits sit from the same token's T=1 recomputation on this backend.

The exactness guard reads this number: where a verified row's top-1/top-2 margin is within
twice the drift, T=4 and T=1 could pick different tokens, so decoding redoes that row at T=1.
Measured, never assumed: in fp32 it is float reordering (~1e-5 of a logit); in fp16 emulation,
and on the ANE, it is whatever the hardware's rounding makes it.
"""

from __future__ import annotations

import numpy as np

from ane_spec.probes.parity import gate_prompts
from ane_spec.probes.report import GateReport
from ane_spec.runtime.pipeline import ShardPipeline

CALIBRATION_LENGTHS = (5, 11, 23)
BLOCK = 4


def measure_drift(pipeline: ShardPipeline, lengths=CALIBRATION_LENGTHS, seed: int = 3
                  ) -> GateReport:
    """For each calibration prompt: fill two states alike, then run the same 4 tokens as one
    T=4 pass and as four T=1 passes, and compare the logit rows."""
    m = pipeline.manifest
    limit = m.build.max_seq - BLOCK
    prompts = gate_prompts(m.model.vocab_size, m.build.max_seq + BLOCK,
                           [min(n, limit) for n in lengths], seed=seed)
    rng = np.random.default_rng(seed)
    diffs = []
    for prompt in prompts:
        block = rng.integers(0, m.model.vocab_size, BLOCK).tolist()
        states = [pipeline.new_state(), pipeline.new_state()]
        for st in states:
            for start in range(0, len(prompt), BLOCK):
                pipeline.run(prompt[start:start + BLOCK], start, st)
        p = len(prompt)
        four = _rows(pipeline.run(block, p, states[0]))
        ones = np.concatenate([_rows(pipeline.run([tok], p + i, states[1]))
                               for i, tok in enumerate(block)])
        diffs.extend(np.abs(four - ones).max(axis=1).tolist())
    drift = float(max(diffs))
    figures = {"drift": drift, "median_row_drift": float(np.median(diffs)), "rows": len(diffs)}
    return GateReport("drift", True, pipeline.backend.name, pipeline.backend.precision, figures,
                      {}, {"row_drift": diffs})


def _rows(out) -> np.ndarray:
    if out.logits is not None:
        return out.logits
    # --head-argmax builds only expose each row's winning logit; compare those.
    return out.max_logit[:, None].astype(np.float32)
