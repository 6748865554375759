"""SuffixDecoding (Oliaro et al., arXiv 2411.04975) as a replay baseline: prompt tree + global tree.

The rule, as ArcticInference implements it (`arctic_inference/suffix_decoding/cache.py`,
`csrc/suffix_decoding/suffix_tree.cc`) and vLLM calls it (`vllm/v1/spec_decode/suffix_decoding.py`,
defaults from `SpeculativeConfig`: max_tree_depth 24, max_spec_factor 1.0, min_token_prob 0.1,
max_cached_requests 10000):

* Two suffix trees of depth `max_tree_depth`: a per-request tree over the prompt and the tokens
  generated so far, and one global tree over the responses (outputs only) of earlier requests
  plus the current one as it grows. The global tree keeps at most `max_cached_requests`
  responses, evicting the oldest (FIFO). A node's count is the number of suffixes (start
  positions, each at most max_tree_depth long) passing through it, i.e. the occurrences of the
  node's string.
* Each step the pattern is the last max_tree_depth tokens of prompt + output. For match_len =
  1, 2, ... < len(pattern) it matches the pattern's last match_len tokens (stopping at the first
  length with no match) and walks a path: continue along the matched occurrence's edge, and at a
  node take the child with the largest count, the running probability multiplied by
  count(child) / count(node); stop at max_tokens = min(k, floor(match_len * max_spec_factor +
  max_spec_offset)), at a running probability below min_token_prob, or at the tree's depth. The
  draft's score is the sum of its tokens' probabilities; the best score over match lengths wins
  (ties: the longer match). The global tree's draft replaces the request tree's only if its
  score is strictly higher.

Here the trees are not built; the same counts are read from the token sequences: count(s) is the
number of positions where s occurs (len(s) <= max_tree_depth), and a child's count the number of
those occurrences followed by its token, which is what the tree's counters hold. The C++ code
breaks ties between children of equal count by unordered_map iteration order, which is
unspecified; this takes the smallest token id. Path speculation only (`use_tree_spec=False`, as
vLLM calls it): the replay verifies one linear draft per pass.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from ane_spec.bench.drafter_bench import TokenBuffer
from ane_spec.errors import AneSpecError

__all__ = ["SuffixDecodingBaseline"]

_SEP = -1


class SuffixDecodingBaseline:
    """SuffixDecoding's speculation rule as a Drafter; one instance keeps its global tree across
    requests (`reset` ends the current request and starts the next). max_cached_requests=0
    turns the global tree off (the prompt tree alone, per request)."""

    def __init__(self, *, max_tree_depth: int = 24, max_spec_factor: float = 1.0,
                 max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 10000) -> None:
        if max_tree_depth < 2:
            raise AneSpecError(f"SuffixDecodingBaseline: max_tree_depth must be >= 2, got "
                               f"{max_tree_depth}")
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.max_spec_offset = max_spec_offset
        self.min_token_prob = min_token_prob
        self.max_cached_requests = max_cached_requests
        self._responses: deque[np.ndarray] = deque()  # finished requests' outputs
        self._local = TokenBuffer()  # prompt + output of the current request
        self._response: list[int] = []
        # earlier responses, each followed by _SEP, then the current one
        self._global = TokenBuffer()
        self._active = False

    def __repr__(self) -> str:
        return (f"SuffixDecodingBaseline(max_tree_depth={self.max_tree_depth}, "
                f"max_spec_factor={self.max_spec_factor}, min_token_prob={self.min_token_prob}, "
                f"max_cached_requests={self.max_cached_requests})")

    def reset(self, prompt_tokens: Sequence[int]) -> None:
        cache = self.max_cached_requests
        if self._active and cache != 0:  # stop_request: the response stays cached
            self._responses.append(np.asarray(self._response, dtype=np.int64))
        # start_request: room for the new response, evicting the oldest (FIFO)
        while cache > 0 and len(self._responses) > cache - 1:
            self._responses.popleft()
        parts = [p for r in self._responses for p in (r, [_SEP])]
        self._global = TokenBuffer(np.concatenate([[_SEP], *parts]).astype(np.int64))
        self._local = TokenBuffer(np.asarray([int(t) for t in prompt_tokens], dtype=np.int64))
        self._response = []
        self._active = True

    def append(self, tokens: Sequence[int]) -> None:
        tokens = [int(t) for t in tokens]
        self._local.extend(tokens)
        self._global.extend(tokens)
        self._response.extend(tokens)

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise AneSpecError(f"draft: k must be a non-negative integer, got {k!r}")
        local = self._local.view()
        if k == 0 or not len(local):
            return []
        pattern = local[-self.max_tree_depth:]
        tokens, score = self._speculate(local, pattern, k)
        if self.max_cached_requests != 0:
            g_tokens, g_score = self._speculate(self._global.view(), pattern, k)
            if g_score > score:
                tokens = g_tokens
        return tokens

    # -- one tree ------------------------------------------------------------------------------

    def _speculate(self, seq: np.ndarray, pattern: np.ndarray, k: int) -> tuple[list[int], float]:
        """SuffixTree::speculate over the suffixes of `seq` (separators end a sequence)."""
        p = len(pattern)
        ends = np.flatnonzero(seq == pattern[-1])  # where a match of the last token ends
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.arange(len(ends))  # indices into ends still matching
        for j in range(1, p - 1):  # match lengths up to p - 1 (match_len < len(pattern))
            at = ends[alive] - j
            ok = at >= 0
            ok[ok] = seq[at[ok]] == pattern[p - 1 - j]
            alive = alive[ok]
            if not len(alive):
                break
            matched[alive] += 1
        best: tuple[list[int], float] = ([], 0.0)
        memo: dict[tuple[int, int, int], tuple[list[int], float]] = {}
        for m in range(1, p):
            occ = ends[matched >= m]
            if not len(occ):
                break
            limit = max(0, min(k, int(m * self.max_spec_factor + self.max_spec_offset + 1e-6)))
            # Nested occurrence sets of equal size are equal: walk each distinct one once.
            key = (len(occ), limit, min(limit, self.max_tree_depth - m))
            if key not in memo:
                memo[key] = self._path(seq, occ, m, limit)
            draft = memo[key]
            if draft[1] >= best[1]:
                best = draft
        return best

    def _path(self, seq: np.ndarray, occ: np.ndarray, depth: int, limit: int
              ) -> tuple[list[int], float]:
        """SuffixTree::_speculate_path from the node of a matched string ending at `occ`."""
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit and depth < self.max_tree_depth:
            nxt = occ + 1
            nxt = nxt[nxt < len(seq)]
            succ = seq[nxt]
            real = succ >= 0
            if not real.any():
                break
            counts = np.bincount(succ[real])
            tok = int(counts.argmax())  # the most frequent child; ties: the smallest id
            prob *= float(counts[tok]) / len(occ)
            if prob < self.min_token_prob:
                break
            out.append(tok)
            score += prob
            occ = nxt[succ == tok]
            depth += 1
        return [int(t) for t in out], score
