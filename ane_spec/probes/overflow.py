"""Overflow isolation: a row whose activations overflow fp16 changes no other slot and no other
row, exactly.

Every pass computes rows whose results must not matter: padding (repeats the last real row and
writes nothing), a probe's filler rows (write nothing), and drafts that verification rejects
(they write a slot that stays hidden until a later pass overwrites it). Their activations can
overflow fp16 like any row's; an inf activation becomes NaN at the next layer_norm. Before the
layer graph made its K/V write and its mask finite-safe, one such row turned every K/V slot of the
cache into NaN (the scatter's 0 x NaN), for good. Plain greedy decoding never computes a rejected
draft, so speculative output could then differ from greedy's.

The probe injects such rows into real passes of the build and compares, with IEEE equality and no
tolerance (as `row_invariance` does), against the same passes with the row left clean:

- `padding`: one real row, its three padding rows poisoned: the real row's outputs and every
  state value must be unchanged;
- `filler`: the real row at row r, poisoned fillers at other positions in the other rows: same;
- `rejected-draft`: a 4-row verify pass whose row-2 draft is poisoned (rows 0 and 1 accepted;
  row 3 read the poisoned slot and is rejected too), then the next pass, at the rejected slot:
  the accepted rows, the next pass's row and every slot up to it must be unchanged;
- `hidden-slot`: slots hidden from the row (past its position) hold the largest finite K and V of
  either sign, what a saturated overflow leaves: the row's outputs must be unchanged;
- `prefill-padding` (builds with a prefill function): a prompt chunk of a few tokens in a P-row
  pass of the prefill function, its padding rows (every row past the real ones) poisoned: the
  real rows' outputs and every slot must be unchanged. Padding is the one row a prefill pass
  computes that must not matter (it holds no drafts or fillers), and it is most of a last chunk.

and, after every pass, every state value must be finite. Poisons: +inf, -inf, NaN, the three
alternating, and 7e4 (inf in fp16; a large but ordinary value in fp32, so there the cases test
that a different row writes nothing outside its slot).

A build with `--mask-form additive` (shards/layer_graph.py) gives this up by choice: its K/V
write is `clip` alone and its mask is added, so a row that overflows (NaN by the next
layer_norm) poisons every slot, and a hidden slot holding FP16_MAX K can win. The probe does not
fail such a build for what it was built to give up: those cases (every non-finite poison, every
hidden-slot fill) are run and counted as its known exposure (`exposed_cases`, named in the
verdict, which says that speculative decoding then equals greedy only while no row overflows),
and every other case must still pass (in fp32 the 7e4 rows stay finite and must change
nothing). A select-form build is held to every case, whatever its test variants do.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.probes.parity import gate_prompts, special_token_ids
from ane_spec.probes.report import GateReport
from ane_spec.probes.row_invariance import exactly_equal, state_arrays
from ane_spec.runtime.hidden_layout import token_axis
from ane_spec.runtime.pipeline import PipelineState, ShardPipeline

FP16_MAX = float(np.finfo(np.float16).max)
POISONS: dict[str, Sequence[float]] = {
    "+inf": [np.inf], "-inf": [-np.inf], "nan": [np.nan],
    "inf-nan-mix": [np.inf, -np.inf, np.nan], "7e4": [7e4],
}
HIDDEN_FILLS: dict[str, Sequence[float]] = {
    "+max": [FP16_MAX], "-max": [-FP16_MAX],
    "alternating-max": [FP16_MAX, -FP16_MAX],
}
WIDTH = 4
PREFILL_ROWS = 5  # real rows of the prefill-padding case's chunk: more than one decode pass holds


@dataclass(frozen=True)
class Pass:
    tokens: list[int]
    positions: list[int]
    writes: list[bool]
    read: list[int]  # rows whose outputs count


@dataclass
class Outcome:
    rows: list[np.ndarray]   # the read rows' head outputs, every output of the head
    states: list[np.ndarray]


def run_overflow(pipeline: ShardPipeline, prefix_lengths: tuple[int, ...] = (9,),
                 end_of_context: bool = True, seed: int = 11) -> GateReport:
    if pipeline.max_t < WIDTH:
        raise AneSpecError(f"the overflow probe needs passes of {WIDTH} rows; the build has "
                           f"{pipeline.max_t}")
    s, vocab = pipeline.max_seq, pipeline.config.vocab_size
    lengths = [p for p in prefix_lengths if p + WIDTH <= s]
    if end_of_context:
        lengths.append(s - WIDTH)
    rng = np.random.default_rng(seed)
    cases: list[dict] = []
    for prefix in gate_prompts(vocab, s, lengths, special_token_ids(pipeline), seed, reserve=0):
        p = len(prefix)
        filled = pipeline.new_state()
        for start in range(0, p, WIDTH):
            pipeline.run(prefix[start:start + WIDTH], start, filled, width=WIDTH)
        tokens = rng.integers(0, vocab, 6).tolist()
        fillers = [(int(rng.integers(0, vocab)), int(rng.integers(0, p + 1))) for _ in range(3)]
        cases += _padding_and_filler(pipeline, filled, p, tokens[0], fillers)
        cases += _rejected_draft(pipeline, filled, p, tokens)
        cases += _hidden_slots(pipeline, filled, p, tokens[0])
        if pipeline.prefill_t:
            cases += _prefill_padding(pipeline, filled, p, tokens[:min(PREFILL_ROWS, s - p)])
    additive = pipeline.manifest.build.mask_form == "additive"
    for c in cases:
        c["known_exposure"] = additive and in_additive_exposure(
            c["case"], c["poison"], pipeline.backend.precision)
    leaks = [c for c in cases if not c["identical"] or not c["finite"]]
    failures = [f"prefix {c['prefix_tokens']}, {c['case']}, {c['poison']}" for c in leaks
                if not c["known_exposure"]]
    exposed = [c for c in leaks if c["known_exposure"]]
    passed = not failures
    figures = {"cases": len(cases), "differing_cases": sum(not c["identical"] for c in cases),
               "non_finite_cases": sum(not c["finite"] for c in cases),
               "mask_form": pipeline.manifest.build.mask_form, "exposed_cases": len(exposed),
               "cases_outside_known_exposure": len(failures),
               "verdict": _verdict(pipeline, passed, failures, exposed)}
    unexposed = {"differing_cases": 0, "non_finite_cases": 0}
    return GateReport("overflow", passed, pipeline.backend.name, pipeline.backend.precision,
                      figures, {"cases_outside_known_exposure": 0} if additive else unexposed,
                      {"cases": cases, "failures": failures})


def in_additive_exposure(case: str, poison: str, precision: str | None) -> bool:
    """Whether an additive-form build may leak in this case by design: a hidden slot holding
    FP16_MAX K (its score can beat the added mask), or a row poisoned with a value that is not
    finite at the backend's precision (it reaches the scatter as NaN, which `clip` keeps).
    7e4 is inf once cast to fp16 (Core ML's inputs are fp16: precision None), finite in fp32."""
    if case == "hidden-slot":
        return True
    return poison != "7e4" or precision != "fp32"


def _padding_and_filler(pipeline: ShardPipeline, filled: PipelineState, p: int, token: int,
                        fillers: list[tuple[int, int]]) -> list[dict]:
    padded = Pass([token] * WIDTH, [p] * WIDTH, [True] + [False] * (WIDTH - 1), [0])
    results = []
    for name, pattern in POISONS.items():
        # The real row moves through rows 0..3 as the poisons change; fillers fill the rest.
        r = len(results) // 2 % WIDTH
        rows = list(fillers)
        rows.insert(r, (token, p))
        filler = Pass([t for t, _ in rows], [q for _, q in rows],
                      [k == r for k in range(WIDTH)], [r])
        for case, run in (("padding", padded), ("filler", filler)):
            poisoned = [k for k in range(WIDTH) if k not in run.read]
            clean = _execute(pipeline, [run], [[]], pipeline.copy_state(filled), pattern)
            dirty = _execute(pipeline, [run], [poisoned], pipeline.copy_state(filled), pattern)
            results.append(_case(p, case, name, clean, dirty, slots=pipeline.max_seq,
                                 written=p + 1))
    return results


def _rejected_draft(pipeline: ShardPipeline, filled: PipelineState, p: int,
                    tokens: list[int]) -> list[dict]:
    verify = Pass(tokens[:4], [p, p + 1, p + 2, p + 3], [True] * 4, [0, 1])
    # Rows 0 and 1 accepted, row 2 rejected: the next pass starts at slot p + 2 and overwrites it;
    # slot p + 3 (row 3's write, computed from the poisoned slot) stays, hidden.
    follow = Pass([tokens[4]] * WIDTH, [p + 2] * WIDTH, [True] + [False] * (WIDTH - 1), [0])
    clean = _execute(pipeline, [verify, follow], [[], []], pipeline.copy_state(filled), [0.0])
    return [_case(p, "rejected-draft", name, clean,
                  _execute(pipeline, [verify, follow], [[2], []], pipeline.copy_state(filled),
                           pattern), slots=p + 3, written=p + 4)
            for name, pattern in POISONS.items()]


def _hidden_slots(pipeline: ShardPipeline, filled: PipelineState, p: int,
                  token: int) -> list[dict]:
    run = Pass([token] * WIDTH, [p] * WIDTH, [True] + [False] * (WIDTH - 1), [0])
    clean = _execute(pipeline, [run], [[]], pipeline.copy_state(filled), [0.0])
    results = []
    for name, fill in HIDDEN_FILLS.items():
        state = pipeline.copy_state(filled)
        for shard, st in zip(pipeline.shards, state.shard_states):
            for state_name in shard.state_names:
                kv = shard.read_state(st, state_name)
                hidden = kv[:, :, p + 1:, :]
                hidden[...] = np.resize(np.asarray(fill, np.float32), hidden.shape)
                shard.write_state(st, state_name, kv)
        results.append(_case(p, "hidden-slot", name, clean,
                             _execute(pipeline, [run], [[]], state, [0.0]), slots=p + 1,
                             written=p + 1))
    return results


def _prefill_padding(pipeline: ShardPipeline, filled: PipelineState, p: int,
                     tokens: list[int]) -> list[dict]:
    """A prompt chunk of len(tokens) rows at p.., padded to P as `prefill_inputs` pads it (the
    last token again, at the last position, writing nothing); the padding poisoned."""
    r, width = len(tokens), pipeline.prefill_t
    chunk = Pass(tokens + [tokens[-1]] * (width - r),
                 [p + i for i in range(r)] + [p + r - 1] * (width - r),
                 [True] * r + [False] * (width - r), [0, r - 1])
    clean = _execute(pipeline, [chunk], [[]], pipeline.copy_state(filled), [0.0])
    return [_case(p, "prefill-padding", name, clean,
                  _execute(pipeline, [chunk], [list(range(r, width))],
                           pipeline.copy_state(filled), pattern), slots=p + r, written=p + r)
            for name, pattern in POISONS.items()]


def _execute(pipeline: ShardPipeline, passes: list[Pass], poisoned: list[list[int]],
             state: PipelineState, pattern: Sequence[float]) -> Outcome:
    """Run the passes, replacing the poisoned rows' embeddings with `pattern` (tiled)."""
    rows: list[np.ndarray] = []
    finite = True
    for run, bad in zip(passes, poisoned):
        inputs = pipeline.host.rows(run.positions, run.writes)
        embedded = pipeline.embeddings.lookup(run.tokens)
        for k in bad:
            embedded[k] = np.resize(np.asarray(pattern, np.float32), embedded.shape[1])
        # Overflow is the point here: neither the fp16 cast of 7e4 nor the interpreter's
        # per-op overflow warnings say anything the comparison does not.
        with np.errstate(over="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            hidden = pipeline.to_hidden(embedded)
            wide = len(run.tokens) > pipeline.max_t  # the prefill function's pass
            hidden = pipeline.run_shards(hidden, inputs, state, prefill=wide)
            read = run.read
            if wide:  # the head takes the read rows only, padded as decode passes pad
                picked = read + [read[-1]] * (pipeline.shape.pass_width(len(read)) - len(read))
                hidden = np.take(hidden, picked, axis=token_axis(pipeline.layout))
                read = list(range(len(read)))
            out = pipeline.head.predict({"x": hidden})
        for k in read:
            rows.append(np.concatenate([pipeline.head_major(out[name])[k].astype(np.float64)
                                        for name in sorted(out)]))
        finite = finite and all(np.isfinite(a).all() for a in state_arrays(pipeline, state))
    return Outcome(rows, state_arrays(pipeline, state) if finite else [])


def _case(p: int, case: str, poison: str, clean: Outcome, dirty: Outcome, slots: int,
          written: int) -> dict:
    """Compare the read rows and, in every state, the slots holding positions below `slots`
    (positions 0..`written`-1 were written, in order)."""
    rows_equal = all(exactly_equal(a, b) for a, b in zip(clean.rows, dirty.rows))
    finite = bool(clean.states) and bool(dirty.states)  # [] where a pass left a non-finite value
    states_equal = finite and all(
        exactly_equal(a[:, :, kept], b[:, :, kept])
        for a, b in zip(clean.states, dirty.states)
        for kept in [_slots_holding_positions_below(a.shape[2], slots, written)])
    return {"prefix_tokens": p, "case": case, "poison": poison, "finite": finite,
            "rows_identical": rows_equal, "states_identical": states_equal,
            "identical": rows_equal and states_equal}


def _slots_holding_positions_below(width: int, slots: int, written: int) -> np.ndarray | slice:
    """The slots of a state `width` wide that hold a position below `slots`. A full-length
    state holds position q at slot q; a sliding-window ring (model/swa_ring.py) at q mod width,
    the latest written position of each residue: there a rejected draft's slot is another
    position's slot once it wraps, and comparing slots by index would count the draft's own
    write (which may differ: it is hidden until overwritten) as a leak."""
    if written <= width:
        return slice(0, slots)
    held = np.arange(written - width, written)       # the last `width` positions written
    return np.sort(held[held < slots] % width)


def _verdict(pipeline: ShardPipeline, passed: bool, failures: list[str],
             exposed: list[dict]) -> str:
    where = pipeline.backend.describe()
    if passed and pipeline.manifest.build.mask_form == "additive":
        kinds = ", ".join(sorted({c["case"] for c in exposed})) or "none seen"
        return (f"additive mask form on {where}: KNOWN EXPOSURE, {len(exposed)} case(s) leak "
                f"as that form is documented to ({kinds}: an overflowing row's NaN poisons "
                "every slot, a hidden slot holding FP16_MAX K can win); every other case is "
                "identical. Speculative decoding equals greedy only while no row overflows "
                "fp16; build with --mask-form select for the guarantee")
    if passed:
        return (f"finite-safe on {where}: a row that overflows fp16 (padding, filler, rejected "
                "draft) changes no other slot and no other row, and hidden slots cannot win")
    return (f"OVERFLOW LEAKS on {where} ({len(failures)} cases, first: {failures[0]}): one "
            "overflowing row can change other rows' results, so speculative decoding is NOT "
            "guaranteed to equal greedy decoding on this backend")
