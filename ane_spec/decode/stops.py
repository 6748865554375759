"""Text streaming with stop strings that may straddle passes of up to four tokens.

Text is released only when no stop string could still begin inside it, so a client never sees
the first half of a stop sequence; once one completes, everything from its start is dropped.

Clients may send any number of stop strings (llama-server sets no limit), so nothing here
loops over them: the strings are kept sorted, and each question ("does a stop string start
here?", "could one still start here?") is a few binary searches, whatever their number.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from os.path import commonprefix


class StopMatcher:
    def __init__(self, stops: Sequence[str] = ()):
        self.stops = sorted({s for s in stops if s})
        self.longest = max(map(len, self.stops), default=0)
        # Where a stop string can start: only at one of their first characters (a long run of
        # other text, say whitespace, is skipped at C speed instead of bisected per character).
        firsts = "".join(map(re.escape, sorted({s[0] for s in self.stops})))
        self._firsts = re.compile(f"[{firsts}]" if firsts else "(?!)")
        self.held = ""
        self.stopped = False
        self.word: str | None = None  # the stop string that ended the text
        self.tail = ""  # the text after the stop string, once one completed

    def push(self, text: str) -> str:
        """Add newly decoded text; return what is safe to emit now."""
        if self.stopped:
            return ""
        if not self.stops:
            return text
        if not self.held and self._firsts.search(text) is None:
            return text  # no stop string can start in it
        self.held += text
        for found in self._firsts.finditer(self.held):
            start = found.start()
            stop = self._stop_at(self.held[start:start + self.longest])
            if stop is not None:
                self.stopped, self.word = True, stop
                out = self.held[:start]
                self.tail, self.held = self.held[start + len(stop):], ""
                return out
        keep = self._longest_partial_suffix()
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _stop_at(self, text: str) -> str | None:
        """The longest stop string that is a prefix of `text`, if any. Prefixes of `text` sort
        in length order, so the largest string <= text that is one is the longest; when the
        largest string <= text is not one, any that is must be a prefix of what the two share."""
        hi = bisect_right(self.stops, text)
        while hi:
            candidate = self.stops[hi - 1]
            if text.startswith(candidate):
                return candidate
            shared = len(commonprefix([candidate, text]))
            if shared == 0:
                return None
            text = text[:shared]
            hi = bisect_right(self.stops, text, 0, hi - 1)
        return None

    def _longest_partial_suffix(self) -> int:
        """Length of the longest suffix of held text that is a proper prefix of a stop string:
        the strings starting with a given text sort together, from the first one >= it."""
        for found in self._firsts.finditer(self.held, max(0, len(self.held) - self.longest + 1)):
            start = found.start()
            suffix = self.held[start:]
            i = bisect_left(self.stops, suffix)
            if i < len(self.stops) and self.stops[i].startswith(suffix):
                return len(self.held) - start
        return 0

