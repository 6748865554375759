"""`ane-spec tune --draft-model D`: the draft model measured beside the build, on each set of
compute units it could run on, and whether it pays.

Whether a draft model is worth running, and where, is a property of the device: a draft pass on
the GPU may hide behind the target's pass on the Neural Engine, or share its bandwidth and slow it.
Only the Mac can tell, so the first Mac run measures it. Per units (Core ML: `ane`, `gpu`, `cpu`;
the MIL interpreter: its own CPU, once), in a process of its own under the tune's deadline:

- the costs `serve --draft-model` measures at warm-up (decode/draft_setup.py): c_verify, c_draft
  and the overlap of the two, what the drafting policy (decode/draft_policy.py) is set from;
- one short decode on the same prompt (sweep's built-in code) four ways: plain greedy,
  the n-gram drafter alone, the draft model alone (`--draft-mode model`) and both (`serve`'s
  default, a source chosen per step): tokens per second and tokens per target pass. Speculative
  output must equal greedy's; a units where it does not is `wrong`, and never chosen.

The choice: the units and mode with the most tokens per second, if that beats the n-gram drafter
alone by the tune's margin and takes more tokens per target pass than it (a draft model can only
help by raising tokens per pass; a faster time without that is the noise of one short decode);
else no draft model (the n-gram drafter is free).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from ane_spec.bench.tune import Progress, run_isolated
from ane_spec.bench.tune_model import DraftChoice, DraftRow, DraftTune
from ane_spec.errors import AneSpecError

DEFAULT_NEW_TOKENS = 64
PROMPT_TOKENS = 200   # a prompt of sweep's built-in code: repetition enough for the n-grams


@dataclasses.dataclass(frozen=True)
class DraftJob:
    """One units' measurement, as plain values the worker process unpickles."""

    target: str          # the build folder (the user's --manifest)
    draft: str           # the draft model's build folder
    backend: str         # "coreml" or "mil"
    units: str | None    # --draft-units; None on the interpreter
    prompt_tokens: int
    new_tokens: int


def units_of(backend: str) -> list[str | None]:
    from ane_spec.decode.draft_setup import DRAFT_UNITS

    return list(DRAFT_UNITS) if backend == "coreml" else [None]


def measure_draft(job: DraftJob, progress: Progress) -> dict[str, Any]:
    """DraftRow's fields for one units (runs in the worker process)."""
    from ane_spec.bench.sweep import source_text, tiled_prompt
    from ane_spec.decode.draft_setup import close_drafter, open_drafter
    from ane_spec.decode.drafter import NgramDrafter
    from ane_spec.decode.session import DecodeSession, GenerateOptions
    from ane_spec.probes.gates import open_pipeline

    label = job.units or "interpreter"
    say = lambda m: progress(f"draft on {label}: {m}")  # noqa: E731
    precision = "fp16" if job.backend == "mil" else "fp32"  # Core ML computes fp16 anyway
    _, pipeline = open_pipeline(job.target, job.backend, precision, verify=False)
    prompt = tiled_prompt(pipeline.tokenizer.encode(source_text("code")), job.prompt_tokens)

    def decode(drafter: Any, speculative: bool = True) -> tuple[list[int], dict[str, Any]]:
        out = DecodeSession(pipeline, drafter=drafter).generate(prompt, GenerateOptions(
            max_tokens=job.new_tokens, speculative=speculative))
        return out.tokens, out.stats.to_dict()

    try:
        say("measuring its costs beside the build")
        drafter = open_drafter(pipeline, job.draft, units=job.units, mode="both")  # type: ignore[arg-type]
        try:
            row: dict[str, Any] = {"units": label, "outcome": "ok"} | drafter.costs.to_dict()
            say(f"decoding {job.new_tokens} tokens: greedy, n-grams, draft model, both")
            # Pays the JIT of every pass width the decode shape uses, before any timing.
            DecodeSession(pipeline).generate(prompt[:8], GenerateOptions(max_tokens=8))
            greedy, stats = decode(NgramDrafter(), speculative=False)
            row["greedy_tok_s"] = stats["decode_tok_s"]
            wrong = []
            for mode in ("ngram", "model", "both"):
                if mode != "ngram":
                    drafter.mode = mode  # read per step: one drafter, its process kept
                tokens, stats = decode(NgramDrafter() if mode == "ngram" else drafter)
                row |= {f"{mode}_tok_s": stats["decode_tok_s"],
                        f"{mode}_tokens_per_pass": stats["tokens_per_pass"]}
                if mode == "both":
                    row["both_sources"] = stats["draft_sources"]
                if tokens != greedy:
                    wrong.append(mode)
        finally:
            close_drafter(drafter)
    finally:
        close = getattr(pipeline.backend, "close", None)
        if close is not None:  # a Core ML worker: this process leaves without atexit hooks
            close()
    if wrong:
        row |= {"outcome": "wrong", "reason": f"speculative decoding ({', '.join(wrong)}) "
                                              "differed from greedy"}
    return row


def choose_draft(rows: list[DraftRow], margin: float, units_flag: bool) -> DraftChoice:
    """The fastest correct units and mode, if it beats the n-grams alone by `margin` (module
    docstring). `units_flag`: whether serve takes --draft-units (Core ML) or not (the
    interpreter)."""
    ok = [r for r in rows if r.outcome == "ok"]
    failed = "; ".join(f"{r.units} {r.outcome} ({r.reason})" for r in rows if r.outcome != "ok")
    tail = f"; not ok: {failed}" if failed else ""
    if not ok:
        return DraftChoice(use_draft=False, units=None, serve_flags="", measured=False,
                           rests_on="no units ran correctly: serve without --draft-model" + tail)
    speed, mode, best = max(((getattr(r, f"{m}_tok_s") or 0.0, m, r) for r in ok
                             for m in ("both", "model")), key=lambda c: c[0])
    ngram = statistics.median(r.ngram_tok_s or 0.0 for r in ok)
    more_per_pass = ((getattr(best, f"{mode}_tokens_per_pass") or 0.0)
                     > (best.ngram_tokens_per_pass or 0.0))
    figures = (f"{speed:.4g} tok/s with the draft on {best.units}, mode {mode} "
               f"({getattr(best, f'{mode}_tokens_per_pass'):.3g} tokens per pass, "
               f"c_draft/c_verify {best.ratio:.3g}, overlap "
               f"{best.overlap if best.overlap is not None else '-'}) vs {ngram:.4g} with the "
               f"n-grams alone, {best.greedy_tok_s:.4g} greedy")
    if not more_per_pass:
        return DraftChoice(use_draft=False, units=None, serve_flags="", measured=True,
                           rests_on=f"no draft model: {figures}; no more tokens per pass than "
                                    f"the n-grams' {best.ngram_tokens_per_pass:.3g}{tail}")
    if speed <= ngram * (1 + margin):
        return DraftChoice(use_draft=False, units=None, serve_flags="", measured=True,
                           rests_on=f"no draft model: {figures}, under the {margin:.0%} "
                                    f"margin{tail}")
    flags = ("--draft-model DRAFT" + (f" --draft-units {best.units}" if units_flag else "")
             + (" --draft-mode model" if mode == "model" else ""))
    return DraftChoice(use_draft=True, units=best.units if units_flag else None, mode=mode,
                       serve_flags=flags, measured=True, rests_on=figures + tail)


def prompt_tokens(max_seq: int, new_tokens: int) -> int:
    """The measurement's prompt length in a context of `max_seq`, or one line saying why
    `new_tokens` does not fit (checked before any variant runs, not after)."""
    if new_tokens < 1:
        raise AneSpecError(f"--draft-tokens {new_tokens}: give at least 1")
    prompt = min(PROMPT_TOKENS, max_seq - new_tokens)
    if prompt < 8:
        raise AneSpecError(f"the build's context of {max_seq} leaves no room for a prompt and "
                           f"{new_tokens} new tokens")
    return prompt


def run_draft_tune(target: str, draft: str, *, backend: str, margin: float, deadline_s: float,
                   new_tokens: int = DEFAULT_NEW_TOKENS, max_seq: int,
                   progress: Progress = lambda m: None, measure=measure_draft) -> DraftTune:
    """Every units of `backend`, each in its own process (`run_isolated`), and the choice."""
    prompt = prompt_tokens(max_seq, new_tokens)
    rows = []
    for units in units_of(backend):
        label = units or "interpreter"
        progress(f"draft model on {label}")
        started = time.monotonic()
        job = DraftJob(target=target, draft=draft, backend=backend, units=units,
                       prompt_tokens=prompt, new_tokens=new_tokens)
        fields = {"units": label} | run_isolated(f"draft on {label}", job, deadline_s,
                                                 progress, measure)
        row = DraftRow(**fields)
        row.seconds = round(time.monotonic() - started, 2)
        progress(f"draft on {label}: {row.outcome}" + (
            f", model {row.model_tok_s:.4g} tok/s, both {row.both_tok_s:.4g}, n-grams "
            f"{row.ngram_tok_s:.4g}" if row.both_tok_s is not None else "")
            + (f" ({row.reason})" if row.reason else ""))
        rows.append(row)
    return DraftTune(draft=draft, prompt_tokens=prompt, new_tokens=new_tokens, rows=rows,
                     choice=choose_draft(rows, margin, units_flag=backend == "coreml"))
