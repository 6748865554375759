"""Benchmark the n-gram drafter: µs per draft(3) at 1k/8k/32k history, then the replay tables.

    /work/venv/bin/python scripts/bench_drafter.py [--per-family 20] [--seeds 3]
        [--streams FILE.jsonl] [--save-streams FILE.jsonl] [--steps 2000] [--out REPORT.md]

Latency: each drafter is reset with the first 1k/8k/32k tokens of tokenized stdlib source, then
`--steps` times drafts 3 tokens and appends the next true token; only the draft calls are timed
(median and p99). The project drafter keeps an incremental index (target <= 50 µs at 32k); the
vLLM-style baseline rescans the whole context on every call (numpy-vectorised, O(context)).

Replay: greedy block verification (k=3) simulated on the built-in streams (code, code-edit,
quote, structured, chat; `--per-family` streams per family for each of `--seeds` seeds) or on
the streams of a JSONL file, with fill off and on. Rows: the project drafter with its defaults
("ours"), with prefer="frequent", the plain recent/frequent rules (no earliest_from, follow or
resync), and the baseline at the same n range (1..4) and at vLLM's default (5..5). Exits 1 if
"ours" has fewer tokens per pass than a baseline on any family. Takes about a minute with the
defaults.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ane_spec.bench.drafter_bench import (
    VllmNgramBaseline,
    format_markdown,
    format_timing_markdown,
    losses,
    run_drafter_bench,
    time_drafts,
)
from ane_spec.bench.streams import (
    builtin_streams,
    load_streams,
    save_streams,
    stdlib_token_history,
)
from ane_spec.decode.drafter import NgramDrafter

SIZES = (1024, 8192, 32768)

REPLAY = {
    "ours": NgramDrafter,
    "ours prefer=frequent": lambda: NgramDrafter(prefer="frequent"),
    "plain recent": lambda: NgramDrafter(earliest_from=None, follow=False, resync=None),
    "plain frequent": lambda: NgramDrafter(prefer="frequent", earliest_from=None, follow=False,
                                           resync=None),
    "vllm(1,4)": lambda: VllmNgramBaseline(ngram_min=1, ngram_max=4),
    "vllm(5,5)": lambda: VllmNgramBaseline(ngram_min=5, ngram_max=5),
}
BASELINES = ("vllm(1,4)", "vllm(5,5)")

TIMED = {
    "ours": NgramDrafter,
    "ours prefer=frequent": lambda: NgramDrafter(prefer="frequent"),
    "vllm(1,4) rescan": lambda: VllmNgramBaseline(ngram_min=1, ngram_max=4),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-family", type=int, default=20)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--streams", type=Path, help="replay these JSONL streams instead")
    ap.add_argument("--save-streams", type=Path, help="write the replayed streams as JSONL")
    ap.add_argument("--steps", type=int, default=2000, help="timed drafts per history size")
    ap.add_argument("--out", type=Path, help="also write the report (markdown) here")
    args = ap.parse_args()

    parts: list[str] = []

    def emit(text: str) -> None:
        print(text, flush=True)
        parts.append(text)

    history = stdlib_token_history(max(SIZES) + args.steps)
    timings = {name: time_drafts(f, history, SIZES, steps=args.steps) for name, f in TIMED.items()}
    emit(f"## µs per draft(3) ({args.steps} drafts per size, history = tokenized stdlib source)\n")
    emit(format_timing_markdown(timings))

    if args.streams:
        streams = load_streams(args.streams)
        source = str(args.streams)
    else:
        streams = [s for seed in range(args.seeds)
                   for s in builtin_streams(args.per_family, seed=seed)]
        source = f"built-in, {args.per_family} per family x {args.seeds} seeds"
    if args.save_streams:
        save_streams(streams, args.save_streams)
    n_out = sum(len(s.output) for s in streams)
    emit(f"## Replay ({len(streams)} streams, {source}; {n_out} output tokens)\n")
    lost = False
    for fill in (False, True):
        t0 = time.perf_counter()
        res = run_drafter_bench(streams, REPLAY, k=3, fill=fill)
        emit(format_markdown(res))
        for base in BASELINES:
            bad = losses(res, "ours", base)
            lost |= bool(bad)
            verdict = ("never loses" if not bad else "LOSES on " + ", ".join(
                f"{f} ({a:.3f} < {b:.3f})" for f, (a, b) in bad.items()))
            emit(f"- ours vs {base}, fill={'on' if fill else 'off'}: {verdict}")
        emit(f"\n({time.perf_counter() - t0:.1f} s)\n")
    if args.out:
        args.out.write_text("\n".join(parts) + "\n", encoding="utf-8")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
