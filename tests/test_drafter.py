"""NgramDrafter: exact drafts on hand-made histories, the incremental index against brute force,
and every draft against a from-scratch reference implementation of the documented rules."""

from __future__ import annotations

import random

import pytest

from ane_spec.decode.drafter import Drafter, NgramDrafter
from ane_spec.errors import AneSpecError


def make(history, **kw) -> NgramDrafter:
    d = NgramDrafter(**kw)
    d.reset(history)
    return d


# -- settings -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, msg", [
    (dict(ngram_min=0), "ngram_min must be >= 1"),
    (dict(ngram_min=3, ngram_max=2), "ngram_max (2) must be >= ngram_min (3)"),
    (dict(ngram_max=2.5), "ngram_max must be an integer"),
    (dict(ngram_min=True), "ngram_min must be an integer"),
    (dict(prefer="oldest"), "prefer must be one of"),
    (dict(earliest_from=0), "earliest_from must be >= 1"),
    (dict(resync=-1), "resync must be >= 0"),
])
def test_bad_settings_raise(kw, msg):
    with pytest.raises(AneSpecError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        NgramDrafter(**kw)


@pytest.mark.parametrize("k", [-1, True, 2.0, "3"])
def test_bad_k_raises(k):
    with pytest.raises(AneSpecError, match="k must be a non-negative integer"):
        make([1, 2, 1]).draft(k)


def test_is_a_drafter_and_works_before_reset():
    d = NgramDrafter()
    assert isinstance(d, Drafter)
    assert d.draft(3) == [] and d.draft(3, fill=True) == []
    d.append([4, 5, 4])
    assert d.draft(3) == [5, 4, 5]
    assert make([1, 2, 1]).draft(0) == [] and make([1, 2, 1]).draft(0, fill=True) == []


# -- exact drafts on hand-made histories ----------------------------------------------------------

# (7,2,3) ends at 2 and continues 10 11 12; the unigram 3 last occurred at 7, continuing 20 21 22.
LONG_VS_SHORT = [7, 2, 3, 10, 11, 12, 8, 3, 20, 21, 22, 7, 2, 3]


def test_longest_match_wins_over_shorter_more_recent():
    d = make(LONG_VS_SHORT, ngram_max=3, prefer="recent", earliest_from=None)
    assert d.draft(3) == [10, 11, 12]


def test_ngram_max_bounds_the_match():
    d = make(LONG_VS_SHORT, ngram_max=1, prefer="recent", earliest_from=None)
    assert d.draft(3) == [20, 21, 22]


def test_ngram_min_bounds_the_match():
    hist = [1, 2, 3, 9, 3]  # only a 1-gram match
    assert make(hist, ngram_min=1, ngram_max=3).draft(3) == [9, 3, 9]
    assert make(hist, ngram_min=2, ngram_max=3).draft(3) == []


# After 5: successors 1, 1, 1, 2 (the 2 most recently). Recent copies after the last 5;
# frequent takes 1 (then 5, the only successor of 1, then 1 again); earliest copies after the first.
RECENT_VS_FREQUENT = [5, 1, 5, 1, 5, 1, 5, 2, 5]


@pytest.mark.parametrize("prefer, chain, expected", [
    ("recent", False, [2, 5]),     # the copy reaches the end of the history and stops there
    ("recent", True, [2, 5, 2]),   # ... or looks up again on history + draft
    ("frequent", True, [1, 5, 1]),
    ("earliest", True, [1, 5, 1]),
])
def test_recent_frequent_earliest_choose_differently(prefer, chain, expected):
    d = make(RECENT_VS_FREQUENT, ngram_max=1, prefer=prefer, chain=chain)
    assert d.draft(3) == expected


def test_continuation_stops_at_history_end_without_chain():
    d = make([1, 2, 1, 2], ngram_max=2, prefer="recent", earliest_from=None, chain=False)
    assert d.draft(3) == [1, 2]           # (1,2) ends at 1; only h[2:4] follows it
    d = make([1, 2, 1, 2], ngram_max=2, prefer="recent", earliest_from=None, chain=True)
    assert d.draft(3) == [1, 2, 1]        # second lookup on [1,2,1,2,1,2]


def test_earliest_from_copies_long_matches_from_their_first_occurrence():
    # (1,2,3) occurs twice: first followed by 4 4 4, last by 6 6 6.
    hist = [1, 2, 3, 4, 4, 4, 0, 1, 2, 3, 6, 6, 6, 0, 1, 2, 3]
    for earliest_from, expected in ((3, [4, 4, 4]), (4, [6, 6, 6]), (None, [6, 6, 6])):
        d = make(hist, ngram_max=3, prefer="recent", earliest_from=earliest_from)
        assert d.draft(3) == expected
    # A shorter match (2-gram) is below the threshold and stays with `prefer`.
    assert make(hist[:-1], ngram_max=3, prefer="recent", earliest_from=3).draft(3) == [3, 6, 6]


def test_k_caps_the_draft():
    hist = list(range(10)) + [0, 1]
    d = make(hist)
    assert [d.draft(k) for k in range(5)] == [[], [2], [2, 3], [2, 3, 4], [2, 3, 4, 5]]
    assert len(d.draft(12, fill=True)) == 12


def test_fill_false_does_not_invent_fill_true_completes():
    d = make([1, 2, 3])                   # nothing repeats: no evidence at all
    assert d.draft(3) == []
    assert d.draft(3, fill=True) == [3, 3, 3]   # most frequent token (ties: latest), thrice
    d = make([1, 2, 3, 1], ngram_min=2)   # only a 1-gram match
    assert d.draft(3) == []
    # Back-off to 1-grams: after 1 comes 2, after (1,2) comes 3, after (2,3) comes 1.
    assert d.draft(3, fill=True) == [2, 3, 1]
    d = make([1, 2, 1, 2], ngram_max=2, chain=False)
    assert d.draft(3) == [1, 2]           # the match ran out
    assert d.draft(3, fill=True) == [1, 2, 1]


def test_follow_keeps_copying_the_accepted_source():
    # The output is copying the start; (3,4) last occurred in the distractor "3 4 99".
    hist = [1, 2, 3, 4, 5, 6, 7, 3, 4, 99, 0, 1, 2]
    for follow, expected in ((True, [5, 6, 7]), (False, [99, 0, 1])):
        d = make(hist, ngram_max=2, prefer="recent", earliest_from=None, resync=None,
                 follow=follow)
        assert d.draft(3) == [3, 4, 5]
        d.append([3, 4])                  # the first two drafts were accepted + a correction
        assert d.draft(3) == expected


def test_a_rejected_draft_is_not_followed():
    hist = [1, 2, 3, 4, 5, 6, 7, 3, 4, 99, 0, 1, 2]
    d = make(hist, ngram_max=2, prefer="recent", earliest_from=None, resync=None)
    assert d.draft(3) == [3, 4, 5]
    d.append([])                          # nothing committed: nothing to follow yet
    d.append([8])                         # the draft was rejected outright
    assert d.draft(3) == []               # (2, 8) and 8 never occurred: not following 3 4 5


def test_resync_prefers_the_occurrence_after_the_break():
    # Source 1..9, then a distractor "5 6 42"; the output copies the source with 4 -> 77.
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 5, 6, 42, 0, 1, 2]
    for resync, expected in ((16, [6, 7, 8]), (None, [6, 42, 0])):
        d = make(hist, ngram_max=2, prefer="recent", earliest_from=None, resync=resync)
        assert d.draft(3) == [3, 4, 5]
        d.append([3, 77])                 # the copy breaks at 4 (position 3)
        d.draft(3)
        d.append([5])
        assert d.draft(3) == expected


def test_reset_clears_everything():
    d = make([1, 2, 3, 1, 2, 3, 1])
    d.draft(3)
    d.append([2, 3])
    d.reset([7, 8, 7])
    fresh = make([7, 8, 7])
    assert d.history == [7, 8, 7]
    assert d.index_state() == fresh.index_state()
    assert d.draft(3) == fresh.draft(3) == [8, 7, 8]
    assert d.draft(3, fill=True) == fresh.draft(3, fill=True)
    d.reset([])
    assert d.history == [] and d.draft(3, fill=True) == [] and d.index_state()[1] == {}


# -- the index against brute force ----------------------------------------------------------------

def brute_index(hist: list[int], nmax: int) -> dict:
    out: dict[int, dict] = {}
    for n in range(1, nmax + 1):
        table: dict = {}
        for e in range(n - 1, len(hist) - 1):
            gram = tuple(hist[e - n + 1:e + 1])
            ends, succ = table.setdefault(gram, ([], []))
            ends.append(e)
            succ.append(hist[e + 1])
        out[n] = {g: (ends, *_best(succ), _counts(succ)) for g, (ends, succ) in table.items()}
    return out


def _counts(succ: list[int]) -> dict[int, int]:
    c: dict[int, int] = {}
    for t in succ:
        c[t] = c.get(t, 0) + 1
    return c


def _best(succ: list[int]) -> tuple[int, int]:
    """The most frequent token; among ties the one whose top-count-th occurrence is latest."""
    counts = _counts(succ)
    top = max(counts.values())

    def reached(t: int) -> int:
        seen = 0
        for i, s in enumerate(succ):
            seen += s == t
            if seen == top:
                return i
        raise AssertionError

    best = max((t for t in counts if counts[t] == top), key=reached)
    return best, top


@pytest.mark.parametrize("seed", range(12))
def test_incremental_index_equals_brute_force(seed):
    rng = random.Random(seed)
    nmax = rng.randint(1, 6)
    vocab = rng.randint(2, 6)
    base = [0, 200_000, 2**32 - 8][seed % 3]  # keys pack 32 bits per token: try the top too
    d = NgramDrafter(ngram_max=nmax, ngram_min=rng.randint(1, nmax))
    d.reset([base + rng.randrange(vocab) for _ in range(rng.randint(0, 20))])
    for _ in range(25):
        d.draft(3, fill=rng.random() < 0.5)  # drafting must not disturb the index
        d.append([base + rng.randrange(vocab) for _ in range(rng.randint(0, 5))])
        assert d.index_state() == brute_index(d.history, nmax)


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_token_ids_out_of_range_raise(bad):
    with pytest.raises(AneSpecError, match=r"token ids must be in \[0, 2\*\*32\)"):
        NgramDrafter().reset([1, bad])
    d = make([1, 2, 1])
    with pytest.raises(AneSpecError):
        d.append([2, bad])
    assert d.history == [1, 2, 1] and d.index_state() == make([1, 2, 1]).index_state()


# -- every draft against a from-scratch reference -------------------------------------------------

def reference_draft(hist: list[int], k: int, *, ngram_min: int, ngram_max: int, prefer: str,
                    earliest_from: int | None, chain: bool, fill: bool) -> list[int]:
    """The documented rules (follow and resync off) by rescanning the whole history."""
    L = len(hist)
    if not hist or k == 0:
        return []

    def longest(virtual: list[int], lo: int):
        for n in range(min(ngram_max, len(virtual)), lo - 1, -1):
            suffix = virtual[len(virtual) - n:]
            ends = [e for e in range(n - 1, L - 1) if hist[e - n + 1:e + 1] == suffix]
            if ends:
                return n, ends
        return None

    def extend(draft: list[int], lo: int, weak: bool) -> None:
        while len(draft) < k:
            found = longest(hist + draft, lo)
            if found is None:
                return
            n, ends = found
            if weak or (prefer == "frequent" and (earliest_from is None or n < earliest_from)):
                draft.append(_best([hist[e + 1] for e in ends])[0])
                continue
            early = prefer == "earliest" or (earliest_from is not None and n >= earliest_from)
            e = ends[0] if early else ends[-1]
            draft.extend(hist[e + 1:min(L, e + 1 + k - len(draft))])
            if not chain:
                return

    out: list[int] = []
    extend(out, ngram_min, False)
    while fill and len(out) < k:
        extend(out, 1, True)
        if len(out) < k:
            out.append(_best(hist)[0])
    return out


@pytest.mark.parametrize("seed", range(40))
def test_drafts_equal_reference(seed):
    rng = random.Random(1000 + seed)
    nmax = rng.randint(1, 5)
    kw = dict(ngram_min=rng.randint(1, nmax), ngram_max=nmax,
              prefer=rng.choice(["recent", "frequent", "earliest"]),
              earliest_from=rng.choice([None, 1, 2, 3, 4]), chain=rng.random() < 0.7)
    vocab = rng.randint(2, 8)
    d = NgramDrafter(follow=False, resync=None, **kw)
    d.reset([rng.randrange(vocab) for _ in range(rng.randint(0, 30))])
    for _ in range(20):
        for k in (0, 1, 3, 5):
            for fill in (False, True):
                got = d.draft(k, fill=fill)
                assert got == reference_draft(d.history, k, fill=fill, **kw), (kw, k, fill)
        d.append([rng.randrange(vocab) for _ in range(rng.randint(1, 4))])


@pytest.mark.parametrize("seed", range(10))
def test_fill_false_never_invents_and_fill_true_completes_with_follow(seed):
    """Default settings (follow + resync on): fill=False tokens all continue a real match, and
    fill=True always returns k tokens; drafting the same state twice gives the same draft."""
    rng = random.Random(seed)
    d = NgramDrafter(ngram_min=2)
    d.reset([rng.randrange(5) for _ in range(10)])
    for _ in range(60):
        strict = d.draft(3)
        assert d.draft(3) == strict
        hist = d.history
        if strict:  # the history suffix must have occurred before (length >= ngram_min)
            assert any(hist[e - 1:e + 1] == hist[-2:] for e in range(1, len(hist) - 1))
        assert len(d.draft(3, fill=True)) == 3
        # Replay-style: accept a prefix of the draft, then a random correction.
        m = rng.randint(0, len(strict))
        d.append(strict[:m] + [rng.randrange(5)])
