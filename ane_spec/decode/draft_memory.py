"""`DraftMemory`: a bounded n-gram index of earlier requests, for cross-request drafting.

Agents re-read tool output, edit loops re-send the same file, chats quote turns that fell out of
their window: text an earlier request saw or wrote comes back in a later request whose own prompt
no longer holds it. An `NgramDrafter` given a memory also looks there (its docstring says how it
weighs the two sources); the memory keeps each finished request's tokens (prompt + output).

Bounds. `max_tokens` caps the tokens held. When an addition goes over it, the oldest requests go
first, down to three quarters of the cap, and the index is rebuilt over what is left: a rebuild
costs O(cap * ngram_max) dict updates, once per cap/4 tokens added, so adding stays amortised
O(ngram_max) per token and a lookup never pays for eviction.

Deduplication. A chat's next prompt repeats the whole previous exchange; storing it again would
fill the memory with copies. A history is cut into 32-token chunks from its start, each named by
a hash chained over every chunk before it (vLLM's prefix-caching block hash): the leading chunks
whose chained hash the memory already holds are skipped, so a conversation costs about its length
once, not once per turn.

Token layout: `tokens` holds the requests back to back, each followed by SEPARATOR (-1, never a
token id), so a copy or a followed match stops at a request's end; n-grams never span two
requests.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ane_spec.decode.ngram_index import Index, add_successor, new_index, probe
from ane_spec.errors import AneSpecError

__all__ = ["DEFAULT_MEMORY_TOKENS", "DraftMemory", "SEPARATOR"]

SEPARATOR = -1
CHUNK = 32
DEFAULT_MEMORY_TOKENS = 65536
# Eviction goes below the cap, so the O(cap) rebuild happens once per cap/4 added tokens.
_LOW_WATER = 0.75


class DraftMemory:
    """Earlier requests' tokens, indexed for `NgramDrafter`; the oldest requests go first.

    One memory may serve many drafters (the daemon keeps one per privacy scope); it changes only
    in `add`, between requests, and `version` counts those changes that move positions so a
    drafter can drop a pointer into the old layout.
    """

    def __init__(self, max_tokens: int = DEFAULT_MEMORY_TOKENS, *, ngram_max: int = 4) -> None:
        for name, value, low in (("max_tokens", max_tokens, 1), ("ngram_max", ngram_max, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise AneSpecError(f"DraftMemory: {name} must be an integer >= {low}, "
                                   f"got {value!r}")
        self.max_tokens = max_tokens
        self.ngram_max = ngram_max
        self.version = 0
        self._entries: deque[tuple[list[int], list[int]]] = deque()  # (tokens, chunk hashes)
        self._known: dict[int, int] = {}  # chained chunk hash -> entries registering it
        self._size = 0
        self._rebuild()

    def __repr__(self) -> str:
        return (f"DraftMemory(max_tokens={self.max_tokens}, ngram_max={self.ngram_max}, "
                f"size={self._size}, requests={len(self._entries)})")

    @property
    def size(self) -> int:
        """Tokens held (separators not counted)."""
        return self._size

    @property
    def requests(self) -> int:
        return len(self._entries)

    @property
    def index(self) -> Index:
        return self._index

    def add(self, history: Sequence[int]) -> int:
        """Remember one finished request's tokens; returns how many were stored (the part not
        already held as a prefix of an earlier request, at most `max_tokens`)."""
        hist = [int(t) for t in history]
        hashes, skip, h = [], 0, 0
        for start in range(0, len(hist) - CHUNK + 1, CHUNK):
            h = hash((h, tuple(hist[start:start + CHUNK])))
            if skip == start and h in self._known:
                skip = start + CHUNK
            else:
                hashes.append(h)
        new = hist[skip:]
        if not new:
            return 0
        if len(new) > self.max_tokens:  # one request larger than the whole memory: its end
            new, hashes = new[-self.max_tokens:], []
        for h in hashes:
            self._known[h] = self._known.get(h, 0) + 1
        self._entries.append((new, hashes))
        self._size += len(new)
        if self._size > self.max_tokens:
            self._evict(int(self.max_tokens * _LOW_WATER))
            self._rebuild()
        else:
            self._index_entry(new)
        return len(new)

    def clear(self) -> None:
        self._entries.clear()
        self._known.clear()
        self._size = 0
        self._rebuild()

    def lookup(self, keys: Sequence[int], lo: int, top: int) -> tuple[int, object] | None:
        """The longest indexed suffix, as `ngram_index.probe` (n capped at ngram_max)."""
        return probe(self._index, keys, lo, min(top, self.ngram_max))

    # -- internals -------------------------------------------------------------------------------

    def _evict(self, target: int) -> None:
        """Drop the oldest requests until at most `target` tokens remain (the newest one stays,
        cut to its end if it alone is over)."""
        while self._size > target and len(self._entries) > 1:
            tokens, hashes = self._entries.popleft()
            self._size -= len(tokens)
            for h in hashes:
                left = self._known[h] - 1
                if left:
                    self._known[h] = left
                else:
                    del self._known[h]

    def _rebuild(self) -> None:
        self.version += 1
        self.tokens: list[int] = []
        self._index = new_index(self.ngram_max)
        for tokens, _ in self._entries:
            self._index_entry(tokens)

    def _index_entry(self, entry: list[int]) -> None:
        toks, index, nmax = self.tokens, self._index, self.ngram_max
        first = len(toks)
        toks.extend(entry)
        toks.append(SEPARATOR)
        for last in range(first, first + len(entry) - 1):
            add_successor(toks, index, min(nmax, last - first + 1), last, toks[last + 1])
