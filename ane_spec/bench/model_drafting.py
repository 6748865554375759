"""Replay of model drafting on a target's own greedy output: tokens per target pass, without
running the target's verify passes.

Greedy verification accepts exactly the drafts that equal the target's next tokens, so given the
target's greedy stream a step is: ask the drafter for k drafts, accept the longest prefix equal to
the stream, commit it plus one token (the correction or bonus). That is what the decode session
does when the target's argmax is the recorded stream, so tokens per pass come out as a
generation would give them, and the draft model really runs: each of its passes is counted, and
`verifying` is called before each step as the session calls it (the look-ahead is run inline, so
its passes are counted apart, as hidden ones).

`ReferenceDraftModel` runs the draft with the torch reference forward pass (much faster than the
interpreter on a CPU); its greedy drafts are the built draft's up to near ties.

The time a step costs, in target passes, is 1 + c * (draft passes on the critical path), with c
the draft-to-target pass cost ratio; `at_cost` turns a replay into tokens per unit of time for
the costs of a device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ane_spec.bench.streams import Stream
from ane_spec.decode.draft_policy import BothDrafters


class ReferenceDraftModel:
    """A `DraftModel` on the torch reference forward pass (model/reference.py)."""

    def __init__(self, reference: Any):
        self.ref = reference
        self.vocab_size = reference.config.vocab_size
        self.max_seq = reference.context_window
        self._passes = 0

    def new_state(self) -> Any:
        return self.ref.new_cache()

    def can_resume(self, state: Any, n: int) -> bool:
        return True

    def run(self, tokens: Sequence[int], position: int, state: Any) -> np.ndarray:
        # The cache writes at `length`: moving it back forgets (and later overwrites) slots past
        # it, as the built draft's mask does.
        state.length = position
        del state.tokens[position:]
        self._passes += 1
        return self.ref.forward(list(tokens), state)[-1].float().numpy()

    def passes(self) -> int:
        return self._passes


class TeacherForcedDraftModel:
    """A greedy `DraftModel` read from one teacher-forced pass of the draft over each stream.

    Greedy verification accepts the longest prefix of drafts equal to the stream, and every
    draft on that prefix was made from a history equal to the stream: so the draft's argmax and
    its probability at each stream position (`table[stream key][i]`, the draft's next token after
    prompt + output[:i]) decide the accepted drafts exactly, as a run of the draft would. One
    batched pass per stream replaces thousands of T=1 passes (0.8 s each for a 0.5B reference on
    this loaded CPU). Off the stream (the tokens after a rejected draft) it answers with the
    stream position's entry: those drafts are rejected whatever they are, so tokens per pass and
    the draft's passes are exact; only a p_min stop after a rejected draft may differ from a
    real run's. Greedy only (no q)."""

    def __init__(self, table: Mapping[tuple[int, ...], Sequence[tuple[int, float]]],
                 vocab_size: int, max_seq: int = 1 << 20):
        self.table = dict(table)
        self.vocab_size = vocab_size
        self.max_seq = max_seq
        self.stream: tuple[int, ...] | None = None
        self.rows: Sequence[tuple[int, float]] = ()
        self._passes = 0

    def new_state(self) -> list[int]:
        return []

    def can_resume(self, state: Any, n: int) -> bool:
        return True

    def _rows_for(self, seq: Sequence[int]) -> Sequence[tuple[int, float]]:
        if self.stream is None or tuple(seq[:len(self.stream)]) != self.stream[:len(seq)]:
            for key, rows in self.table.items():
                if tuple(seq[:len(key)]) == key[:len(seq)]:
                    self.stream, self.rows = key, rows
                    break
        return self.rows

    def run(self, tokens: Sequence[int], position: int, state: list[int]) -> np.ndarray:
        del state[position:]
        state.extend(int(t) for t in tokens)
        self._passes += 1
        rows = self._rows_for(state)
        # The stream's entry at this position (off the stream: the nearest on-stream one).
        last = len(state) - 1
        token, prob = rows[min(last, len(rows) - 1)] if rows else (0, 1.0)
        # Logits with that argmax and that softmax probability: the rest share 1 - prob.
        v = self.vocab_size
        rest = max(1.0 / prob - 1.0, 1e-30) / (v - 1)
        z = np.full(v, np.log(rest), dtype=np.float32)
        z[token] = 0.0
        return z

    def passes(self) -> int:
        return self._passes


def teacher_forced_table(reference: Any, streams: Sequence[Stream],
                         say: Callable[[str], None] = lambda _m: None
                         ) -> dict[tuple[int, ...], list[tuple[int, float]]]:
    """Per stream (keyed by prompt + output), the draft's greedy next token and its probability
    after each prefix: one reference forward pass over the whole stream."""
    import torch

    table: dict[tuple[int, ...], list[tuple[int, float]]] = {}
    for i, s in enumerate(streams):
        seq = (*s.prompt, *s.output)
        logits = reference.forward(list(seq), reference.new_cache()).float()
        probs = torch.softmax(logits, dim=-1)
        top = probs.max(dim=-1)
        table[seq] = [(int(t), float(p)) for t, p in zip(top.indices, top.values)]
        say(f"teacher-forced draft: stream {i + 1}/{len(streams)} ({len(seq)} tokens)")
    return table


class InlineLookahead:
    """A ModelDrafter whose look-ahead (`predraft_async`) runs at once, its passes counted as
    hidden: the replay's stand-in for a draft in its own process."""

    def __init__(self, drafter: Any):
        self.drafter = drafter
        self.hidden_passes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.drafter, name)

    def predraft_async(self, block: Sequence[int], passes: int) -> None:
        model = self.drafter.model
        before = model.passes()
        self.drafter.predraft(block, passes)
        self.hidden_passes += model.passes() - before


def replay_sources(drafter: BothDrafters, stream: Stream, *, k: int = 3) -> dict[str, Any]:
    """Replay one stream; counts per source and the draft model's passes."""
    output = stream.output
    n = len(output)
    drafter.reset(list(stream.prompt))
    pos = passes = critical = 0
    sources: dict[str, list[int]] = {}
    lookahead = drafter.model if isinstance(drafter.model, InlineLookahead) else None
    hidden0 = lookahead.hidden_passes if lookahead else 0
    pending = stream.prompt[-1] if stream.prompt else 0
    while pos < n:
        prop = drafter.propose(k)
        draft = list(prop.tokens)[:k]
        if draft:
            drafter.verifying([pending, *draft])
        m = 0
        while m < len(draft) and pos + m < n and draft[m] == output[pos + m]:
            m += 1
        emitted = output[pos:pos + m + 1]
        drafter.append(emitted)
        pending = emitted[-1]
        pos += len(emitted)
        passes += 1
        critical += prop.passes
        row = sources.setdefault(prop.source if draft else "none", [0, 0, 0])
        row[0] += 1
        row[1] += len(draft)
        row[2] += m
    drafter.finish()
    return {"generated": n, "passes": passes, "critical_draft_passes": critical,
            "hidden_draft_passes": (lookahead.hidden_passes - hidden0) if lookahead else 0,
            "sources": sources}


def pooled(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    gen = sum(p["generated"] for p in parts)
    passes = sum(p["passes"] for p in parts)
    crit = sum(p["critical_draft_passes"] for p in parts)
    hidden = sum(p["hidden_draft_passes"] for p in parts)
    sources: dict[str, list[int]] = {}
    for p in parts:
        for s, row in p["sources"].items():
            acc = sources.setdefault(s, [0, 0, 0])
            for i in range(3):
                acc[i] += row[i]
    drafted = sum(r[1] for r in sources.values())
    accepted = sum(r[2] for r in sources.values())
    return {"streams": len(parts), "generated": gen, "passes": passes,
            "tokens_per_pass": gen / passes if passes else 0.0,
            "draft_passes_per_pass": crit / passes if passes else 0.0,
            "hidden_draft_passes_per_pass": hidden / passes if passes else 0.0,
            "acceptance": accepted / drafted if drafted else 0.0,
            "sources": {s: {"passes": r[0], "drafted": r[1], "accepted": r[2]}
                        for s, r in sorted(sources.items())}}


def at_cost(metrics: Mapping[str, Any], ratio: float) -> float:
    """Tokens per unit of time (one target pass = 1) when a draft pass costs `ratio`."""
    return metrics["tokens_per_pass"] / (1.0 + ratio * metrics["draft_passes_per_pass"])


def run_model_bench(streams: Sequence[Stream], drafters: Mapping[str, Callable[[], BothDrafters]],
                    k: int = 3) -> dict[str, Any]:
    """Each drafter factory over every stream (one drafter per factory, kept across streams, so
    its running figures carry over as a server's do). Returns per family and overall."""
    families = list(dict.fromkeys(s.family for s in streams))
    out: dict[str, Any] = {"k": k, "families": families, "drafters": {}}
    for name, factory in drafters.items():
        drafter = factory()
        per: dict[str, list[dict]] = {f: [] for f in families}
        for s in streams:
            per[s.family].append(replay_sources(drafter, s, k=k))
        out["drafters"][name] = {"families": {f: pooled(p) for f, p in per.items()},
                                 "overall": pooled([x for p in per.values() for x in p])}
    return out


def format_table(result: Mapping[str, Any], ratios: Sequence[float] = ()) -> str:
    """Tokens per target pass per family (columns) and drafter (rows); with `ratios`, also
    tokens per unit of time at those draft/target cost ratios (overall)."""
    cols = [*result["families"], "overall"]
    head = "| drafter | " + " | ".join(cols) + " | draft passes / pass |"
    head += "".join(f" tok/time at c={r:g} |" for r in ratios)
    lines = [head, "|---|" + "---:|" * (len(cols) + 1 + len(ratios))]
    for name, res in result["drafters"].items():
        cells = [res["overall"] if c == "overall" else res["families"][c] for c in cols]
        o = res["overall"]
        line = f"| {name} | " + " | ".join(f"{m['tokens_per_pass']:.2f}" for m in cells)
        line += f" | {o['draft_passes_per_pass']:.2f}"
        if o["hidden_draft_passes_per_pass"]:
            line += f" (+{o['hidden_draft_passes_per_pass']:.2f} hidden)"
        line += " |" + "".join(f" {at_cost(o, r):.2f} |" for r in ratios)
        lines.append(line)
    return "\n".join(lines) + "\n"
