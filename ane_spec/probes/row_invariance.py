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

A build with a prefill function (P rows, `build --prefill-t`) runs prompt chunks at a second
shape, so the same is measured there, against its own reference:

- `prefill-greedy`: one token per P-row pass at row 0, padded as a one-token prompt chunk is:
  the reference at shape P;
- `prefill-row-r` (r = 1, P-1): one token per pass at row r among fillers;
- `prefill-block`: all probe tokens at rows 0..3 of one pass, as a prompt chunk holds them;
- `prefill-spread-k`: all probe tokens in one pass at scattered rows (the last spread at the
  pass's last rows), fillers between them;
- `prefill-repeat`: `prefill-greedy` once more.

Within a shape, row invariance is what exactness needs: speculative and greedy decoding prefill
a prompt alike (`decode/prefill_plan.py`), so their caches are equal wherever every pass of one
shape computes a row the same at every index; and a continued conversation, whose prompt chunks
start wherever the last turn ended, prefills each token at another row index than a fresh
session does. Across shapes it is a further property, reported beside the verdict, not required
by it (`cross_shape`): the probe tokens' results under `greedy` against `prefill-greedy`, and the
prefix itself filled both ways (T=4 passes against prefill chunks: every prefix row's logits and
every state tensor). Where it holds, the K/V a reply's decode passes wrote equals what a fresh
prefill of the same conversation writes, so a continued conversation gives a fresh session's
tokens; where it does not, a reply still equals greedy decoding from the same cache.

Every plan's logits rows for the probe tokens and every state tensor of every shard afterwards
must equal the reference's exactly: IEEE equality, value for value, where any NaN fails. (+0 and
-0 count as equal: the KV scatter adds the other rows' exact zeros, so a written -0 may come out
+0 depending on its neighbours, and no later sum, product or comparison can tell them apart; the
values that are equal but not the same bits are counted, `signed_zero_values`.) One case ends at
the last slot of the context (positions S-4..S-1), where padding rows must keep their RoPE rows
and masks in range.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ane_spec.probes.parity import gate_prompts, special_token_ids
from ane_spec.probes.report import GateReport
from ane_spec.runtime.pipeline import BlockOutput, PipelineState, ShardPipeline

PROBE_TOKENS = 4
# Spread plans at the prefill shape (module docstring): one pass each.
PREFILL_SPREADS = 3


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
    width, prefill_t = pipeline.max_t, pipeline.prefill_t
    n = min(PROBE_TOKENS, width)
    s = pipeline.max_seq
    lengths = [p for p in prefix_lengths if p + n <= s]
    if end_of_context:
        lengths.append(s - n)
    rng = np.random.default_rng(seed)
    cases, failures, cross_failures = [], [], []
    worst = {"logit": 0.0, "state": 0.0, "cross_logit": 0.0, "cross_state": 0.0}
    signed_zeros = 0
    for prefix in gate_prompts(pipeline.config.vocab_size, s, lengths,
                               special_token_ids(pipeline), seed, reserve=0):
        p = len(prefix)
        probe = rng.integers(0, pipeline.config.vocab_size, n).tolist()
        filled = pipeline.new_state()
        prefix_rows = [_row(pipeline.run(prefix[start:start + width], start, filled,
                                         width=width), k)
                       for start in range(0, p, width)
                       for k in range(min(width, p - start))]
        plans = _plans(probe, p, width, pipeline.config.vocab_size, rng)
        references = {"greedy": [name for name in plans if name != "greedy"]}
        if prefill_t:
            prefill = _plans(probe, p, prefill_t, pipeline.config.vocab_size, rng, prefill=True)
            plans |= prefill
            references["prefill-greedy"] = [name for name in prefill
                                            if name != "prefill-greedy"]
        results = {name: _execute(pipeline, plan, pipeline.copy_state(filled), n)
                   for name, plan in plans.items()}
        compared = {}
        for reference, names in references.items():
            for name in names:
                diff = _compare(results[reference], results[name])
                compared[name] = diff
                worst["logit"] = max(worst["logit"], diff["max_logit_diff"])
                worst["state"] = max(worst["state"], diff["max_state_diff"])
                signed_zeros += diff["signed_zero_values"]
                if not diff["identical"]:
                    failures.append(f"prefix {p}, plan {name}")
        case = {"prefix_tokens": p, "positions": [p, p + n - 1], "plans": compared}
        if prefill_t:
            cross = _cross_shape(pipeline, prefix, PlanResult(np.stack(prefix_rows),
                                                              state_arrays(pipeline, filled)),
                                 results)
            for what, diff in cross.items():
                worst["cross_logit"] = max(worst["cross_logit"], diff["max_logit_diff"])
                worst["cross_state"] = max(worst["cross_state"], diff["max_state_diff"])
                signed_zeros += diff["signed_zero_values"]
                if not diff["identical"]:
                    cross_failures.append(f"prefix {p}, {what}")
            case["cross_shape"] = cross
        cases.append(case)
    nondeterministic = any(not c["plans"][name]["identical"] for c in cases
                           for name in ("repeat", "prefill-repeat") if name in c["plans"])
    passed = not failures
    figures = {"cases": len(cases), "plans_per_case": len(cases[0]["plans"]) if cases else 0,
               "differing_plans": len(failures), "max_logit_diff": worst["logit"],
               "max_state_diff": worst["state"], "deterministic": not nondeterministic,
               "prefill_t": prefill_t}
    if prefill_t:
        figures |= {"cross_shape_identical": not cross_failures,
                    "cross_shape_differing": len(cross_failures),
                    "cross_shape_max_logit_diff": worst["cross_logit"],
                    "cross_shape_max_state_diff": worst["cross_state"]}
    figures["signed_zero_values"] = signed_zeros
    figures["verdict"] = _verdict(pipeline, nondeterministic, failures, cross_failures)
    return GateReport("row-invariance", passed, pipeline.backend.name,
                      pipeline.backend.precision, figures, {"max_logit_diff": 0.0,
                                                            "max_state_diff": 0.0},
                      {"width": width, "prefill_t": prefill_t, "cases": cases,
                       "failures": failures, "cross_shape_failures": cross_failures})


def _plans(probe: list[int], p: int, width: int, vocab: int, rng: np.random.Generator, *,
           prefill: bool = False) -> dict[str, Plan]:
    """The plans at the decode shape's width, or with `prefill` at the prefill function's
    (their names prefixed `prefill-`; module docstring)."""
    n = len(probe)

    def filler() -> Row:
        # Any token, at any position the cache already covers; never writes.
        return Row(int(rng.integers(0, vocab)), int(rng.integers(0, p + 1)), False)

    def real(i: int) -> Row:
        return Row(probe[i], p + i, True, probe=i)

    def padded(rows: list[Row]) -> list[Row]:
        # What ShardPipeline.run and prefill_inputs do: repeat the last real row, writing nothing.
        last = rows[-1]
        return rows + [Row(last.token, last.position, False)] * (width - len(rows))

    def at_row(r: int, row: Row) -> list[Row]:
        return [row if k == r else filler() for k in range(width)]

    name = "prefill-" if prefill else ""
    greedy = [padded([real(i)]) for i in range(n)]
    plans: dict[str, Plan] = {f"{name}greedy": greedy}
    for r in ((1, width - 1) if prefill else range(width)):
        plans[f"{name}row-{r}"] = [at_row(r, real(i)) for i in range(n)]
    plans[f"{name}block"] = [padded([real(i) for i in range(n)])]
    if prefill:
        for k in range(PREFILL_SPREADS):
            rows = (list(range(width - n, width)) if k == PREFILL_SPREADS - 1
                    else sorted(rng.choice(width, n, replace=False).tolist()))
            where = dict(zip(rows, range(n)))  # probe tokens in position order, fillers between
            plans[f"prefill-spread-{k}"] = [[real(where[r]) if r in where else filler()
                                             for r in range(width)]]
    elif n >= 4 and width >= 4:
        plans["pairs"] = [padded([real(0), real(1)]),
                          [filler(), filler(), real(2), real(3)] + [filler()] * (width - 4)]
    plans[f"{name}repeat"] = greedy
    return plans


def _execute(pipeline: ShardPipeline, plan: Plan, state: PipelineState, n: int) -> PlanResult:
    rows: list[np.ndarray | None] = [None] * n
    for rows_of_pass in plan:
        tokens = [r.token for r in rows_of_pass]
        positions = [r.position for r in rows_of_pass]
        writes = [r.writes for r in rows_of_pass]
        read = [k for k, row in enumerate(rows_of_pass) if row.probe is not None]
        if len(rows_of_pass) > pipeline.max_t:  # the prefill function; the head on read rows
            hidden = pipeline.prefill_rows(tokens, positions, writes, state)
            # the head at one shape for every plan: the rows it reads are what is compared
            out = pipeline.head_rows(hidden, read, width=pipeline.max_t)
            index = {k: i for i, k in enumerate(read)}
        else:
            out, index = pipeline.run_rows(tokens, positions, writes, state), {k: k for k in read}
        for k in read:
            rows[rows_of_pass[k].probe] = _row(out, index[k])
    return PlanResult(np.stack(rows), state_arrays(pipeline, state))


def _cross_shape(pipeline: ShardPipeline, prefix: list[int], by_blocks: PlanResult,
                 results: dict[str, PlanResult]) -> dict[str, dict]:
    """The two cross-shape comparisons (module docstring): the probe tokens one per pass at
    each width, and the prefix written in T=4 passes (`by_blocks`: every row's outputs, the
    states) against the prefix written from a fresh state in prefill-function chunks."""
    state, rows = pipeline.new_state(), []
    for start in range(0, len(prefix), pipeline.prefill_t):
        chunk = prefix[start:start + pipeline.prefill_t]
        out = pipeline.head_rows(pipeline.prefill_hidden(chunk, start, state), range(len(chunk)))
        rows += [_row(out, k) for k in range(len(chunk))]
    return {"probe": _compare(results["greedy"], results["prefill-greedy"]),
            "prefix": _compare(by_blocks, PlanResult(np.stack(rows), state_arrays(pipeline,
                                                                                 state)))}


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
        "signed_zero_values": sum(signed_zero_values(a, b) for a, b in
                                  [(ref.rows, got.rows), *zip(ref.states, got.states)]),
    }


def exactly_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool(np.array_equal(a, b))


def signed_zero_values(a: np.ndarray, b: np.ndarray) -> int:
    """How many values are equal (IEEE) but not the same bits: +0 against -0."""
    if a.shape != b.shape:
        return 0
    return int(((a == b) & (np.signbit(a) != np.signbit(b))).sum())


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        return float("inf")
    with np.errstate(invalid="ignore"):
        d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    return float("inf") if np.isnan(d).any() else float(d.max(initial=0.0))


def _verdict(pipeline: ShardPipeline, nondeterministic: bool, failures: list[str],
             cross_failures: list[str]) -> str:
    where = pipeline.backend.describe()
    shapes = f"T={pipeline.max_t}" + (f" and T={pipeline.prefill_t}" if pipeline.prefill_t
                                      else "")
    if nondeterministic:
        return (f"NOT DETERMINISTIC on {where}: the same pass twice gave different results, so "
                "no decoding order can be exact here")
    at_decode_shape = [f for f in failures if ", plan prefill-" not in f]
    if at_decode_shape:
        return (f"ROW INVARIANCE BROKEN on {where} ({len(failures)} plans differ, first: "
                f"{at_decode_shape[0]}): fixed-shape speculative decoding is NOT guaranteed to "
                "equal greedy decoding on this backend")
    if failures:
        return (f"ROW INVARIANCE BROKEN at T={pipeline.prefill_t} on {where} ({len(failures)} "
                f"plans differ, first: {failures[0]}): a prompt chunk computes a token by its "
                "row in the chunk, so a conversation continued on its cache can differ from a "
                f"fresh prefill of it; at T={pipeline.max_t} every row agrees, so speculative "
                "decoding still equals greedy decoding from the same cache")
    verdict = (f"row-invariant on {where} at {shapes}: fixed-shape speculative decoding "
               "computes every token exactly as greedy decoding does")
    if not pipeline.prefill_t:
        return verdict
    if cross_failures:
        return (f"{verdict}; ACROSS SHAPES the results differ ({len(cross_failures)} checks, "
                f"first: {cross_failures[0]}): a conversation continued on its cache can differ "
                "from a fresh prefill of it (each still equals greedy decoding from its cache)")
    return (f"{verdict}; and the same across shapes: a token prefilled at T={pipeline.prefill_t}"
            f" and at T={pipeline.max_t} gives the same logits and K/V bits")
