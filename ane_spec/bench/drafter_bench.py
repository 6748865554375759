"""Replay bench for model-free drafters: greedy block verification simulated on token streams.

Replay of one stream: reset the drafter with the prompt, then per verification pass draft up to
k tokens, accept the longest prefix m equal to the true next output tokens, emit m + 1 tokens
(the accepted drafts plus the correction or bonus token; fewer only at the very end of the
output) and `append` exactly those to the drafter. This is what greedy speculative decoding does
when the model's argmax is the recorded output, so the numbers are the drafter's, not a model's.

Metrics (as in docs/speculative-decoding-notes.md, pooled over streams):

* tokens per pass = generated tokens / passes, counting passes with no draft;
* hit rate = passes with a non-empty draft / passes;
* acceptance = accepted drafts / drafted tokens;
* µs per draft: median and p99 of the wall time of each `draft` call.

Drafters are given as factories (``{"name": NgramDrafter}``) so every stream starts fresh.
`losses` lists the families where one drafter has fewer tokens per pass than another;
`time_drafts` measures draft latency at a fixed history length (scripts/bench_drafter.py).

`VllmNgramBaseline` is the reference: vLLM's `ngram` proposer rule (longest suffix n-gram with n
in [min, max], the earliest occurrence in the context, continuation cut at the end of the
context), recomputed by scanning the whole context at every step. The scan is vectorised with
numpy (vLLM runs a numba-compiled KMP); both are O(context) per draft.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ane_spec.bench.streams import Stream
from ane_spec.decode.drafter import Drafter
from ane_spec.errors import AneSpecError

__all__ = [
    "CrossRequest", "TokenBuffer", "VllmNgramBaseline", "format_markdown", "format_side_by_side",
    "format_timing_markdown", "losses", "replay", "run_drafter_bench", "time_drafts",
    "time_steps",
]

DrafterFactory = Callable[[], Drafter]


@dataclass(frozen=True)
class CrossRequest:
    """A factory whose drafter replays every stream of a family, in order: one instance per
    family, so it may remember earlier requests (its `reset` starts the next one)."""

    factory: DrafterFactory


class TokenBuffer:
    """A growing int64 array: amortised O(1) appends, O(1) views (the baselines' contexts)."""

    def __init__(self, tokens: Sequence[int] | np.ndarray = ()) -> None:
        self._buf = np.zeros(max(1024, 2 * len(tokens)), dtype=np.int64)
        self._len = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        n = len(tokens)
        if self._len + n > len(self._buf):
            grown = np.zeros(max(2 * len(self._buf), self._len + n), dtype=np.int64)
            grown[:self._len] = self._buf[:self._len]
            self._buf = grown
        self._buf[self._len:self._len + n] = tokens
        self._len += n

    def view(self) -> np.ndarray:
        return self._buf[:self._len]

    def __len__(self) -> int:
        return self._len


class VllmNgramBaseline:
    """vLLM's `ngram` proposer as a Drafter: O(context) rescan per draft, earliest occurrence.

    The draft continues the earliest occurrence of the longest suffix (length n in
    [ngram_min, ngram_max]) that also occurs earlier in the context, for up to k tokens, stopping
    at the end of the context. `fill` is accepted and ignored (vLLM has no such mode).
    """

    def __init__(self, *, ngram_min: int = 1, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise AneSpecError(f"VllmNgramBaseline: need 1 <= ngram_min <= ngram_max, "
                               f"got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._context = TokenBuffer()

    def __repr__(self) -> str:
        return f"VllmNgramBaseline(ngram_min={self.ngram_min}, ngram_max={self.ngram_max})"

    def reset(self, prompt_tokens: Sequence[int]) -> None:
        self._context = TokenBuffer(prompt_tokens)

    def append(self, tokens: Sequence[int]) -> None:
        self._context.extend(tokens)

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise AneSpecError(f"draft: k must be a non-negative integer, got {k!r}")
        h = self._context.view()
        L = len(h)
        if k == 0 or L < self.ngram_min + 1:
            return []
        # Occurrence ends e in [0, L-2] (each has a successor); run[e] stays true while
        # h[e - j] == h[L - 1 - j] for j = 0..n-1, so `length` is the match length at e, capped.
        ends = L - 1
        run = h[:ends] == h[L - 1]
        length = run.astype(np.int32)
        for j in range(1, min(self.ngram_max, L - 1)):
            step = np.zeros(ends, dtype=bool)
            step[j:] = h[: ends - j] == h[L - 1 - j]
            run &= step
            if not run.any():
                break
            length += run
        best = int(length.max())
        if best < self.ngram_min:
            return []
        # Earliest occurrence: the smallest start e - best + 1, i.e. the smallest end.
        e = int(np.argmax(length >= best))
        start = e + 1
        return h[start: min(L, start + k)].tolist()


# -- replay ---------------------------------------------------------------------------------------

def replay(drafter: Drafter, stream: Stream, *, k: int = 3, fill: bool = False) -> dict[str, Any]:
    """Replay one stream; returns counts and the per-draft wall times (ns)."""
    output = stream.output
    n = len(output)
    drafter.reset(list(stream.prompt))
    pos = passes = hits = drafted = accepted = 0
    times: list[int] = []
    clock = time.perf_counter_ns
    while pos < n:
        t0 = clock()
        draft = drafter.draft(k, fill=fill)
        times.append(clock() - t0)
        draft = list(draft)
        if len(draft) > k:
            raise AneSpecError(f"{drafter!r} drafted {len(draft)} tokens for k={k}")
        m = 0
        while m < len(draft) and pos + m < n and draft[m] == output[pos + m]:
            m += 1
        emitted = output[pos: pos + m + 1]
        drafter.append(emitted)
        pos += len(emitted)
        passes += 1
        hits += bool(draft)
        drafted += len(draft)
        accepted += m
    return {"generated": n, "passes": passes, "hits": hits, "drafted": drafted,
            "accepted": accepted, "times_ns": times}


def _metrics(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    gen = sum(p["generated"] for p in parts)
    passes = sum(p["passes"] for p in parts)
    hits = sum(p["hits"] for p in parts)
    drafted = sum(p["drafted"] for p in parts)
    accepted = sum(p["accepted"] for p in parts)
    times = sorted(t for p in parts for t in p["times_ns"])
    return {
        "streams": len(parts), "generated": gen, "passes": passes, "hits": hits,
        "drafted": drafted, "accepted": accepted,
        "tokens_per_pass": gen / passes if passes else 0.0,
        "hit_rate": hits / passes if passes else 0.0,
        "acceptance": accepted / drafted if drafted else 0.0,
        "draft_us_median": statistics.median(times) / 1e3 if times else 0.0,
        "draft_us_p99": _quantile(times, 0.99) / 1e3 if times else 0.0,
    }


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values."""
    idx = min(len(sorted_values) - 1, max(0, int(np.ceil(q * len(sorted_values))) - 1))
    return float(sorted_values[idx])


def run_drafter_bench(streams: Sequence[Stream],
                      drafters: Mapping[str, DrafterFactory | CrossRequest], k: int = 3,
                      fill: bool = False) -> dict[str, Any]:
    """Replay every stream with a fresh drafter from each factory (a `CrossRequest` factory:
    one drafter per family, through its streams in order).

    Returns ``{"k", "fill", "families": [...], "drafters": {name: {"families": {family:
    metrics}, "overall": metrics}}}`` where metrics holds tokens_per_pass, hit_rate, acceptance,
    draft_us_median, draft_us_p99 and the raw counts.
    """
    if not streams:
        raise AneSpecError("run_drafter_bench: no streams")
    if not drafters:
        raise AneSpecError("run_drafter_bench: no drafters")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise AneSpecError(f"run_drafter_bench: k must be a non-negative integer, got {k!r}")
    families = list(dict.fromkeys(s.family for s in streams))
    out: dict[str, Any] = {"k": k, "fill": fill, "families": families, "drafters": {}}
    for name, factory in drafters.items():
        per_family: dict[str, list[dict]] = {f: [] for f in families}
        kept: dict[str, Drafter] = {}
        for s in streams:
            if isinstance(factory, CrossRequest):
                if s.family not in kept:
                    kept[s.family] = factory.factory()
                drafter = kept[s.family]
            else:
                drafter = factory()
            per_family[s.family].append(replay(drafter, s, k=k, fill=fill))
        out["drafters"][name] = {
            "families": {f: _metrics(parts) for f, parts in per_family.items()},
            "overall": _metrics([p for parts in per_family.values() for p in parts]),
        }
    return out


def losses(result: Mapping[str, Any], ours: str, baseline: str) -> dict[str, tuple[float, float]]:
    """Families (and "overall") where `ours` has fewer tokens per pass than `baseline`."""
    a, b = result["drafters"][ours], result["drafters"][baseline]
    bad = {}
    for f in [*result["families"], "overall"]:
        ma = a["overall"] if f == "overall" else a["families"][f]
        mb = b["overall"] if f == "overall" else b["families"][f]
        if ma["tokens_per_pass"] < mb["tokens_per_pass"]:
            bad[f] = (ma["tokens_per_pass"], mb["tokens_per_pass"])
    return bad


def format_markdown(result: Mapping[str, Any]) -> str:
    """One table: a row per (family, drafter), families in stream order, then overall."""
    lines = [
        f"k={result['k']}, fill={'on' if result['fill'] else 'off'}",
        "",
        "| family | drafter | tokens/pass | hit rate | acceptance | µs/draft p50 | µs/draft p99 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for f in [*result["families"], "overall"]:
        for name, res in result["drafters"].items():
            m = res["overall"] if f == "overall" else res["families"][f]
            lines.append(
                f"| {f} | {name} | {m['tokens_per_pass']:.3f} | {m['hit_rate']:.1%} | "
                f"{m['acceptance']:.1%} | {m['draft_us_median']:.1f} | {m['draft_us_p99']:.1f} |")
    return "\n".join(lines) + "\n"


def format_side_by_side(result: Mapping[str, Any]) -> str:
    """Tokens per pass, a row per family (then overall) and a column per drafter."""
    names = list(result["drafters"])
    lines = [f"tokens per pass, k={result['k']}, fill={'on' if result['fill'] else 'off'}", "",
             "| family | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for f in [*result["families"], "overall"]:
        cells = []
        for name in names:
            res = result["drafters"][name]
            m = res["overall"] if f == "overall" else res["families"][f]
            cells.append(f"{m['tokens_per_pass']:.3f}")
        lines.append(f"| {f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- draft latency at a given history length ------------------------------------------------------

def time_drafts(factory: DrafterFactory, history: Sequence[int], sizes: Sequence[int], *,
                k: int = 3, steps: int = 2000) -> dict[int, dict[str, float]]:
    """µs per `draft(k)` once the drafter holds `size` tokens of `history`.

    The drafter is reset with history[:size], then `steps` times drafts and appends the next
    history token (as decoding would), timing only the draft calls. Needs
    len(history) >= max(sizes) + steps.
    """
    if len(history) < max(sizes) + steps:
        raise AneSpecError(f"time_drafts: need {max(sizes) + steps} history tokens, "
                           f"got {len(history)}")
    out = {}
    clock = time.perf_counter_ns
    for size in sizes:
        d = factory()
        d.reset(list(history[:size]))
        times = []
        for i in range(steps):
            t0 = clock()
            d.draft(k)
            times.append(clock() - t0)
            d.append(history[size + i: size + i + 1])
        times.sort()
        out[size] = {"median_us": statistics.median(times) / 1e3,
                     "p99_us": _quantile(times, 0.99) / 1e3}
    return out


def time_steps(factory: DrafterFactory, history: Sequence[int], size: int, *,
               memory: Sequence[Sequence[int]] = (), k: int = 3,
               steps: int = 2000) -> dict[str, float]:
    """µs per decoding step, `append` of one committed token + `draft(k)`, once the drafter
    holds `size` tokens of `history` and, first, the earlier requests in `memory` (each reset
    with one of them, so a drafter with a `DraftMemory` remembers them; see `reset`)."""
    if len(history) < size + steps:
        raise AneSpecError(f"time_steps: need {size + steps} history tokens, got {len(history)}")
    d = factory()
    for request in memory:
        d.reset(list(request))
    d.reset(list(history[:size]))
    d.draft(k)
    times = []
    clock = time.perf_counter_ns
    for i in range(steps):
        token = history[size + i: size + i + 1]
        t0 = clock()
        d.append(token)
        d.draft(k)
        times.append(clock() - t0)
    times.sort()
    return {"median_us": statistics.median(times) / 1e3, "p99_us": _quantile(times, 0.99) / 1e3}


def format_timing_markdown(timings: Mapping[str, Mapping[int, Mapping[str, float]]]) -> str:
    sizes = sorted({s for t in timings.values() for s in t})
    head = "| drafter | " + " | ".join(f"{s // 1024}k p50 | {s // 1024}k p99" if s % 1024 == 0
                                        else f"{s} p50 | {s} p99" for s in sizes) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(sizes)]
    for name, t in timings.items():
        cells = " | ".join(f"{t[s]['median_us']:.1f} | {t[s]['p99_us']:.1f}" for s in sizes)
        lines.append(f"| {name} | {cells} |")
    return "\n".join(lines) + "\n"
