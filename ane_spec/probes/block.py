"""Block gate (seeds/003): on every shard, one T=4 call against four sequential T=1 calls.

Two states are filled with the same prefix, then shard n gets the same 4 input rows either as
one block or one row at a time. In exact arithmetic the outputs and the K/V written are equal;
the gate reports per-token cosine and the largest state difference. It catches graph bugs that
only show for T > 1 (the attention output flattened as [head, token, dim], a wrong write mask),
which T=1 decoding never exercises.

A build with a prefill function (P rows) gets the same check at its shape: on every shard, one
P-row pass of the prefill function against the same P rows in P/4 decode-program passes of 4, from
equal states (`prefill_*` figures, and whether every row and state came out bitwise equal: on a
backend row-invariant across shapes they do). A graph bug of the prefill program alone (it is
built separately, at a fixed T) shows here shard by shard.

Thresholds: fp32 backend precision, per-token cosine >= 0.99999 and states equal to 1e-5 of their
scale (only summation order differs). fp16 emulation: cosine >= 0.999 and states within 1e-2 of
their scale (an fp16 ulp is ~1e-3; the figures are what matters).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ane_spec.probes.parity import cosine_rows, gate_prompts
from ane_spec.probes.report import GateReport
from ane_spec.runtime.backend import LoadedProgram
from ane_spec.runtime.hidden_layout import token_axis
from ane_spec.runtime.host_inputs import HostInputs
from ane_spec.runtime.pipeline import ShardPipeline

BLOCK = 4


def block_thresholds(precision: str | None) -> dict[str, float]:
    if precision == "fp32":
        return {"min_cosine": 0.99999, "state_rel_diff": 1e-5}
    return {"min_cosine": 0.999, "state_rel_diff": 1e-2}


def run_block(pipeline: ShardPipeline, prefix_length: int = 9, seed: int = 1) -> GateReport:
    m = pipeline.manifest
    backend, precision = pipeline.backend.name, pipeline.backend.precision
    # The prefill check first: its decode passes are T=4, so the decode programs change shape
    # once per shard (T=4 -> T=1 below), which under Infrequent may cost a re-specialisation.
    prefill = _prefill_vs_blocks(pipeline, prefix_length, seed) if pipeline.prefill_t else None
    prefix, block = gate_prompts(m.model.vocab_size, m.build.max_seq,
                                 [prefix_length, BLOCK], seed=seed)
    states = [pipeline.new_state(), pipeline.new_state()]
    for st in states:  # identical prefixes: deterministic backends fill identical states
        for start in range(0, len(prefix), BLOCK):
            pipeline.run(prefix[start:start + BLOCK], start, st)
    one_block, sequential = states
    position = len(prefix)

    hidden = pipeline.to_hidden(pipeline.embeddings.lookup(block))
    shards, worst_cos, worst_state = [], 1.0, 0.0
    for n, entry in enumerate(m.shards):
        cos, state_diff, hidden = block_vs_sequential(
            pipeline.shards[n], pipeline.host, pipeline.layout, hidden, position,
            one_block.shard_states[n], sequential.shard_states[n])
        worst_cos = min(worst_cos, float(cos.min()))
        worst_state = max(worst_state, state_diff)
        shards.append({"layers": list(entry.layers), "token_cosine": [float(c) for c in cos],
                       "state_rel_diff": state_diff})
    thresholds = block_thresholds(precision)
    passed = worst_cos >= thresholds["min_cosine"] and worst_state <= thresholds["state_rel_diff"]
    figures = {"min_cosine": worst_cos, "state_rel_diff": worst_state,
               "states_match": worst_state <= thresholds["state_rel_diff"]}
    details = {"position": position, "shards": shards}
    if prefill is not None:
        figures |= {k: v for k, v in prefill.items() if k != "shards"}
        details["prefill"] = prefill["shards"]
        passed = (passed and prefill["prefill_min_cosine"] >= thresholds["min_cosine"]
                  and prefill["prefill_state_rel_diff"] <= thresholds["state_rel_diff"])
    return GateReport("block", passed, backend, precision, figures, thresholds, details)


def _prefill_vs_blocks(pipeline: ShardPipeline, prefix_length: int, seed: int) -> dict:
    """Every shard: one prefill-function pass of P rows against the same rows in decode passes
    of BLOCK, from equal states holding the same prefix (as long as P still fits after it)."""
    m, p = pipeline.manifest, pipeline.prefill_t
    prefix_length = min(prefix_length, m.build.max_seq - p)
    prefix, chunk = gate_prompts(m.model.vocab_size, m.build.max_seq, [prefix_length, p],
                                 seed=seed + 1, reserve=0)
    states = [pipeline.new_state(), pipeline.new_state()]
    for st in states:
        for start in range(0, len(prefix), BLOCK):
            pipeline.run(prefix[start:start + BLOCK], start, st)
    position = len(prefix)
    hidden = pipeline.to_hidden(pipeline.embeddings.lookup(chunk))
    shards, worst_cos, worst_state, identical = [], 1.0, 0.0, True
    for n, entry in enumerate(m.shards):
        one, blocks = states[0].shard_states[n], states[1].shard_states[n]
        out = pipeline.prefill_shards[n].predict(
            {"x": hidden, **pipeline.host.block(position, p, p)}, one)["hidden"]
        parts = [pipeline.shards[n].predict(
            {"x": np.take(hidden, range(i, i + BLOCK), axis=token_axis(pipeline.layout)),
             **pipeline.host.block(position + i, BLOCK)}, blocks)["hidden"]
            for i in range(0, p, BLOCK)]
        as_blocks = np.concatenate(parts, axis=token_axis(pipeline.layout))
        cos = cosine_rows(pipeline.from_hidden(out), pipeline.from_hidden(as_blocks))
        diff, same = _state_diff(pipeline.shards[n], one, blocks)
        same = same and np.array_equal(out, as_blocks)
        worst_cos, worst_state = min(worst_cos, float(cos.min())), max(worst_state, diff)
        identical = identical and same
        shards.append({"layers": list(entry.layers), "min_token_cosine": float(cos.min()),
                       "state_rel_diff": diff, "identical": bool(same)})
        hidden = out
    return {"prefill_min_cosine": worst_cos, "prefill_state_rel_diff": worst_state,
            "prefill_identical": identical, "shards": shards}


def block_vs_sequential(program: LoadedProgram, host: HostInputs, layout: str,
                        hidden: np.ndarray, position: int, block_state: Any,
                        row_state: Any) -> tuple[np.ndarray, float, np.ndarray]:
    """Feed the same T rows to one program as a block and row by row, from equal states.

    Returns per-row cosine, the largest relative state difference afterwards, and the block
    path's output (the next shard's input on both sides)."""
    t = hidden.shape[2] if layout == "BCT1" else hidden.shape[3]
    out = program.predict({"x": hidden, **host.block(position, t)}, block_state)["hidden"]
    rows = []
    for i in range(t):
        row = hidden[:, :, i:i + 1, :] if layout == "BCT1" else hidden[:, :, :, i:i + 1]
        rows.append(program.predict({"x": row, **host.block(position + i, 1)}, row_state)["hidden"])
    as_rows = (lambda x: x[0, :, :, 0].T) if layout == "BCT1" else (lambda x: x[0, :, 0, :].T)
    cos = cosine_rows(as_rows(out), np.concatenate([as_rows(r) for r in rows], axis=0))
    return cos, _state_diff(program, block_state, row_state)[0], out


def _state_diff(program: LoadedProgram, a: Any, b: Any) -> tuple[float, bool]:
    """The largest state difference relative to the state's scale, and whether every state
    tensor is equal value for value."""
    worst, equal = 0.0, True
    for name in program.state_names:
        x, y = program.read_state(a, name), program.read_state(b, name)
        worst = max(worst, float(np.abs(x - y).max()) / max(float(np.abs(x).max()), 1e-12))
        equal = equal and bool(np.array_equal(x, y))
    return worst, equal
