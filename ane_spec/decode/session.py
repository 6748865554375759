"""One conversation on one backend: prefill, then greedy or sampled decoding with T=4 verification.

Slot bookkeeping: `kv_tokens` are the tokens whose K/V sit in slots 0..len-1. The *pending*
token (the last one emitted) is not in the cache yet; each pass writes [pending, drafts..] at
slots p.., keeps pending + the m accepted drafts, and leaves the rest as stale slots that the
attention mask hides and the next pass overwrites. Nothing is ever copied or rolled back.

A prompt is prefilled in passes of the build's prefill function (P tokens, layers only, the
head on the last token alone) where that is cheaper, else in decode-shape passes
(`prefill_plan.plan_chunks`). A later request whose prompt starts with `kv_tokens` (the next
chat turn) prefills only the new tokens; anything else simply starts writing at slot 0 again. So does a prefix that a KV ring
(sliding-window layers, model/swa_ring.py) can no longer continue: `ShardPipeline.can_resume`.

Exactness. In the pipeline's fixed decode shape every verify pass and plain greedy step computes
4 rows, and every prompt chunk 4 rows or, through the prefill function, P rows, chunked alike for
a speculative and a greedy run of one prompt on one loaded model (`prefill_plan`); so a token's
logits and K/V never depend on the row it sat in or on its neighbours: speculative greedy output
equals plain greedy output bitwise wherever the backend is row-invariant at both widths (`probe
row-invariance`), and the exactness guard has nothing to do. A conversation continued on its
cache (the reply's K/V written by 4-row passes) also equals a fresh prefill of it where the
backend is row-invariant across the two widths (the probe's cross-shape check). In the mixed
shape, T=1 and T=4 passes round differently; the guard then redoes near-tie rows at T=1, which is
best effort only: it cannot re-write the KV history earlier T=4 passes left behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ane_spec.decode.drafter import Drafter, NgramDrafter
from ane_spec.decode.grammar import Grammar
from ane_spec.decode.metrics import RequestStats, Trace
from ane_spec.decode.prefill_plan import plan_chunks
from ane_spec.runtime.decode_shape import PrefillMode
from ane_spec.decode.sampling import SamplingParams, sample, token_logprobs
from ane_spec.decode.stops import StopMatcher
from ane_spec.decode.verify import RowChooser, Verdict, verify_greedy, verify_sampled
from ane_spec.errors import AneSpecError
from ane_spec.runtime.pipeline import BlockOutput, PipelineState, ShardPipeline

FinishReason = Literal["stop", "length", "context", "cancelled"]
MAX_DRAFT = 3


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class GenerateOptions(BaseModel):
    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    max_tokens: int = Field(256, ge=1)
    stop: tuple[str, ...] = ()
    sampling: SamplingParams = SamplingParams()
    speculative: bool = True
    guard: bool = True  # mixed decode shape only: the fixed shape needs no guard
    grammar: Grammar | None = None  # output constrained to it (masked per verified row)
    logprobs: int | None = Field(None, ge=0, le=20)  # top-n alternatives per generated token
    special_text: bool = False  # render CONTROL tokens (<|tool_call|>) in the text
    # Wall-clock seconds the generation may run (prefill included); past them it ends with
    # finish_reason "length" and `GenerationResult.time_limited`.
    time_limit: float | None = Field(None, gt=0)
    # With a grammar: CPU seconds its masks may cost per generated token, on average over the
    # last GRAMMAR_WINDOW tokens; past them, GrammarTooCostly (see `_Run.check_grammar_cost`).
    grammar_token_seconds: float | None = Field(None, gt=0)
    # llama-server's n_indent: after the first line, a line indented by fewer spaces/tabs ends
    # the output (cut where its text starts), with finish_reason "length".
    n_indent: int = Field(0, ge=0)


GRAMMAR_WINDOW = 8  # tokens the grammar cost guard averages over


class GrammarTooCostly(AneSpecError):
    """A grammar whose masks cost more per token than GenerateOptions.grammar_token_seconds."""


class NeedsLogits(AneSpecError):
    """Options that an LM head emitting only each row's argmax (--head-argmax) cannot serve;
    `param` names the request parameter that asked for logits."""

    WHAT = {"temperature": "sampling (or use temperature 0)", "grammar": "a grammar"}

    def __init__(self, param: str):
        super().__init__(f"this build's LM head emits only argmax (--head-argmax), so it cannot "
                         f"do {self.WHAT.get(param, param)}: rebuild without it")
        self.param = param


def needs_logits(options: GenerateOptions) -> NeedsLogits | None:
    """The one decision of what an argmax-only head refuses: anything but plain greedy choice."""
    sampling = options.sampling
    if not sampling.greedy:
        return NeedsLogits("temperature")
    if options.logprobs is not None:
        return NeedsLogits("logprobs")
    if sampling.logit_edits:
        return NeedsLogits(sampling.logit_edits[0])
    if options.grammar is not None:
        return NeedsLogits("grammar")
    return None


@dataclass
class GenerationResult:
    prompt_tokens: int
    tokens: list[int]
    text: str
    finish_reason: FinishReason
    stats: RequestStats
    # Per generated token, with options.logprobs: (logprob, [(token, logprob), ...] top-n) of
    # the model's own distribution (the row's raw logits, before any processor).
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    grammar_complete: bool | None = None  # with a grammar: did the output complete it
    stop_word: str | None = None  # the stop string that ended the output, if one did
    time_limited: bool = False  # GenerateOptions.time_limit ended it

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "tokens": self.tokens, "text": self.text,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


OnText = Callable[[str], bool | None]


@dataclass
class DecodeSession:
    pipeline: ShardPipeline
    drafter: Drafter = field(default_factory=NgramDrafter)
    trace: Trace | None = None
    # None: as the decode shape's policy decides (measuring pass costs where it needs them).
    fill_drafts: bool | None = None
    # Which prompt chunks use the build's prefill function: auto (where measured cheaper),
    # on (every chunk), off (none: every chunk at the decode shape); None: the pipeline's.
    prefill: PrefillMode | None = None

    def __post_init__(self) -> None:
        self.state = self.pipeline.new_state()
        self.kv_tokens: list[int] = []
        self.tokenizer = self.pipeline.tokenizer
        self.eog = self.tokenizer.eog_ids
        shape = self.pipeline.shape
        if self.fill_drafts is None:
            from ane_spec.decode.cost import draft_policy

            self.fill_drafts = shape.fill_drafts(lambda: draft_policy(self.pipeline).ratio)
        self.guard_margin = shape.guard_margin(
            self.pipeline.manifest.drift.get(self.pipeline.drift_key))

    # --- public ------------------------------------------------------------------------------

    def generate(self, prompt: Sequence[int], options: GenerateOptions = GenerateOptions(),
                 on_text: OnText | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Generate after `prompt`. `on_text` receives each safe-to-show piece of text and may
        return False to cancel; `should_stop` is asked before every pass (output made only of
        invisible tokens never calls on_text). Cancellation takes effect at the next pass
        boundary, prefill included."""
        prompt = [int(t) for t in prompt]
        self._check(prompt, options)
        run = _Run(self, options, on_text, prompt,
                   RequestStats(prompt_tokens=len(prompt), decode_shape=self.pipeline.decode_shape))
        run.should_stop = should_stop or run.should_stop
        t0 = time.perf_counter()
        if options.time_limit is not None:
            run.deadline = time.monotonic() + options.time_limit
        prepare = getattr(self.drafter, "prepare", None)
        if prepare is not None:  # a draft model draws its drafts from q when sampling
            prepare(options.sampling)
        # Before the target's prefill: a draft model in its own process prefills meanwhile.
        self.drafter.reset(prompt)
        last = self._prefill(prompt, run.stats, run.should_stop)
        run.stats.prefill_seconds = time.perf_counter() - t0
        if last is None:
            run.finish = "cancelled"
            return run.result()

        t1 = time.perf_counter()
        run.pending = run.first_token(last)
        run.stats.ttft_seconds = time.perf_counter() - t0
        if run.emit(run.pending):
            while self._step(run):
                pass
        run.stats.decode_seconds = time.perf_counter() - t1
        return run.result()

    def reset(self) -> None:
        """Forget the conversation (the next prompt starts writing at slot 0)."""
        self.kv_tokens = []

    def use_slot(self, state: PipelineState, kv_tokens: list[int]) -> None:
        """Continue on another cache: `state` holds the K/V of `kv_tokens` in slots 0..n-1
        (the daemon keeps several). The next `generate` reuses its common prefix with the
        prompt, exactly as it would this session's own cache."""
        self.state = state
        self.kv_tokens = list(kv_tokens)

    # --- internals ---------------------------------------------------------------------------

    def _check(self, prompt: list[int], options: GenerateOptions) -> None:
        if not prompt:
            raise AneSpecError("the prompt is empty")
        limit = self.pipeline.max_seq
        if len(prompt) > limit:
            raise AneSpecError(f"the prompt has {len(prompt)} tokens, more than the context "
                               f"window of {limit}")
        vocab = self.pipeline.config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise AneSpecError(f"token ids {bad[:5]} are outside the vocabulary 0..{vocab - 1}")
        refusal = needs_logits(options) if self.pipeline.head_argmax else None
        if refusal is not None:
            raise refusal

    def _prefill(self, prompt: list[int], stats: RequestStats,
                 should_stop: Callable[[], bool]) -> BlockOutput | None:
        """Fill slots for the prompt, reusing the longest prefix already in the cache. At least
        the last prompt token is always run, since its row gives the first new token. None when
        `should_stop` cancelled it (the cache then holds the chunks written so far)."""
        reuse = min(common_prefix(self.kv_tokens, prompt), len(prompt) - 1)
        if not self.pipeline.can_resume(self.state, reuse):
            # A KV ring (sliding-window layers) no longer holds the positions just before a
            # shorter prefix of a long conversation: later ones took their slots. Recompute.
            reuse = 0
        stats.reused_prefix_tokens = reuse
        stats.prefill_tokens = len(prompt) - reuse
        self.kv_tokens = self.kv_tokens[:reuse]
        out = None
        for start, end, prefill in plan_chunks(self.pipeline, reuse, len(prompt), self.prefill):
            if should_stop():
                return None
            chunk = prompt[start:end]
            t0 = time.perf_counter()
            if prefill:
                out = self.pipeline.run_prefill(chunk, start, self.state,
                                                head=end == len(prompt))
            else:
                out = self.pipeline.run(chunk, start, self.state)
            self.kv_tokens.extend(chunk)
            stats.record_prefill_pass(self.pipeline.prefill_t if prefill else
                                      self.pipeline.shape.pass_width(end - start), prefill)
            if self.trace is not None:
                self.trace.write(prefill=True, position=start, T=end - start,
                                 width=(self.pipeline.prefill_t if prefill
                                        else self.pipeline.shape.pass_width(end - start)),
                                 function="prefill" if prefill else "decode",
                                 ms=round(1000 * (time.perf_counter() - t0), 3))
        return out

    def _step(self, run: "_Run") -> bool:
        """One pass (plus, in the mixed shape, a T=1 redo when the guard fires). Returns False
        when generation ends."""
        p = len(self.kv_tokens)
        if p >= self.pipeline.max_seq:
            run.finish = "context"
            return False
        if run.should_stop():
            run.finish = "cancelled"
            return False
        if run.deadline is not None and time.monotonic() >= run.deadline:
            run.finish, run.time_limited = "length", True
            return False
        run.check_grammar_cost()
        t0 = time.perf_counter()
        room = min(MAX_DRAFT, self.pipeline.max_seq - p - 1, run.remaining())
        run.source, run.q, run.draft_passes, run.draft_seconds = "none", None, 0, 0.0
        drafts = run.drafts(room) if run.options.speculative and room > 0 else []
        block = [run.pending, *drafts]
        verifying = getattr(self.drafter, "verifying", None)
        if verifying is not None and drafts and run.options.speculative:
            verifying(block)  # a draft model in its own process looks past the block meanwhile
        out = self.pipeline.run(block, p, self.state)
        verdict = run.verify(drafts, out)
        backend = out.backend_seconds
        if verdict.next_token is None:  # the guard: redo row r at T=1, as plain decoding would
            r = verdict.guard_row
            redo = self.pipeline.run([block[r]], p + r, self.state)
            backend += redo.backend_seconds
            run.stats.guard_interventions += 1
            run.stats.record_pass(len(drafts), r, r)
            run.stats.record_pass(0, 0, 1)
            token = run.chooser.argmax(redo, 0)
            run.chooser.advance(token)
            verdict = Verdict(r, token, guard_row=r)
            run.record_logprobs(drafts[:r], out, redo_row=(redo, token))
        else:
            run.stats.record_pass(len(drafts), verdict.accepted, verdict.accepted + 1)
            run.record_logprobs([*drafts[:verdict.accepted], verdict.next_token], out)
        run.stats.record_source(run.source, len(drafts), verdict.accepted, run.draft_passes,
                                run.draft_seconds)
        self.kv_tokens.extend(block[:verdict.accepted + 1])
        run.stats.backend_seconds += backend
        run.stats.host_seconds += time.perf_counter() - t0 - backend
        if self.trace is not None:
            self.trace.write(position=p, T=len(block), width=self.pipeline.shape.pass_width(len(block)),
                             drafts=drafts, source=run.source, draft_passes=run.draft_passes,
                             accepted=verdict.accepted,
                             next=verdict.next_token, guard_row=verdict.guard_row,
                             backend_ms=round(1000 * backend, 3),
                             host_ms=round(1000 * (time.perf_counter() - t0 - backend), 3))
        for token in drafts[:verdict.accepted]:
            if not run.emit(token):
                return False
        run.pending = verdict.next_token
        return run.emit(verdict.next_token)


class _Run:
    """The mutable bits of one `generate` call."""

    def __init__(self, session: DecodeSession, options: GenerateOptions, on_text: OnText | None,
                 prompt: list[int], stats: RequestStats):
        self.session, self.options, self.on_text, self.stats = session, options, on_text, stats
        self.tokens: list[int] = []
        self.text: list[str] = []
        self.finish: FinishReason | None = None
        self.pending = -1
        self.detok = session.tokenizer.detokenizer(skip_special=not options.special_text)
        self.stops = StopMatcher(options.stop)
        self.rng = np.random.default_rng(options.sampling.seed)
        self.guard = (session.guard_margin if options.guard and options.sampling.greedy
                      else None)
        self.chooser = RowChooser(
            options.sampling, eog_ids=session.eog, history=prompt,
            grammar=None if options.grammar is None else options.grammar.start())
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] | None = (
            None if options.logprobs is None else [])
        self.should_stop: Callable[[], bool] = lambda: False
        self.deadline: float | None = None
        self.time_limited = False
        self.indent = _IndentLimit(options.n_indent)
        self.grammar_costs: list[tuple[int, float]] = []  # (tokens, grammar CPU s) per pass
        # The current pass's drafts: which source drafted them, a draft model's q (sampling),
        # and the draft model's passes and seconds spent on them.
        self.source = "none"
        self.q: list[np.ndarray] | None = None
        self.draft_passes, self.draft_seconds = 0, 0.0

    def check_grammar_cost(self) -> None:
        """Raise GrammarTooCostly when the grammar's masks cost more than the budget per token,
        on average over the last GRAMMAR_WINDOW tokens (thread CPU time less garbage
        collections, work_clock.py: neither a loaded machine nor a large heap trips it). An
        ambiguous grammar's cost grows with every token (`e ::= e e | e e e | [a-z]`: 0.01 ms
        at first, 450 ms by token 275); a real one stays far below 1 ms."""
        budget, grammar = self.options.grammar_token_seconds, self.chooser.grammar
        if budget is None or grammar is None:
            return
        n, cost = len(self.tokens), grammar.cpu_seconds
        self.grammar_costs.append((n, cost))
        then = next(((k, c) for k, c in reversed(self.grammar_costs) if k <= n - GRAMMAR_WINDOW),
                    None)
        if then is None:
            return
        per_token = (cost - then[1]) / (n - then[0])
        if per_token > budget:
            raise GrammarTooCostly(
                f"the grammar's token masks cost {1000 * per_token:.1f} ms per token over the "
                f"last {n - then[0]} tokens (by token {n}), more than this server's budget of "
                f"{1000 * budget:g} ms (--grammar-token-ms): the grammar is too ambiguous "
                "(its cost grows with every token); simplify it")

    def remaining(self) -> int:
        return self.options.max_tokens - len(self.tokens)

    def first_token(self, out: BlockOutput) -> int:
        last = out.rows - 1
        if self.options.sampling.greedy:
            token = self.chooser.argmax(out, last)
        else:
            token = sample(self.chooser.distribution(out, last), self.rng)
        self.chooser.advance(token)
        self.record_logprobs([token], out, first_row=last)
        return token

    def drafts(self, room: int) -> list[int]:
        """What the grammar forces next when it forces anything (accepted for certain: the
        masked row is a point mass), else the drafter's guesses."""
        grammar = self.chooser.grammar
        forced = grammar.forced_tokens() if grammar is not None else []
        if forced:
            self.source = "grammar"
            return forced[:room]
        drafter = self.session.drafter
        propose = getattr(drafter, "propose", None)
        if propose is None:  # a plain drafter: deterministic guesses
            drafts = drafter.draft(room, fill=self.session.fill_drafts)[:room]
            self.source = "ngram" if drafts else "none"
            return drafts
        proposal = propose(room, fill=self.session.fill_drafts)
        drafts = proposal.tokens[:room]
        self.source = proposal.source if drafts else "none"
        self.q = proposal.q[:len(drafts)] if proposal.q is not None and drafts else None
        self.draft_passes, self.draft_seconds = proposal.passes, proposal.seconds
        return drafts

    def verify(self, drafts: list[int], out: BlockOutput) -> Verdict:
        if self.options.sampling.greedy:
            # A T=1 pass is exactly what plain decoding runs: nothing for the guard to judge.
            return verify_greedy(drafts, out, self.guard if drafts else None, self.chooser)
        return verify_sampled(drafts, out, self.options.sampling, self.rng, self.chooser,
                              q=self.q if drafts else None)

    def record_logprobs(self, tokens: list[int], out: BlockOutput, *, first_row: int = 0,
                        redo_row: tuple[BlockOutput, int] | None = None) -> None:
        """Log-probabilities of the tokens a pass committed: token k came from row first_row+k
        (and a guard redo's token from its own T=1 row)."""
        if self.logprobs is None:
            return
        n = self.options.logprobs or 0
        for k, token in enumerate(tokens):
            self.logprobs.append(token_logprobs(out.row_logits(first_row + k), token, n))
        if redo_row is not None:
            redo, token = redo_row
            self.logprobs.append(token_logprobs(redo.row_logits(0), token, n))

    def emit(self, token: int) -> bool:
        """Commit one generated token to the output; False when generation must end."""
        if token in self.session.eog:
            self.finish = "stop"
            return False
        self.tokens.append(token)
        self.session.drafter.append([token])
        piece = self.indent.push(self.stops.push(self.detok.push(token)))
        if piece:
            self.text.append(piece)
            if self.on_text is not None and self.on_text(piece) is False:
                self.finish = "cancelled"
                return False
        if self.stops.stopped:
            self.finish = "stop"
            return False
        if self.indent.stopped:  # llama-server: STOP_TYPE_LIMIT
            self.finish = "length"
            return False
        if self.remaining() <= 0:
            self.finish = "length"
            return False
        return True

    def result(self) -> GenerationResult:
        if not self.stops.stopped and not self.indent.stopped and self.finish != "cancelled":
            tail = self.indent.push(self.stops.push(self.detok.flush()) + self.stops.flush())
            if tail:
                self.text.append(tail)
                if self.on_text is not None:
                    self.on_text(tail)
        self.stats.generated_tokens = len(self.tokens)
        grammar = self.chooser.grammar
        return GenerationResult(
            self.stats.prompt_tokens, self.tokens, "".join(self.text), self.finish or "length",
            self.stats, None if self.logprobs is None else self.logprobs[:len(self.tokens)],
            None if grammar is None else grammar.accepting, self.stops.word, self.time_limited)


class _IndentLimit:
    """llama-server's n_indent (server-context.cpp): once a line has ended, a line that starts
    with fewer than `n` spaces or tabs ends the output where its indentation ends (an empty line
    too). Checked on the text as it is shown, so nothing past the cut is ever streamed."""

    def __init__(self, n: int):
        self.n, self.stopped = n, False
        self.at_line_start, self.indent = False, 0

    def push(self, text: str) -> str:
        if self.n <= 0 or self.stopped:
            return "" if self.stopped else text
        for i, ch in enumerate(text):
            if self.at_line_start:
                if ch in " \t":
                    self.indent += 1
                    continue
                if self.indent < self.n:
                    self.stopped = True
                    return text[:i]
                self.at_line_start = False
            if ch == "\n":
                self.at_line_start, self.indent = True, 0
        return text
