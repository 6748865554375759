"""A drafter whose guesses a test controls, to force full accepts, partial accepts and rejections."""

from __future__ import annotations

from collections.abc import Sequence


class ScriptedDrafter:
    """Drafts from a known continuation, optionally corrupting it: a real Drafter whose
    guesses the test controls, to force full accepts, partial accepts and rejections."""

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
