"""A drafter that proposes a known continuation, to force how many drafts a pass accepts.

Tests use it to force full accepts, partial accepts and rejections; the host-overhead bench
(scripts/bench_host_overhead.py) uses it to measure passes that read 1, 2, 3 or 4 rows.
"""

from __future__ import annotations

from collections.abc import Sequence


class ScriptedDrafter:
    """Drafts the next tokens of `continuation` (what the model will produce), the first
    `correct` of them as they are and the rest corrupted (+1 mod `vocab`): every pass then
    accepts min(correct, k) drafts and reads that many rows plus one."""

    def __init__(self, continuation: Sequence[int], correct: int, vocab: int):
        self.continuation, self.correct, self.vocab = list(continuation), correct, vocab
        self.history: list[int] = []
        self.prompt_len = 0

    def reset(self, prompt_tokens: Sequence[int]) -> None:
        self.history = list(prompt_tokens)
        self.prompt_len = len(self.history)

    def append(self, tokens: Sequence[int]) -> None:
        self.history.extend(tokens)

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        done = len(self.history) - self.prompt_len
        true = self.continuation[done:done + k]
        return [t if i < self.correct else (t + 1) % self.vocab for i, t in enumerate(true)]
