"""The stop-string matcher against the obvious quadratic one, on random text cut at random
places: same output, same stop string, same tail, for a few or thousands of stop strings."""

from __future__ import annotations

import random

from ane_spec.decode.stops import StopMatcher


class Quadratic:
    """The matcher as it was, looping over every stop string on every push (the reference)."""

    def __init__(self, stops: list[str]):
        self.stops, self.held, self.stopped, self.word, self.tail = \
            [s for s in stops if s], "", False, None, ""

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.held += text
        found = [(i, -len(s), s) for s in self.stops if (i := self.held.find(s)) >= 0]
        if found:
            cut, _, stop = min(found)
            self.stopped, self.word = True, stop
            out, self.tail, self.held = self.held[:cut], self.held[cut + len(stop):], ""
            return out
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.held)), keep, -1):
                if self.held.endswith(s[:n]):
                    keep = n
                    break
        out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.stopped else self.held), ""
        return out


def streamed(matcher, text: str, cuts: list[int]) -> tuple[list[str], str | None, str]:  # noqa: ANN001
    pieces = [matcher.push(text[a:b]) for a, b in zip([0] + cuts, cuts + [len(text)])]
    return pieces + [matcher.flush()], matcher.word, matcher.tail


def test_matches_the_quadratic_matcher() -> None:
    rng = random.Random(7)
    for case in range(3000):
        alphabet = "abc" if case % 2 else "ab "
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
                 for _ in range(rng.randint(0, 6 if case % 3 else 60))]
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))\
            if len(text) > 1 else []
        assert streamed(StopMatcher(stops), text, cuts) == streamed(Quadratic(stops), text, cuts)


def test_releases_text_that_cannot_start_a_stop_string() -> None:
    m = StopMatcher(["</end>", "STOP"])
    assert m.push("hello </e") == "hello "
    assert m.push("nd") == ""
    assert m.push("x") == "</endx"
    assert m.push(" ST") == " " and m.push("OP!") == "" and m.word == "STOP" and m.tail == "!"


def test_thousands_of_stop_strings_cost_what_a_few_do() -> None:
    """Not a speed target: a count check that nothing loops over the stop strings per push."""
    text = "the quick brown fox jumps over the lazy dog " * 20
    many = [f"zz{i:05d}" for i in range(20000)] + ["lazy dog!"]
    m = StopMatcher(many)
    comparisons = 0
    original = m._stop_at

    def counted(t: str):  # noqa: ANN202
        nonlocal comparisons
        comparisons += 1
        return original(t)

    m._stop_at = counted  # type: ignore[method-assign]
    out = "".join(m.push(text[i:i + 3]) for i in range(0, len(text), 3)) + m.flush()
    assert out == text and not m.stopped
    # one look-up per start position held, however many stop strings there are
    assert comparisons < 4 * len(text)
