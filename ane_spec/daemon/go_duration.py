"""Go's `time.ParseDuration`, for Ollama's `keep_alive` (api/types.go, `Duration.UnmarshalJSON`
reads a JSON string with it, so what Ollama refuses is refused here with Go's own message).

A duration is an optional sign and a sequence of decimal numbers, each with an optional
fraction and a unit: "300ms", "-1.5h", "2h45m". Units: "ns", "us" (or "µs", "μs"), "ms", "s",
"m", "h"; "0" alone needs none. The result is in nanoseconds and must fit an int64, as Go's
`time.Duration`. Ported from Go's src/time/format.go (ParseDuration, leadingInt,
leadingFraction, quote), overflow checks included.
"""

from __future__ import annotations

_UNITS = {"ns": 1, "us": 1_000, "\u00b5s": 1_000, "\u03bcs": 1_000, "ms": 1_000_000,
          "s": 1_000_000_000, "m": 60_000_000_000, "h": 3_600_000_000_000}
_MAX = 1 << 63
_QUOTE_LIMIT = 80  # characters of the input a message quotes


def _quote(s: str) -> str:
    """Go's time.quote: "..." with `"` and `\\` escaped and every byte of a control or non-ASCII
    character as \\xHH (cut to _QUOTE_LIMIT characters here: the input is a client's)."""
    out = []
    for c in s[:_QUOTE_LIMIT]:
        if c < " " or c >= "\x80":
            out.extend(f"\\x{b:02x}" for b in c.encode("utf-8", "surrogatepass"))
        else:
            out.append("\\" + c if c in '"\\' else c)
    return '"' + "".join(out) + ('..."' if len(s) > _QUOTE_LIMIT else '"')


def _leading_int(s: str) -> tuple[int, str]:
    """The digits at the start of `s` and the rest; OverflowError past 1 << 63."""
    x, i = 0, 0
    while i < len(s) and "0" <= s[i] <= "9":
        if x > _MAX // 10:
            raise OverflowError
        x = x * 10 + ord(s[i]) - 48
        if x > _MAX:
            raise OverflowError
        i += 1
    return x, s[i:]


def _leading_fraction(s: str) -> tuple[int, float, str]:
    """The digits at the start of `s` as a fraction x / scale, digits past what an int64 holds
    dropped (Go keeps consuming them but ignores them), and the rest."""
    x, scale, i, overflow = 0, 1.0, 0, False
    while i < len(s) and "0" <= s[i] <= "9":
        if not overflow:
            if x > (_MAX - 1) // 10:
                overflow = True
            else:
                y = x * 10 + ord(s[i]) - 48
                if y > _MAX:
                    overflow = True
                else:
                    x, scale = y, scale * 10
        i += 1
    return x, scale, s[i:]


def parse_duration(text: str) -> int:
    """Nanoseconds, or ValueError with Go's message (`time: invalid duration "abc"`)."""
    orig, s, neg = text, text, False
    invalid = ValueError(f"time: invalid duration {_quote(orig)}")
    if s and s[0] in "+-":
        neg, s = s[0] == "-", s[1:]
    if s == "0":
        return 0
    if not s:
        raise invalid
    total = 0
    while s:
        if not (s[0] == "." or "0" <= s[0] <= "9"):
            raise invalid
        before = len(s)
        try:
            v, s = _leading_int(s)
        except OverflowError:
            raise invalid from None
        pre = before != len(s)
        f, scale, post = 0, 1.0, False
        if s and s[0] == ".":
            s = s[1:]
            before = len(s)
            f, scale, s = _leading_fraction(s)
            post = before != len(s)
        if not pre and not post:
            raise invalid
        i = 0
        while i < len(s) and not (s[i] == "." or "0" <= s[i] <= "9"):
            i += 1
        if i == 0:
            raise ValueError(f"time: missing unit in duration {_quote(orig)}")
        unit_name, s = s[:i], s[i:]
        unit = _UNITS.get(unit_name)
        if unit is None:
            raise ValueError(f"time: unknown unit {_quote(unit_name)} in duration "
                             f"{_quote(orig)}")
        if v > _MAX // unit:
            raise invalid
        v *= unit
        if f > 0:
            v += int(float(f) * (float(unit) / scale))
            if v > _MAX:
                raise invalid
        total += v
        if total > _MAX:
            raise invalid
    if neg:
        return -total
    if total > _MAX - 1:
        raise invalid
    return total
