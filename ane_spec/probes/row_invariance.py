"""Row invariance: in a pass of fixed width, a token's logits and the K/V it writes depend only on
the token, its position and the visible cache, never on its row index or on its neighbours.

The fixed decode shape is exact because of it: plain greedy decoding runs every token at row 0 of
a padded 4-row pass, speculative decoding runs it at whatever row its draft landed in, and the two
must do bitwise the same arithmetic. That is a property of the backend's kernels (a matmul that
accumulates row 2 in another order than row 0 breaks it), so it is measured on every backend,
exactly, with no tolerance.

For each case (a prefix already in the cache, then probe tokens at the next positions) the same
probe tokens run under several plans, each starting from an exact copy of the filled cache:

- `greedy`: one token per pass at row 0, padded, as plain greedy decoding runs it: the reference;
- `row-r` (r = 0..3): one token per pass at row r; the other rows hold filler tokens at other
  positions that write nothing, so the neighbours differ from padding and from each other;
- `block`: all probe tokens in one pass, as a fully accepted verify pass runs them;
- `pairs`: two tokens per pass, the second pair at rows 2 and 3 behind two fillers;
- `repeat`: `greedy` once more; if it differs, the backend is not even deterministic.

Every plan's logits rows for the probe tokens and every state tensor of every shard afterwards
must equal the reference's exactly: IEEE equality, value for value, where any NaN fails. (+0 and
-0 count as equal: the KV scatter adds the other rows' exact zeros, so a written -0 may come out
+0 depending on its neighbours, and no later sum, product or comparison can tell them apart.) One case ends at the last slot of the context (positions
S-4..S-1), where padding rows must keep their RoPE rows and masks in range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ane_spec.probes.parity import gate_prompts, special_token_ids
from ane_spec.probes.report import GateReport
from ane_spec.runtime.pipeline import BlockOutput, PipelineState, ShardPipeline

PROBE_TOKENS = 4


@dataclass(frozen=True)
class Row:
    token: int
    position: int
    writes: bool
    probe: int | None = None  # which probe token this row carries, if any


Plan = list[list[Row]]  # passes, each a list of rows


@dataclass
class PlanResult:
    rows: np.ndarray          # [probe tokens, V] logits, or [probe tokens, 2] (argmax, max)
    states: list[np.ndarray]  # every state tensor of every shard, in order


def run_row_invariance(pipeline: ShardPipeline, prefix_lengths: tuple[int, ...] = (9, 22),
                       end_of_context: bool = True, seed: int = 5) -> GateReport:
    width = pipeline.max_t
    n = min(PROBE_TOKENS, width)
    s = pipeline.max_seq
    lengths = [p for p in prefix_lengths if p + n <= s]
    if end_of_context:
        lengths.append(s - n)
    rng = np.random.default_rng(seed)
    cases, failures, worst_logit, worst_state = [], [], 0.0, 0.0
    for prefix in gate_prompts(pipeline.config.vocab_size, s, lengths,
                               special_token_ids(pipeline), seed, reserve=0):
        p = len(prefix)
        probe = rng.integers(0, pipeline.config.vocab_size, n).tolist()
        filled = pipeline.new_state()
        for start in range(0, p, width):
            pipeline.run(prefix[start:start + width], start, filled, width=width)
        plans = _plans(probe, p, width, pipeline.config.vocab_size, rng)
        results = {name: _execute(pipeline, plan, pipeline.copy_state(filled), n)
                   for name, plan in plans.items()}
        reference = results["greedy"]
        compared = {}
        for name, result in results.items():
            if name == "greedy":
                continue
            diff = _compare(reference, result)
            compared[name] = diff
            worst_logit = max(worst_logit, diff["max_logit_diff"])
            worst_state = max(worst_state, diff["max_state_diff"])
            if not diff["identical"]:
                failures.append(f"prefix {p}, plan {name}")
        cases.append({"prefix_tokens": p, "positions": [p, p + n - 1], "plans": compared})
    nondeterministic = any(not c["plans"]["repeat"]["identical"] for c in cases)
    passed = not failures
    figures = {"cases": len(cases), "plans_per_case": len(cases[0]["plans"]) if cases else 0,
               "differing_plans": len(failures), "max_logit_diff": worst_logit,
               "max_state_diff": worst_state, "deterministic": not nondeterministic,
               "verdict": _verdict(pipeline, passed, nondeterministic, failures)}
    return GateReport("row-invariance", passed, pipeline.backend.name,
                      pipeline.backend.precision, figures, {"max_logit_diff": 0.0,
                                                            "max_state_diff": 0.0},
                      {"width": width, "cases": cases, "failures": failures})


def _plans(probe: list[int], p: int, width: int, vocab: int, rng: np.random.Generator
           ) -> dict[str, Plan]:
    n = len(probe)

    def filler() -> Row:
        # Any token, at any position the cache already covers; never writes.
        return Row(int(rng.integers(0, vocab)), int(rng.integers(0, p + 1)), False)

    def real(i: int) -> Row:
        return Row(probe[i], p + i, True, probe=i)

    def padded(rows: list[Row]) -> list[Row]:
        # What ShardPipeline.run does: repeat the last real row, writing nothing.
        last = rows[-1]
        return rows + [Row(last.token, last.position, False)] * (width - len(rows))

    def at_row(r: int, row: Row) -> list[Row]:
        return [row if k == r else filler() for k in range(width)]

    greedy = [padded([real(i)]) for i in range(n)]
    plans: dict[str, Plan] = {"greedy": greedy}
    for r in range(width):
        plans[f"row-{r}"] = [at_row(r, real(i)) for i in range(n)]
    plans["block"] = [padded([real(i) for i in range(n)])]
    if n >= 4 and width >= 4:
        plans["pairs"] = [padded([real(0), real(1)]),
                          [filler(), filler(), real(2), real(3)] + [filler()] * (width - 4)]
    plans["repeat"] = greedy
    return plans


def _execute(pipeline: ShardPipeline, plan: Plan, state: PipelineState, n: int) -> PlanResult:
    rows: list[np.ndarray | None] = [None] * n
    for rows_of_pass in plan:
        out = pipeline.run_rows([r.token for r in rows_of_pass],
                                [r.position for r in rows_of_pass],
                                [r.writes for r in rows_of_pass], state)
        for k, row in enumerate(rows_of_pass):
            if row.probe is not None:
                rows[row.probe] = _row(out, k)
    return PlanResult(np.stack(rows), state_arrays(pipeline, state))


def state_arrays(pipeline: ShardPipeline, state: PipelineState) -> list[np.ndarray]:
    """Every state tensor of every shard, in order."""
    return [shard.read_state(st, name)
            for shard, st in zip(pipeline.shards, state.shard_states)
            for name in shard.state_names]


def _row(out: BlockOutput, k: int) -> np.ndarray:
    if out.has_logits:
        return out.row_logits(k)
    return np.array([out.argmax[k], out.max_logit[k]], dtype=np.float64)  # --head-argmax


def _compare(ref: PlanResult, got: PlanResult) -> dict:
    logits_equal = exactly_equal(ref.rows, got.rows)
    states_equal = [exactly_equal(a, b) for a, b in zip(ref.states, got.states)]
    return {
        "identical": logits_equal and all(states_equal),
        "logits_identical": logits_equal,
        "differing_rows": int(sum(not exactly_equal(a, b) for a, b in zip(ref.rows, got.rows))),
        "max_logit_diff": _max_diff(ref.rows, got.rows),
        "states_identical": all(states_equal),
        "differing_states": int(sum(not e for e in states_equal)),
        "max_state_diff": max((_max_diff(a, b) for a, b in zip(ref.states, got.states)),
                              default=0.0),
    }


def exactly_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float("inf") if np.isnan(d).any() else float(d.max(initial=0.0))


def _verdict(pipeline: ShardPipeline, passed: bool, nondeterministic: bool,
             failures: list[str]) -> str:
    where = pipeline.backend.describe()
    if passed:
        return (f"row-invariant on {where}: fixed-shape speculative decoding computes every token "
                "exactly as greedy decoding does")
    if nondeterministic:
        return (f"NOT DETERMINISTIC on {where}: the same pass twice gave different results, so "
                "no decoding order can be exact here")
    return (f"ROW INVARIANCE BROKEN on {where} ({len(failures)} plans differ, first: "
            f"{failures[0]}): fixed-shape speculative decoding is NOT guaranteed to equal greedy "
            "decoding on this backend")

