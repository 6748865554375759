"""Checks the `--kv-write slice` tests make on a pair of builds, one per K/V write form
(`{"scatter": ..., "slice": ...}`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.row_invariance import run_row_invariance, state_arrays
from ane_spec.runtime.pipeline import ShardPipeline


def pipelines(builds: dict[str, Path], precision: str = "fp16") -> dict[str, ShardPipeline]:
    return {form: open_pipeline(folder, "mil", precision)[1] for form, folder in builds.items()}


def side_by_side(a: ShardPipeline, b: ShardPipeline, prompt: list[int], chunk: int = 3):
    """`prompt` `chunk` tokens a pass through both pipelines, each on a state of its own: yields
    (start, a's pass, b's pass)."""
    states = [a.new_state(), b.new_state()]
    for start in range(0, len(prompt), chunk):
        yield start, *(p.run(prompt[start:start + chunk], start, st)
                       for p, st in zip((a, b), states))


def assert_same_run(pipes: dict[str, ShardPipeline], prompt: list[int], chunk: int,
                    prefill_at: int | None = None) -> int:
    """Run `prompt` `chunk` tokens a pass (padded to 4) in both builds, and from `prefill_at` on
    through the prefill function: every row's logits and, after every pass, every state the same
    values. Returns the rows compared."""
    states = {form: p.new_state() for form, p in pipes.items()}
    rows, start = 0, 0
    while start < len(prompt):
        if prefill_at is not None and start >= prefill_at:
            tokens = prompt[start:start + pipes["scatter"].prefill_t]
            out = {form: pipe.run_prefill(tokens, start, states[form], head=True)
                   for form, pipe in pipes.items()}
            got = [(out["scatter"].row_native(0), out["slice"].row_native(0))]
        else:
            tokens = prompt[start:start + chunk]
            out = {form: pipe.run(tokens, start, states[form]) for form, pipe in pipes.items()}
            got = [(out["scatter"].row_native(r), out["slice"].row_native(r))
                   for r in range(len(tokens))]
        for a, b in got:
            assert np.isfinite(a).all() and np.array_equal(a, b), (start, len(tokens))
            rows += 1
        for a, b in zip(*(state_arrays(pipes[f], states[f]) for f in ("scatter", "slice"))):
            assert np.array_equal(a, b), start  # +0 and -0 equal: see window_rows
        start += len(tokens)
    return rows


def assert_probes_pass(pipeline: ShardPipeline) -> None:
    """Block, row invariance (bitwise, every state included) and overflow, end of context
    included: the probes' own files, as `ane-spec probe` runs them."""
    block, rows, overflow = run_block(pipeline), run_row_invariance(pipeline), run_overflow(pipeline)
    print(pipeline.manifest.name, block.summary(), "|", rows.summary(), "|", overflow.summary())
    assert block.passed and rows.passed and overflow.passed
    assert overflow.figures["cases"] >= 30 and rows.figures["cases"] == 3


def assert_speculative_is_greedy_and_scatters(pipes: dict[str, ShardPipeline], vocab: int,
                                              longest: int) -> None:
    """Eight prompts: the slice build's speculative output is its greedy output and the scatter
    build's, token for token; drafts were both accepted and rejected, and the output varies."""
    rng = np.random.default_rng(5)
    drafted = accepted = 0
    distinct = []
    for _ in range(8):
        prompt = rng.integers(0, vocab, int(rng.integers(2, longest))).tolist()
        options = GenerateOptions(max_tokens=24, speculative=False)
        greedy = DecodeSession(pipes["slice"]).generate(prompt, options)
        spec = DecodeSession(pipes["slice"]).generate(prompt, GenerateOptions(max_tokens=24))
        other = DecodeSession(pipes["scatter"]).generate(prompt, GenerateOptions(max_tokens=24))
        assert spec.tokens == greedy.tokens == other.tokens, prompt
        drafted, accepted = drafted + spec.stats.drafted, accepted + spec.stats.accepted
        distinct.append(len(set(greedy.tokens)))
    print("distinct per 24:", distinct, "drafted", drafted, "accepted", accepted)
    assert 0 < accepted < drafted and np.median(distinct) >= 5
