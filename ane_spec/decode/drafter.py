"""Model-free n-gram drafter over prompt + committed output, with an incremental index.

`NgramDrafter` proposes up to k tokens continuing the history (prompt + committed output) by
matching its suffix against earlier text. Rules, in order (defaults: ngram_min=1, ngram_max=4,
prefer="recent", earliest_from=3, follow=True, resync=16, chain=True):

1. Follow. If the tokens committed since the last draft agree with where that draft was copied
   from, keep copying from there: the match is as long as the agreement (often far beyond
   ngram_max), so it wins unless the index finds a longer one.
2. Otherwise the longest suffix of the history, n = ngram_max down to ngram_min, that occurred
   before with a successor. Which occurrence continues it:
   a. resync: after a copy broke (an edit, an insertion), the first occurrence ending within
      `resync` tokens after the break, where the copied text most likely resumes;
   b. n >= earliest_from: the earliest occurrence. A long match is a copy, and its first
      occurrence is the original (the prompt) rather than a later re-copy in the output;
   c. else `prefer`: "recent" copies after the most recent occurrence; "frequent" takes the
      successor seen most often (ties: the most recent), one token per lookup; "earliest" is
      vLLM's rule.
   A copy runs for up to k tokens; when it reaches the end of the history, `chain` looks up
   again on history + draft (chain=False stops there).
3. fill=True only: still short of k, back off to matches of any length >= 1 continued with their
   most frequent successor, then to the history's most frequent token, so exactly k tokens come
   back whenever the history is non-empty. fill=False drafts only tokens backed by a match of
   length >= ngram_min (of history + draft) and may return [].

Index and cost. For n = 1..ngram_max a dict maps each n-gram to the positions ending its
occurrences, its most frequent successor and the successor counts; keys are exact ints (32
bits per token) built in O(1) per length. `append` does O(ngram_max) dict updates per
token; a lookup tries the longest n, then binary-searches n (matches are nested), so it costs
O(log ngram_max) dict probes plus O(ngram_max) key building; `draft` does one lookup for a copy
(one per token for "frequent"), a bisect for resync and a k-token slice: it never scans the
history. scripts/bench_drafter.py times it (draft(3) and one decoding step, against a
rescanning vLLM-style baseline) and prints the figures.

How the defaults were chosen: scripts/bench_drafter.py replays greedy T=4 verification (k=3) on
the built-in streams and prints tokens per pass per family for the defaults, each rule removed,
prefer="frequent", and vLLM's rule (ane_spec.bench.drafter_bench). Those streams are stdlib text
with constructed outputs (ane_spec.bench.streams), not a model's: they rank drafters on kinds of
overlap and do not predict a model's acceptance. The choice that matters is the occurrence a
long match copies: the most recent occurrence is often the output's own earlier re-copy, which
is why a long match takes the earliest (rule 2b) and a copy in progress is followed (rule 1).
"recent" vs "frequent" was within noise there; "recent" costs one lookup per draft instead of
one per token.

Across requests (`memory=DraftMemory(...)`, ane_spec.decode.draft_memory). The memory holds
earlier requests' prompts and outputs; `reset` (and `finish`) add the request that ends, and
never clear it. Each draft asks both sources: this request by the rules above, the memory by
its own followed copy (rule 1, over its tokens) or else the most recent occurrence of the
longest indexed suffix (the latest version of a file that keeps being edited), never copying
across the end of a request. The memory's draft replaces this request's when (memory_rule):
"longest" (default) its match is longer, a followed copy counting its whole agreement, ties
staying with this request; "longest-frequent" the same, ties going to the continuation seen
more often in its source; "frequent" the better-supported continuation first, then the longer
match; "local-first" only when this request has no draft at all.

The memory rule was chosen with the same replay over eight families (code, code-edit, quote,
structured, chat, and the session families of ane_spec.bench.session_streams), each family's
streams replayed in order through one drafter; the bench prints the table for every rule, next
to SuffixDecoding (bench/suffix_baseline.py) and vLLM's rule. Those streams repeat across
requests by construction (the session families by design, the others because they draw on a
small set of stdlib modules), and the rule was chosen on them: "longest" came out ahead there,
because an equal-length match in this request is the fresher evidence and a frequent short
continuation from the memory must not override a long copy in progress. How much real traffic
repeats across requests, and so what the memory gains there, is not measured.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Protocol, Sequence, runtime_checkable

from ane_spec.decode.draft_memory import SEPARATOR, DraftMemory
from ane_spec.decode.ngram_index import (
    BEST, ENDS, MAX_TOKEN, SHIFT, add_successor, as_plain, new_index, occurrences, probe,
    successor_count,
)
from ane_spec.errors import AneSpecError

__all__ = ["Drafter", "DraftMemory", "MEMORY_RULES", "NgramDrafter", "PREFER_CHOICES"]

#: Occurrence rules for `NgramDrafter(prefer=...)`.
PREFER_CHOICES = ("recent", "frequent", "earliest")
#: How `NgramDrafter(memory_rule=...)` picks between this request and the memory.
MEMORY_RULES = ("longest", "longest-frequent", "frequent", "local-first")


@runtime_checkable
class Drafter(Protocol):
    """What the speculative decoder asks of a drafter.

    `reset` starts a request from its prompt tokens; `append` adds committed tokens only (never a
    rejected draft), in order; `draft(k)` proposes up to `k` next tokens. With `fill=True` the
    caller has found that unused verification slots are free and wants `k` tokens even from weak
    evidence; with `fill=False` only tokens the drafter stands behind.
    """

    def reset(self, prompt_tokens: Sequence[int]) -> None: ...

    def append(self, tokens: Sequence[int]) -> None: ...

    def draft(self, k: int, *, fill: bool = False) -> list[int]: ...


def _check_int(name: str, value: object, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AneSpecError(f"NgramDrafter: {name} must be an integer, got {value!r}")
    if value < low:
        raise AneSpecError(f"NgramDrafter: {name} must be >= {low}, got {value}")


_ATTACHED = object()  # finish(): into the attached memory


class NgramDrafter:
    """Longest-suffix n-gram drafter; the module docstring gives the rules and measurements.

    Settings (keyword-only):

    * ``ngram_min``, ``ngram_max``: match lengths tried, longest first. ``fill=False`` drafts
      only tokens backed by a match of length >= ngram_min.
    * ``prefer``: which occurrence a match of length < ``earliest_from`` continues:
      ``"recent"`` (the most recent occurrence), ``"frequent"`` (the successor seen most often,
      one token per lookup) or ``"earliest"`` (the first occurrence, vLLM's rule).
    * ``earliest_from``: matches at least this long continue their earliest occurrence (the
      original a copy is taken from) whatever ``prefer`` says; None disables the rule.
    * ``follow``: once a drafted copy is being accepted, keep copying from the same place while
      the committed tokens agree with it (the match is then longer than ngram_max).
    * ``resync``: when a followed copy breaks (an edit, an insertion), the next match first looks
      for an occurrence ending within ``resync`` tokens after the break; None disables it.
    * ``chain``: when a copied continuation reaches the end of the history, look up again on
      history + draft instead of stopping.
    * ``memory``: a `DraftMemory` of earlier requests (None: this request only). `reset` and
      `finish` add the request that ends to it; the attribute may be swapped between requests.
    * ``memory_rule``: how a draft picks between this request and the memory, by the evidence
      behind each one's first token (see MEMORY_RULES and the module docstring).
    """

    def __init__(self, *, ngram_min: int = 1, ngram_max: int = 4, prefer: str = "recent",
                 earliest_from: int | None = 3, follow: bool = True, resync: int | None = 16,
                 chain: bool = True, memory: DraftMemory | None = None,
                 memory_rule: str = "longest") -> None:
        _check_int("ngram_min", ngram_min, 1)
        _check_int("ngram_max", ngram_max, 1)
        if ngram_max < ngram_min:
            raise AneSpecError(
                f"NgramDrafter: ngram_max ({ngram_max}) must be >= ngram_min ({ngram_min})")
        if prefer not in PREFER_CHOICES:
            raise AneSpecError(
                f"NgramDrafter: prefer must be one of {', '.join(PREFER_CHOICES)}, got {prefer!r}")
        if memory_rule not in MEMORY_RULES:
            raise AneSpecError(f"NgramDrafter: memory_rule must be one of "
                               f"{', '.join(MEMORY_RULES)}, got {memory_rule!r}")
        if memory is not None and not isinstance(memory, DraftMemory):
            raise AneSpecError(f"NgramDrafter: memory must be a DraftMemory, got {memory!r}")
        if earliest_from is not None:
            _check_int("earliest_from", earliest_from, 1)
        if resync is not None:
            _check_int("resync", resync, 0)
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.prefer = prefer
        # A threshold above ngram_max never applies: normalise so the hot path compares once.
        self.earliest_from = earliest_from
        self._earliest_from = ngram_max + 1 if earliest_from is None else earliest_from
        self.follow = bool(follow)
        self.resync = resync
        self.chain = bool(chain)
        self.memory = memory
        self.memory_rule = memory_rule
        self.evidence = 0  # see `draft`
        self._start(())

    def __repr__(self) -> str:
        mem = "" if self.memory is None else f", memory={self.memory!r}, " \
                                              f"memory_rule={self.memory_rule!r}"
        return (f"NgramDrafter(ngram_min={self.ngram_min}, ngram_max={self.ngram_max}, "
                f"prefer={self.prefer!r}, earliest_from={self.earliest_from}, "
                f"follow={self.follow}, resync={self.resync}, chain={self.chain}{mem})")

    # -- history and index -----------------------------------------------------------------------

    @property
    def history(self) -> list[int]:
        """A copy of the tokens the index covers (prompt + committed output)."""
        return list(self._hist)

    def reset(self, prompt_tokens: Sequence[int]) -> None:
        """Start a request from its prompt. The request before it, if any, goes into the
        memory first (`finish`): the memory is never forgotten."""
        self.finish()
        self._start(prompt_tokens)

    def finish(self, into: DraftMemory | None = _ATTACHED) -> None:  # type: ignore[assignment]
        """End the request: its tokens (prompt + committed output) go into `into` (default: the
        attached memory; None: nowhere) and the history is cleared."""
        target = self.memory if into is _ATTACHED else into
        if target is not None and self._hist:
            target.add(self._hist)
        if self._hist:
            self._start(())

    def _start(self, prompt_tokens: Sequence[int]) -> None:
        self._hist: list[int] = []
        # _index[n] maps an n-gram key to its entry (ane_spec.decode.ngram_index); _index[0] is
        # unused. Grams of every length 1..ngram_max are indexed so that fill can back off below
        # ngram_min.
        self._index = new_index(self.ngram_max)
        # Unigram counts for the last-resort fill token: the history's most frequent token
        # (ties: the one that reached the count last).
        self._unigram: dict[int, int] = {}
        self._top_token: int | None = None
        self._top_count = 0
        # The copy being followed: the next committed token is predicted to be hist[_src], and
        # the _src_len tokens before _src equal the history's suffix. None when not following.
        self._src: int | None = None
        self._src_len = 0
        # Where the last copy (followed, or just drafted) broke off: the position whose token
        # the committed output did not repeat. Resync looks just after it. None before any.
        self._anchor: int | None = None
        # The occurrence the last draft copied from, stamped with the history length it was
        # drafted at: (length, src, match length). `append` follows it if the committed tokens
        # agree with it.
        self._pending: tuple[int, int, int] | None = None
        # The same three for the memory, in its `tokens`, valid while its version is _mversion.
        self._msrc: int | None = None
        self._mlen = 0
        self._mpending: tuple[int, int, int] | None = None
        self._mversion = -1
        self.append(prompt_tokens)

    def append(self, tokens: Sequence[int]) -> None:
        """Add committed tokens: O(ngram_max) index updates per token."""
        hist = self._hist
        index = self._index
        nmax = self.ngram_max
        unigram = self._unigram
        src, src_len = self._src, self._src_len
        tokens = [int(t) for t in tokens]
        if tokens and not (0 <= min(tokens) and max(tokens) < MAX_TOKEN):
            bad = next(t for t in tokens if not 0 <= t < MAX_TOKEN)
            raise AneSpecError(f"NgramDrafter: token ids must be in [0, 2**32), got {bad}")
        pending = self._pending
        if pending is not None and tokens:
            if src is None and pending[0] == len(hist):
                src, src_len = pending[1], pending[2]
            self._pending = None
        memory = self.memory
        msrc = None
        if memory is not None and tokens:
            msrc, mlen = self._memory_follow(memory, len(hist))
            mtoks = memory.tokens
        for tok in tokens:
            if src is not None:
                if hist[src] == tok:  # src < len(hist): it advances only as the history grows
                    src += 1
                    src_len += 1
                else:
                    self._anchor = src
                    src = None
            if msrc is not None:
                if mtoks[msrc] == tok:  # every request in the memory ends in a separator
                    msrc += 1
                    mlen += 1
                else:
                    msrc = None
            last = len(hist) - 1  # the position whose successor `tok` becomes
            if last >= 0:
                add_successor(hist, index, min(nmax, last + 1), last, tok)
            hist.append(tok)
            c = unigram.get(tok, 0) + 1
            unigram[tok] = c
            if c >= self._top_count:
                self._top_token = tok
                self._top_count = c
        self._src, self._src_len = src, src_len
        if memory is not None and tokens:
            self._msrc, self._mlen = msrc, mlen

    def _memory_follow(self, memory: DraftMemory, length: int) -> tuple[int | None, int]:
        """The memory copy to follow through the tokens about to be appended at `length`."""
        if self._mversion != memory.version:  # the memory was rebuilt: old positions are gone
            self._msrc, self._mpending, self._mversion = None, None, memory.version
        msrc, mlen = self._msrc, self._mlen
        pending = self._mpending
        if pending is not None:
            if msrc is None and pending[0] == length:
                msrc, mlen = pending[1], pending[2]
            self._mpending = None
        return msrc, mlen

    def index_state(self) -> dict[int, dict[tuple[int, ...], tuple]]:
        """The index as plain data, for tests and debugging (O(index size)).

        {n: {gram: (ends, best_token, best_count, {successor: count})}}.
        """
        return as_plain(self._index, self._hist, self.ngram_max)

    # -- drafting --------------------------------------------------------------------------------

    def _keys(self, draft: list[int], top: int) -> list[int]:
        """keys[n]: the key of the last n tokens of history + draft, n = 0..top."""
        hist = self._hist
        keys = [0]
        key = draft[-1] if draft else hist[-1]
        keys.append(key)
        base = len(hist) + len(draft)  # virtual position of the token after the suffix
        for n in range(2, top + 1):
            j = base - n
            key |= (draft[j - len(hist)] if j >= len(hist) else hist[j]) << (SHIFT * (n - 1))
            keys.append(key)
        return keys

    def _lookup(self, draft: list[int], lo: int) -> tuple[int, object] | None:
        """The longest n in [lo, ngram_max] whose suffix of history + draft is indexed."""
        top = min(self.ngram_max, len(self._hist) + len(draft))
        if top < lo:
            return None
        return probe(self._index, self._keys(draft, top), lo, top)

    def _extend(self, draft: list[int], k: int, lo: int, weak: bool = False
                ) -> tuple[int, int, int] | None:
        """Extend `draft` in place towards k tokens from matches of length >= lo.

        weak=True (fill's back-off): every match continues with its most frequent successor.

        Returns the occurrence the first new token came from as a pending follow pointer
        (history length, src, match length), or None. `self._evidence` becomes the match
        length behind the first new token (0: none).
        """
        hist = self._hist
        end = len(hist)
        pending = None
        self._evidence = 0
        if not draft and self.follow:
            src = self._src
            if src is not None and self._src_len >= lo:
                found = self._lookup(draft, lo) if self._src_len < self.ngram_max else None
                if found is None or found[0] <= self._src_len:
                    draft.extend(hist[src:src + k])
                    self._evidence = self._src_len
                    if not self.chain:
                        return None
        while len(draft) < k:
            found = self._lookup(draft, lo)
            if found is None:
                break
            n, entry = found
            if entry.__class__ is int:
                ends, best = [entry], hist[entry + 1]
            else:
                ends, best = entry[ENDS], entry[BEST]
            e = None  # the occurrence end to copy after; None: the most frequent successor
            first = not draft
            if first:
                self._evidence = n
            if not weak:
                if first and self._anchor is not None and self.resync is not None:
                    i = bisect_left(ends, self._anchor)
                    if i < len(ends) and ends[i] <= self._anchor + self.resync:
                        e = ends[i]
                if e is None:
                    if n >= self._earliest_from or self.prefer == "earliest":
                        e = ends[0]
                    elif self.prefer == "recent":
                        e = ends[-1]
            if e is None:
                draft.append(best)
                if first:
                    pending = (end, ends[-1] + 1, n)
                continue
            if first:
                pending = (end, e + 1, n)
            draft.extend(hist[e + 1:min(end, e + 1 + k - len(draft))])
            if not self.chain:
                break
        return pending

    def _from_memory(self, memory: DraftMemory, k: int, lo: int) -> tuple[list[int], int]:
        """The memory's proposal for the next k tokens and the match length behind it:
        the followed copy, or the most recent occurrence of the longest indexed suffix."""
        if self._mversion != memory.version:
            self._msrc, self._mpending, self._mversion = None, None, memory.version
        toks = memory.tokens
        src, n = self._msrc, self._mlen
        if src is None or n < memory.ngram_max:
            top = min(self.ngram_max, memory.ngram_max, len(self._hist))
            found = memory.lookup(self._keys([], top), lo, top) if top >= lo else None
            if found is not None and (src is None or found[0] > n):
                n, entry = found
                src = occurrences(entry)[-1] + 1
                self._mpending = (len(self._hist), src, n)
        if src is None or n < lo:
            return [], 0
        out = toks[src:src + k]
        if SEPARATOR in out:
            out = out[:out.index(SEPARATOR)]
        return out, n

    def _support(self, source: object, tokens: list[int], n: int) -> int:
        """How often the last n (<= the source's ngram_max) tokens of the history were followed
        by tokens[0] in `source` (this request's index, or a DraftMemory)."""
        if isinstance(source, DraftMemory):
            top, hist = min(n, source.ngram_max, self.ngram_max), source.tokens
            found = source.lookup(self._keys([], top), top, top)
        else:
            top, hist = min(n, self.ngram_max), self._hist
            found = probe(self._index, self._keys([], top), top, top)
        return 0 if found is None else successor_count(found[1], hist, tokens[0])

    def _memory_wins(self, memory: DraftMemory, local: list[int], local_n: int,
                     recalled: list[int], recalled_n: int) -> bool:
        """Whether the memory's proposal replaces this request's (module docstring)."""
        if not recalled:
            return False
        if not local:
            return True
        rule = self.memory_rule
        if rule == "local-first":
            return False
        if rule != "frequent" and recalled_n != local_n:
            return recalled_n > local_n
        if rule == "longest":
            return False
        mine = self._support(self._index, local, local_n)
        theirs = self._support(memory, recalled, recalled_n)
        return theirs > mine or (rule == "frequent" and theirs == mine
                                 and recalled_n > local_n)

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        """Up to k tokens continuing the history; deterministic, never rescans the history.

        fill=False: only tokens backed by a match of length >= ngram_min (possibly none).
        fill=True: exactly k tokens whenever the history is non-empty, completed with matches
        down to length 1 and then the history's most frequent token.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise AneSpecError(f"draft: k must be a non-negative integer, got {k!r}")
        out: list[int] = []
        self.evidence = 0
        if k == 0 or not self._hist:
            return out
        pending = self._extend(out, k, self.ngram_min)
        evidence = self._evidence
        memory = self.memory
        if memory is not None and memory.size:
            recalled, recalled_n = self._from_memory(memory, k, self.ngram_min)
            if self._memory_wins(memory, out, self._evidence, recalled, recalled_n):
                out = recalled
                evidence = recalled_n
                if len(out) < k and self.chain:
                    self._extend(out, k, self.ngram_min)
        # The match length behind the first token the rules (not fill's guesses) drafted: a
        # followed copy counts its whole agreement. Model-drafter policy reads it.
        self.evidence = evidence if out else 0
        if fill:
            while len(out) < k:
                p = self._extend(out, k, 1, weak=True)
                if pending is None:
                    pending = p
                if len(out) < k:
                    # The last token (of history or draft) was never followed by anything: guess
                    # the history's most frequent token, then look again from there.
                    out.append(self._top_token)  # type: ignore[arg-type]
        if pending is not None:
            self._pending = pending
        return out
