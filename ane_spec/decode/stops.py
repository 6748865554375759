"""Text streaming with stop strings that may straddle passes of up to four tokens.

Text is released only when no stop string could still begin inside it, so a client never sees
the first half of a stop sequence; once one completes, everything from its start is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False
        self.tail = ""  # the text after the stop string, once one completed

    def push(self, text: str) -> str:
        """Add newly decoded text; return what is safe to emit now."""
        if self.stopped:
            return ""
        self.held += text
        found = [(i, -len(s), s) for s in self.stops if (i := self.held.find(s)) >= 0]
        if found:
            cut, _, stop = min(found)
            self.stopped = True
            out, self.tail, self.held = self.held[:cut], self.held[cut + len(stop):], ""
            return out
        keep = self._longest_partial_suffix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _longest_partial_suffix(self) -> int:
        """Length of the longest suffix of held text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), best, -1):
                if self.held.endswith(s[:n]):
                    best = n
                    break
        return best
