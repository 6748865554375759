"""The n-gram index under both of the drafter's sources: this request's history and the memory.

For n = 1..ngram_max, `index[n]` maps the key of an n-gram g to its entry, over every position e
ending an occurrence of g that already has a successor h[e+1]. With one occurrence the entry is
that e (an int: most long grams occur once, and an int is no container for the garbage collector
to track). From two on, a list
  [ends, best_token, best_count, counts-or-None]
  ends        every such e, ascending: ends[0] the earliest, ends[-1] the most recent;
  best_token  the successor seen most often after g; among equal counts the one whose count
              reached that value last (the most recent of the most frequent);
  best_count  its count;
  counts      None while every occurrence had the same successor, else {successor: count}.

Keys are ints built in O(1) per length: the 1-gram ending at e is the token h[e]; the n-gram adds
h[e-n+1] << (32 * (n-1)) to the (n-1)-gram's key, so keys are exact (token ids < 2**32) and,
unlike tuples, are not containers the garbage collector has to track.
"""

from __future__ import annotations

from collections.abc import Sequence

ENDS, BEST, BEST_N, COUNTS = 0, 1, 2, 3
SHIFT = 32
MAX_TOKEN = 1 << SHIFT

Index = list[dict[int, object]]


def new_index(ngram_max: int) -> Index:
    """index[n] for n = 1..ngram_max (index[0] unused)."""
    return [{} for _ in range(ngram_max + 1)]


def flat(key: int, n: int) -> tuple[int, ...]:
    mask = MAX_TOKEN - 1
    return tuple((key >> (SHIFT * i)) & mask for i in range(n - 1, -1, -1))


def as_plain(index: Index, hist: Sequence[int], nmax: int) -> dict[int, dict[tuple, tuple]]:
    """The index as plain data, for tests and debugging (O(index size)):
    {n: {gram: (ends, best_token, best_count, {successor: count})}}."""
    out: dict[int, dict[tuple, tuple]] = {}
    for n in range(1, nmax + 1):
        out[n] = {}
        for key, entry in index[n].items():
            if entry.__class__ is int:
                entry = [[entry], hist[entry + 1], 1, None]
            ends, best, best_n, counts = entry  # type: ignore[misc]
            counts = dict(counts) if counts is not None else {best: best_n}
            out[n][flat(key, n)] = (list(ends), best, best_n, counts)
    return out


def add_successor(hist: Sequence[int], index: Index, top: int, last: int, tok: int) -> None:
    """Record that `tok` follows position `last`, for the grams of length 1..top ending there
    (the caller bounds top by ngram_max and by where the grams may start)."""
    gram = hist[last]
    for n in range(1, top + 1):
        if n > 1:
            gram |= hist[last - n + 1] << (SHIFT * (n - 1))
        table = index[n]
        entry = table.get(gram)
        if entry is None:
            table[gram] = last
            continue
        if entry.__class__ is int:
            prev = hist[entry + 1]
            table[gram] = ([[entry, last], tok, 2, None] if prev == tok else
                           [[entry, last], tok, 1, {prev: 1, tok: 1}])
            continue
        entry[ENDS].append(last)
        counts = entry[COUNTS]
        if counts is None:
            if entry[BEST] == tok:
                entry[BEST_N] += 1
                continue
            counts = entry[COUNTS] = {entry[BEST]: entry[BEST_N]}
        c = counts.get(tok, 0) + 1
        counts[tok] = c
        if c >= entry[BEST_N]:
            entry[BEST] = tok
            entry[BEST_N] = c


def probe(index: Index, keys: Sequence[int], lo: int, top: int) -> tuple[int, object] | None:
    """The longest n in [lo, top] with keys[n] indexed, as (n, entry).

    Matches are nested (a suffix that occurred ending at e has every shorter suffix ending at e
    too), so after trying the longest n this binary-searches: O(log top) dict probes.
    """
    if top < lo:
        return None
    entry = index[top].get(keys[top])
    if entry is not None:
        return top, entry
    found = None
    low, high = lo, top - 1  # invariant: no match longer than high
    while low <= high:
        mid = (low + high) // 2
        entry = index[mid].get(keys[mid])
        if entry is None:
            high = mid - 1
        else:
            found = (mid, entry)
            low = mid + 1
    return found


def occurrences(entry: object) -> list[int]:
    return [entry] if entry.__class__ is int else entry[ENDS]  # type: ignore[index]


def successor_count(entry: object, hist: Sequence[int], tok: int) -> int:
    """How many occurrences of the entry's gram were followed by `tok`."""
    if entry.__class__ is int:
        return int(hist[entry + 1] == tok)  # type: ignore[operator]
    counts = entry[COUNTS]  # type: ignore[index]
    if counts is None:
        return entry[BEST_N] if entry[BEST] == tok else 0  # type: ignore[index]
    return counts.get(tok, 0)
