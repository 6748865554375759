"""SentencePiece (`tokenizer.ggml.model = "llama"`) tokenization, as llama.cpp's `llm_tokenizer_spm`.

llama.cpp does not run SentencePiece's own algorithm (Unigram Viterbi or BPE by merge rank); it
runs a score-driven merge over the text's UTF-8 characters, with no pre-split into words:

* the symbols start as the text's characters (the caller has already escaped every space to
  U+2581 `▁` and prepended one when `add_space_prefix` asks for it);
* every adjacent pair whose concatenation is a token (any token: NORMAL, CONTROL, BYTE, ...) is a
  candidate bigram, scored by that token's `tokenizer.ggml.scores` entry;
* the best candidate (highest score, then leftmost) is merged, the stale candidates it makes are
  skipped, and the merged symbol forms new candidates with its neighbours, until none is left;
* each final symbol is its token, or, when it is not one (a lone character outside the
  vocabulary), one byte token per UTF-8 byte: `<0xXX>`, else the one-byte text
  (`llama_vocab::byte_to_token`).

Speed: llama.cpp merges over a whole text fragment at once. This does the same merges, but over
independent segments, cached: a merged symbol is always a token, so no symbol can ever span two
adjacent characters that are adjacent in no token of the vocabulary. Cutting the text at every
such pair gives segments (words, mostly: `▁the`) whose merges cannot interact, and merging each
on its own gives exactly the whole text's result (the queue's order within a segment is the
same, ties included, as positions shift uniformly).
"""

from __future__ import annotations

import heapq
from typing import Sequence

from ane_spec.errors import TokenizerError, untrusted

ESCAPED_SPACE = "\u2581"  # ▁, what llama.cpp's llama_escape_whitespace puts for " "
_CACHE_LIMIT = 1 << 16    # segments kept; the cache is dropped whole when it is full


def escape_whitespace(text: str) -> str:
    """llama.cpp `llama_escape_whitespace`: every " " (only U+0020) becomes "▁"."""
    return text.replace(" ", ESCAPED_SPACE)


def unescape_whitespace(text: str) -> str:
    """llama.cpp `llama_unescape_whitespace`: every "▁" becomes " "."""
    return text.replace(ESCAPED_SPACE, " ")


def byte_token_ids(token_to_id: dict[str, int]) -> list[int | None]:
    """Byte value -> the token `llama_vocab::byte_to_token` gives for it in an SPM vocabulary:
    `<0xXX>` (upper-case hex), else the one-byte text, else None (llama.cpp would throw)."""
    out: list[int | None] = []
    for b in range(256):
        tid = token_to_id.get(f"<0x{b:02X}>")
        if tid is None and b < 0x80:  # bytes >= 0x80 alone are no valid UTF-8 token text
            tid = token_to_id.get(chr(b))
        out.append(tid)
    return out


class SentencePieceMerger:
    """The merge loop of `llm_tokenizer_spm_session::tokenize` over escaped text."""

    def __init__(self, token_to_id: dict[str, int], scores: Sequence[float]) -> None:
        self._ids = token_to_id
        self._scores = scores
        self._bytes = byte_token_ids(token_to_id)
        # Every two adjacent characters of some token: where a text may be cut (see above).
        pairs: set[str] = set()
        for t in token_to_id:
            for k in range(len(t) - 1):
                pairs.add(t[k:k + 2])
        self._pairs = frozenset(pairs)
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`, which is already escaped (spaces are `▁`)."""
        out: list[int] = []
        if not text:
            return out
        pairs = self._pairs
        cache = self._cache
        start = 0
        for i in range(1, len(text) + 1):
            if i < len(text) and text[i - 1:i + 1] in pairs:
                continue
            segment = text[start:i]
            start = i
            ids = cache.get(segment)
            if ids is None:
                ids = self._merge(segment)
                if len(cache) >= _CACHE_LIMIT:
                    cache.clear()
                cache[segment] = ids
            out.extend(ids)
        return out

    def _merge(self, text: str) -> tuple[int, ...]:
        ids = self._ids
        n = len(text)
        if n == 1:
            tid = ids.get(text)
            return (tid,) if tid is not None else self._byte_fallback(text)
        scores = self._scores
        length = [1] * n          # symbol i starts at character i; 0 once merged away
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        # llm_bigram_spm::comparator: the highest score first, then the smallest left index.
        heap: list[tuple[float, int, int, int]] = []
        for i in range(n - 1):
            tid = ids.get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2))
        heapq.heapify(heap)
        push = heapq.heappush
        pop = heapq.heappop
        while heap:
            _, left, right, size = pop(heap)
            n_left, n_right = length[left], length[right]
            if n_left == 0 or n_right == 0 or n_left + n_right != size:
                continue  # one of the symbols has changed since this pair was queued
            length[left] = size
            length[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prev[after] = left
            before = prev[left]
            if before >= 0:
                merged = length[before] + size
                tid = ids.get(text[before:before + merged])
                if tid is not None:
                    push(heap, (-scores[tid], before, left, merged))
            if after >= 0:
                merged = size + length[after]
                tid = ids.get(text[left:left + merged])
                if tid is not None:
                    push(heap, (-scores[tid], left, after, merged))
        out: list[int] = []
        i = 0
        while i >= 0:
            piece = text[i:i + length[i]]
            tid = ids.get(piece)
            if tid is not None:
                out.append(tid)
            else:  # only a lone character can be no token: every merge made one
                out.extend(self._byte_fallback(piece))
            i = nxt[i]
        return tuple(out)

    def _byte_fallback(self, piece: str) -> tuple[int, ...]:
        out = []
        for b in piece.encode("utf-8"):
            tid = self._bytes[b]
            if tid is None:
                raise TokenizerError(
                    f"the vocabulary has no token for byte 0x{b:02X} (neither <0x{b:02X}> nor "
                    f"the byte itself), which {untrusted(piece)} needs; llama.cpp fails on it "
                    "too")
            out.append(tid)
        return tuple(out)
