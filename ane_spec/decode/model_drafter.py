"""A draft model beside the target: a smaller model of the same family proposes the next tokens.

The draft keeps its own KV slots, append-only like the target's. `seq` is the sequence the draft
believes in: the committed history (prompt + output) followed by its own proposals; the first
`written` tokens of it have their K/V in the draft's slots. After the target's verify pass the
committed history agrees with `seq` up to the accepted drafts; everything past that point is
simply forgotten (`written` moves back) and overwritten by the next pass: a rejected draft is
hidden by the mask and never copied back. So the draft follows every committed token in the
passes it runs anyway, without re-prefilling:

- the prompt: in the draft build's prefill function where that pays (`prefill_plan.plan_chunks`,
  issue 33's P-row passes), else decode-shape passes;
- each step: one pass over the committed tokens it has not written yet (the correction or bonus
  token, and the last accepted draft when all were accepted: 1-2 tokens), whose last row gives
  draft 1, then one T=1 pass per further draft.

Where the target's bonus token equals the draft's own next proposal (all drafts accepted, and the
draft had already looked further: `predraft`), the proposals after it are still valid and are
handed out without a pass (llama.cpp's draft reuse).

Drafting stops early only between passes, below `p_min` of the draft's own probability that
everything drafted so far is accepted: in the fixed-shape verify a shorter draft costs the
target nothing less, so a token whose pass was paid is always offered (decode/draft_policy.py
chooses p_min from measured costs).

Sampling: each draft is drawn from the draft's own distribution q (its logits through the
request's temperature, top-k, top-p and min-p), and q travels with it so that verification can
accept with min(1, p/q) (`sampling.accept_draft_q`). Greedy decoding drafts the argmax and sends
no q.

Where the draft runs is the `DraftModel`'s business (`PipelineDraftModel`: a built pipeline on any
backend; decode/draft_process.py: in its own process, so it overlaps the target's pass).

An MTP head (a GGUF's `nextn` layers, Gemma 4's assistant) fits the same interface: a
`DraftModel` whose `run` also takes the target's last hidden state for the rows it extends; the
README's "model drafter" section says what that needs from the target's build.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ane_spec.decode.sampling import SamplingParams, target_distribution
from ane_spec.decode.session import common_prefix
from ane_spec.errors import AneSpecError


# A prompt continues a draft state's conversation when it shares all but this many of its
# tokens (the target's slots use the same figure: daemon/slots.MIN_SHARED).
CONTINUES_WITHIN = 16


class DraftModel(Protocol):
    """What the drafter needs of a model: K/V slots and a last row of logits."""

    vocab_size: int
    max_seq: int

    def new_state(self) -> Any: ...

    def can_resume(self, state: Any, n: int) -> bool:
        """Whether `state` can go on writing at position n with its first n positions kept."""

    def run(self, tokens: Sequence[int], position: int, state: Any) -> np.ndarray:
        """Write `tokens`' K/V at slots position..; the last token's logits [V] (float32)."""

    def passes(self) -> int:
        """Passes run so far (a counter, for the stats)."""


class PipelineDraftModel:
    """A built draft model on a backend: long spans through its prefill function where that
    pays, short ones in its own decode shape (T=1 passes in the mixed shape)."""

    def __init__(self, pipeline: Any, prefill: str | None = None):
        self.pipeline = pipeline
        self.prefill = prefill
        self.vocab_size = pipeline.config.vocab_size
        self.max_seq = pipeline.max_seq
        self._passes = 0

    def new_state(self) -> Any:
        return self.pipeline.new_state()

    def can_resume(self, state: Any, n: int) -> bool:
        return self.pipeline.can_resume(state, n)

    def run(self, tokens: Sequence[int], position: int, state: Any) -> np.ndarray:
        from ane_spec.decode.prefill_plan import plan_chunks

        p = self.pipeline
        end = position + len(tokens)
        out = None
        # A step's feed (1-2 committed tokens, or one draft) is a decode-shape pass whatever the
        # prefill mode: `--prefill on` means prompts, and a T=P pass for one token costs ~P rows.
        plan = (plan_chunks(p, position, end, self.prefill) if len(tokens) > p.max_t
                else [(position, end, False)])
        for a, b, prefill in plan:
            chunk = list(tokens[a - position:b - position])
            if prefill:
                out = p.run_prefill(chunk, a, state, head=b == end)
            else:
                out = p.run(chunk, a, state)
            self._passes += 1
        return out.row_logits(out.rows - 1)

    def passes(self) -> int:
        return self._passes


@dataclass
class Proposal:
    """A step's drafts. `q[i]`: the distribution tokens[i] was drawn from (sampling only)."""

    tokens: list[int]
    source: str = "none"  # "model", "ngram", "grammar" or "none"
    q: list[np.ndarray] | None = None
    passes: int = 0       # draft-model passes this proposal ran
    seconds: float = 0.0  # wall time spent drafting it


@dataclass
class _Conversation:
    """One resident draft state and the tokens its slots hold."""

    state: Any
    tokens: list[int] = field(default_factory=list)
    tick: int = 0


class DraftStates:
    """The draft's KV states for up to `n` conversations (the target's --kv-slots): a request
    continues on the one sharing the longest prefix with its prompt, else on the least recently
    used. Conversations the target spills or saves to disk are not carried: when one comes back,
    its draft state is recomputed (one prefill of the draft)."""

    def __init__(self, model: DraftModel, n: int = 1):
        if n < 1:
            raise AneSpecError(f"the draft needs at least one KV state, got {n}")
        self.model = model
        self.entries: list[_Conversation] = []
        self.n = n
        self._tick = 0

    def pick(self, prompt: Sequence[int]) -> _Conversation:
        """The state whose conversation the prompt continues (it covers all but a few of that
        state's tokens: the last reply may re-tokenize), else a new or the least recently used
        one, which keeps whatever prefix it shares with the prompt. Two chats that share only a
        system prompt so keep a state each instead of overwriting one another's."""
        self._tick += 1
        best, shared = None, -1
        for e in self.entries:
            k = common_prefix(e.tokens, prompt)
            if k > shared:
                best, shared = e, k
        if best is None or shared < len(best.tokens) - CONTINUES_WITHIN:
            if len(self.entries) < self.n:
                best = _Conversation(self.model.new_state())
                self.entries.append(best)
            else:
                best = min(self.entries, key=lambda e: e.tick)
        best.tick = self._tick
        return best


class ModelDrafter:
    """Drafts with a model (see the module docstring). Implements the `Drafter` protocol
    (reset / append / draft) plus `propose`, which also returns q and the passes it ran, and
    `predraft`, which looks past a block about to be verified.

    `limit_vocab`: the target's vocabulary size: a draft id at or past it is never proposed.
    """

    def __init__(self, model: DraftModel, *, states: int = 1, limit_vocab: int | None = None):
        self.model = model
        self.states = DraftStates(model, states)
        self.limit = min(model.vocab_size, limit_vocab or model.vocab_size)
        self.hist: list[int] = []
        self.conv: _Conversation | None = None
        self.seq: list[int] = []
        self.written = 0
        # Per position of `seq` past the history: (the draft's probability of the token, q).
        self.meta: dict[int, tuple[float, np.ndarray | None]] = {}
        self.blind = False  # a committed id the draft cannot embed: idle until the next reset
        self.sampling: SamplingParams | None = None
        self.rng: np.random.Generator | None = None

    # --- the Drafter protocol -------------------------------------------------------------------

    def reset(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None,
              seed: int | None = None) -> None:
        """Start a request: its prompt, and for sampling its parameters and a seed for the
        draft's own draws (a seeded request stays reproducible)."""
        self.finish()
        prompt = [int(t) for t in prompt_tokens]
        self.conv = self.states.pick(prompt)
        self.seq = list(self.conv.tokens)
        self.written = len(self.seq)
        self.meta = {}
        self.hist = []
        self.blind = False
        self.sampling = None if sampling is None or sampling.greedy else sampling
        self.rng = np.random.default_rng(None if seed is None else [seed, 0x5EED])
        self.append(prompt)

    def append(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        if any(not 0 <= t < self.model.vocab_size for t in tokens):
            self.blind = True  # a target id past the draft's vocabulary
        self.hist.extend(tokens)

    def finish(self, into: object = None) -> None:
        """End the request: its state keeps the tokens its slots hold for the next one."""
        if self.conv is not None:
            self.conv.tokens = self.seq[:self.written]
            self.conv = None

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        return self.propose(k).tokens

    # --- drafting -------------------------------------------------------------------------------

    def _sync(self) -> int:
        """Forget what the history contradicts; returns how many proposals past the history are
        still valid (the draft's own continuation of it)."""
        hist, seq = self.hist, self.seq
        n = len(hist)
        agree = common_prefix(seq, hist)
        extra = 0
        if agree == n:
            # Only this request's own proposals (they have a probability and, sampling, a q):
            # tokens a state kept from an earlier conversation past the prompt are not.
            while n + extra < len(seq) and n + extra in self.meta:
                extra += 1
        # The history, then the proposals still valid; K/V past the agreement are forgotten.
        self.seq = hist + seq[n:n + extra] if extra else list(hist)
        self.meta = {i: m for i, m in self.meta.items() if n <= i < n + extra}
        self.written = min(self.written, agree if agree < n else n + extra)
        if self.written and not self.model.can_resume(self.conv.state, self.written):
            self.written = 0  # a KV ring that no longer holds the window before that point
        return extra

    def _choose(self, logits: np.ndarray) -> tuple[int, float, np.ndarray | None]:
        if self.sampling is None:
            z = logits.astype(np.float64)
            token = int(z.argmax())
            return token, float(1.0 / np.exp(z - z[token]).sum()), None
        q = target_distribution(logits, self.sampling)
        token = int(self.rng.choice(len(q), p=q))
        return token, float(q[token]), q

    def _extend(self, passes: int, p_min: float = 0.0, prob: float = 1.0,
                stop_at: int | None = None) -> int:
        """Run up to `passes` passes extending `seq` by one proposal each, stopping before a
        pass once `prob`, the probability that every proposal past the history is accepted,
        is below p_min (or when `seq` reaches `stop_at` tokens). Returns the passes run."""
        ran = 0
        drafted = len(self.seq) > len(self.hist)
        state = self.conv.state
        while ran < passes:
            if stop_at is not None and len(self.seq) >= stop_at:
                break
            if drafted and prob < p_min:
                break
            if len(self.seq) >= self.model.max_seq:
                break
            if self.written >= len(self.seq):
                self.written = len(self.seq) - 1  # no stored logits: rerun the last token
                if self.written and not self.model.can_resume(state, self.written):
                    self.written = 0
            feed = self.seq[self.written:]
            logits = self.model.run(feed, self.written, state)
            self.written = len(self.seq)
            ran += 1
            token, p, q = self._choose(logits)
            if token >= self.limit:
                break
            self.meta[len(self.seq)] = (p, q)
            self.seq.append(token)
            prob *= p
            drafted = True
        return ran

    def propose(self, k: int, *, p_min: float = 0.0) -> Proposal:
        """Up to k drafts continuing the history; passes stop below p_min (see the module
        docstring)."""
        t0 = time.perf_counter()
        if self.blind or not self.hist or k <= 0 or self.conv is None:
            return Proposal([], "model")
        n = len(self.hist)
        ready = min(self._sync(), k)
        prob = 1.0
        for i in range(n, n + ready):
            prob *= self.meta[i][0]
        before = self.model.passes()
        self._extend(k - ready, p_min, prob)
        drafts = self.seq[n:n + k]
        q = None
        if self.sampling is not None:
            q = [self.meta[i][1] for i in range(n, n + len(drafts))]
        return Proposal(drafts, "model", q, self.model.passes() - before,
                        time.perf_counter() - t0)

    def prefill(self) -> int:
        """Write the history's K/V but its last token's (the first `propose` runs that one and
        reads draft 1 from it): the prompt, in the draft's prefill function where it pays.
        Returns the passes run."""
        if self.blind or self.conv is None or len(self.hist) < 2:
            return 0
        self._sync()
        end = len(self.hist) - 1
        if self.written >= end or end > self.model.max_seq:
            return 0
        before = self.model.passes()
        self.model.run(self.hist[self.written:end], self.written, self.conv.state)
        self.written = end
        return self.model.passes() - before

    def predraft(self, block: Sequence[int], passes: int) -> int:
        """While the target verifies `block` ([pending, drafts...] after the history minus its
        last token), look further assuming every draft is accepted: up to `passes` passes, the
        first guessing the target's bonus token. A later `propose` uses them where the target
        agrees (all accepted and the bonus guessed), and forgets them otherwise."""
        if self.blind or self.conv is None or not block or passes <= 0:
            return 0
        assumed = self.hist + [int(t) for t in block[1:]]
        if any(t >= self.model.vocab_size for t in assumed):
            return 0
        agree = common_prefix(self.seq, assumed)
        if agree < len(assumed):  # the block's drafts are not the draft's own (n-gram drafts)
            self.seq = assumed
            self.meta = {i: m for i, m in self.meta.items() if i < agree}
            self.written = min(self.written, agree)
        else:
            del self.seq[len(assumed):]
        return self._extend(passes, stop_at=len(assumed) + passes)
