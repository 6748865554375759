"""How far a T=4 row's logits sit from the same token's T=1 recomputation on this backend.

The exactness guard reads this number: where a verified row's top-1/top-2 margin is within
twice the drift, T=4 and T=1 could pick different tokens, so decoding redoes that row at T=1.

It is measured along whole continuations, not one block from identical states: a T=4 pass
writes K/V that differ from T=1's by rounding, and those differences accumulate in the cache.
On the fp16 interpreter the single-block drift was 0.0025 while rows 20-40 tokens into a
speculative continuation had moved further, and divergences slipped past a guard set from the
single-block figure. So each calibration prompt is continued for `CONTINUATION` tokens twice,
once in T=4 blocks and once token by token, and every row is compared.
Measured, never assumed: in fp32 it is float reordering (~1e-5 of a logit); in fp16 emulation,
and on the ANE, it is whatever the hardware's rounding makes it.
"""

from __future__ import annotations

import numpy as np

from ane_spec.errors import AneSpecError

from ane_spec.probes.parity import gate_prompts
from ane_spec.probes.report import GateReport
from ane_spec.runtime.pipeline import ShardPipeline

CALIBRATION_LENGTHS = (5, 11, 23, 40)
CONTINUATION = 48
BLOCK = 4


def measure_drift(pipeline: ShardPipeline, lengths=CALIBRATION_LENGTHS, seed: int = 3
                  ) -> GateReport:
    m = pipeline.manifest
    room = m.build.max_seq - CONTINUATION
    if room < 1:
        raise AneSpecError(f"drift calibration needs more than {CONTINUATION} slots; the build "
                           f"has {m.build.max_seq}")
    prompts = gate_prompts(m.model.vocab_size, m.build.max_seq,
                           [min(n, room) for n in lengths], seed=seed, reserve=0)
    rng = np.random.default_rng(seed)
    diffs = []
    for prompt in prompts:
        tokens = rng.integers(0, m.model.vocab_size, CONTINUATION).tolist()
        blocks, singles = pipeline.new_state(), pipeline.new_state()
        for st in (blocks, singles):
            for start in range(0, len(prompt), BLOCK):
                pipeline.run(prompt[start:start + BLOCK], start, st)
        p = len(prompt)
        four = np.concatenate([_rows(pipeline.run(tokens[i:i + BLOCK], p + i, blocks))
                               for i in range(0, CONTINUATION, BLOCK)])
        ones = np.concatenate([_rows(pipeline.run([tok], p + i, singles))
                               for i, tok in enumerate(tokens)])
        diffs.extend(np.abs(four - ones).max(axis=1).tolist())
    drift = float(max(diffs))
    if not np.isfinite(drift):
        # NaN or inf logits: a broken build or backend. A guard margin made of it would wave
        # every row through (comparisons with NaN are False), so nothing may store it.
        raise AneSpecError(f"drift calibration on {pipeline.backend.describe()} produced "
                           "non-finite logits; the build or the backend is broken")
    figures = {"drift": drift, "median_row_drift": float(np.median(diffs)),
               "p99_row_drift": float(np.quantile(diffs, 0.99)), "rows": len(diffs)}
    return GateReport("drift", True, pipeline.backend.name, pipeline.backend.precision, figures,
                      {}, {"row_drift": diffs}, decode_shape=pipeline.decode_shape)


def _rows(out) -> np.ndarray:
    if out.logits is not None:
        return out.logits
    # --head-argmax builds only expose each row's winning logit; compare those.
    return out.max_logit[:, None].astype(np.float32)
