"""Cross-request drafting: the bounded memory, how a draft picks between the request and the
memory, the SuffixDecoding baseline against a literal suffix trie, and the session streams."""

from __future__ import annotations

import random
import re

import pytest

from ane_spec.bench.drafter_bench import CrossRequest, replay, run_drafter_bench
from ane_spec.bench.session_streams import SESSION_FAMILIES, SESSION_LENGTH
from ane_spec.bench.streams import Stream, builtin_texts
from ane_spec.bench.suffix_baseline import SuffixDecodingBaseline
from ane_spec.decode.draft_memory import CHUNK, SEPARATOR, DraftMemory
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.ngram_index import as_plain
from ane_spec.errors import AneSpecError
from tests.test_drafter import brute_index


def memory_index(memory: DraftMemory) -> dict:
    """The memory's index as plain data, keyed like `brute_index` (positions in `tokens`)."""
    return as_plain(memory.index, memory.tokens, memory.ngram_max)


def brute_memory_index(requests: list[list[int]], nmax: int) -> dict:
    """brute_index over each stored request, shifted to its place in the separated layout."""
    out: dict = {n: {} for n in range(1, nmax + 1)}
    offset = 0
    for tokens in requests:
        for n, table in brute_index(tokens, nmax).items():
            for gram, (ends, best, best_n, counts) in table.items():
                if gram in out[n]:  # merge occurrences across requests, in layout order
                    ends0, _, _, counts0 = out[n][gram]
                    merged = dict(counts0)
                    for t, c in counts.items():
                        merged[t] = merged.get(t, 0) + c
                    out[n][gram] = ([*ends0, *(e + offset for e in ends)], None, None, merged)
                else:
                    out[n][gram] = ([e + offset for e in ends], best, best_n, dict(counts))
        offset += len(tokens) + 1
    return out


def comparable(index: dict) -> dict:
    """Drop best-token bookkeeping (checked by test_drafter for one history); keep occurrences
    and successor counts."""
    return {n: {g: (ends, counts) for g, (ends, _, _, counts) in t.items()}
            for n, t in index.items()}


# --- the memory --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_memory_is_bounded_evicts_the_oldest_and_indexes_what_is_left(seed: int) -> None:
    rng = random.Random(seed)
    cap = rng.randint(150, 400)
    memory = DraftMemory(cap, ngram_max=rng.randint(1, 5))
    requests = [[rng.randrange(6) for _ in range(rng.randint(10, 120))] for _ in range(12)]
    for r in requests:
        memory.add(r)
        assert memory.size <= cap
        stored = [t for t in memory.tokens if t != SEPARATOR]
        assert len(stored) == memory.size
        # what is held is the newest requests, whole (the newest cut to the cap at most)
        kept, total = [], 0
        for older in reversed(requests[:requests.index(r) + 1]):
            if total + len(older) > memory.size:
                break
            kept.insert(0, older)
            total += len(older)
        assert stored == [t for req in kept for t in req]
        assert comparable(memory_index(memory)) == comparable(
            brute_memory_index(kept, memory.ngram_max))


def test_memory_stores_a_repeated_prefix_once() -> None:
    memory = DraftMemory(10_000)
    first = list(range(100))
    assert memory.add(first) == 100
    assert memory.add(first + list(range(500, 560))) == 160 - 3 * CHUNK  # 3 whole chunks known
    assert memory.add(first) == 100 - 3 * CHUNK  # only the partial chunk is new
    assert memory.add([7] * 20) == 20
    huge = DraftMemory(64)
    assert huge.add(list(range(1000, 1300))) == 64 and huge.tokens[:-1] == list(range(1236, 1300))


def test_memory_settings_are_checked() -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(AneSpecError, match="max_tokens must be an integer >= 1"):
            DraftMemory(bad)  # type: ignore[arg-type]
    with pytest.raises(AneSpecError, match="memory must be a DraftMemory"):
        NgramDrafter(memory="lots")  # type: ignore[arg-type]
    with pytest.raises(AneSpecError, match="memory_rule must be one of"):
        NgramDrafter(memory_rule="bigger")


# --- drafting from the memory ------------------------------------------------------------------

def test_reset_keeps_the_memory_and_finish_chooses_where_a_request_goes() -> None:
    memory = DraftMemory()
    d = NgramDrafter(memory=memory)
    d.reset([1, 2, 3, 4])
    d.append([50, 51, 52, 53])
    d.reset([9, 9])
    assert d.history == [9, 9] and memory.requests == 1
    assert memory.tokens == [1, 2, 3, 4, 50, 51, 52, 53, SEPARATOR]
    other = DraftMemory()
    d.finish(into=other)
    assert other.tokens == [9, 9, SEPARATOR] and memory.requests == 1 and d.history == []
    d.reset([5])
    d.finish(into=None)
    assert memory.requests == 1 and other.requests == 1


def test_a_later_request_drafts_what_an_earlier_one_wrote() -> None:
    memory = DraftMemory()
    d = NgramDrafter(memory=memory)
    d.reset([10, 11, 12, 13])
    d.append([20, 21, 22, 23, 24, 25, 26])
    d.reset([99, 12, 13])  # this request alone has never seen what follows 12, 13
    assert d.draft(3) == [20, 21, 22]
    alone = NgramDrafter()
    alone.reset([99, 12, 13])
    assert alone.draft(3) == []
    d.append([20, 21, 22, 23])  # accepted: the memory copy is followed past ngram_max
    assert d.draft(3) == [24, 25, 26]
    assert d._mlen == 6  # noqa: SLF001 - the followed match: 12 13 20 21 22 23


@pytest.mark.parametrize("rule, expected", [("longest", [7]), ("longest-frequent", [8]),
                                            ("frequent", [8]), ("local-first", [7])])
def test_which_source_wins(rule: str, expected: list[int]) -> None:
    """Equal match lengths (2): this request says 7 once, the memory says 8 three times."""
    memory = DraftMemory()
    for _ in range(3):
        memory.add([5, 6, 8])
    d = NgramDrafter(memory=memory, memory_rule=rule, follow=False, chain=False)
    d.reset([5, 6, 7, 1, 5, 6])
    assert d.draft(1) == expected


def test_the_longer_match_wins_over_this_request() -> None:
    memory = DraftMemory()
    memory.add([1, 2, 3, 4, 40, 41])
    d = NgramDrafter(memory=memory, follow=False, chain=False)
    d.reset([3, 4, 30, 31, 0, 1, 2, 3, 4])  # here only "3 4" matched; the memory has "1 2 3 4"
    assert d.draft(2) == [40, 41]
    d = NgramDrafter(memory=memory, memory_rule="local-first", follow=False, chain=False)
    d.reset([3, 4, 30, 31, 0, 1, 2, 3, 4])
    assert d.draft(2) == [30, 31]


def test_memory_drafts_stop_at_a_request_boundary_and_survive_a_rebuild() -> None:
    memory = DraftMemory(1024)
    memory.add([1, 2, 3])
    d = NgramDrafter(memory=memory)
    d.reset([0, 1, 2])
    assert d.draft(3) == [3]  # then the separator: nothing copied across requests
    version = memory.version
    memory.add([0] * 1100)  # over the cap: the oldest go and the index is rebuilt
    assert memory.version != version and memory.tokens[0] == 0
    d.append([3])  # the pending pointer into the old layout is dropped, not followed
    assert d.draft(3) == [] and all(t >= 0 for t in d.draft(3, fill=True))


# --- the SuffixDecoding baseline against a literal suffix trie ---------------------------------

class Trie:
    """A suffix trie of depth D over some sequences, with the C++ tree's node counts: every
    suffix (start position), truncated to D tokens, inserted from the root."""

    def __init__(self, seqs: list[list[int]], depth: int):
        self.root: dict = {"count": 0, "kids": {}}
        for seq in seqs:
            for i in range(len(seq)):
                node = self.root
                node["count"] += 1
                for t in seq[i:i + depth]:
                    node = node["kids"].setdefault(t, {"count": 0, "kids": {}})
                    node["count"] += 1

    def speculate(self, pattern: list[int], k: int, factor: float, prob_min: float
                  ) -> tuple[list[int], float]:
        best: tuple[list[int], float] = ([], 0.0)
        for m in range(1, len(pattern)):
            node = self.root
            for t in pattern[len(pattern) - m:]:
                node = node["kids"].get(t)
                if node is None:
                    return best
            limit = min(k, int(m * factor + 1e-6))
            out, prob, score = [], 1.0, 0.0
            while len(out) < limit and node["kids"]:
                t, child = max(node["kids"].items(), key=lambda kv: (kv[1]["count"], -kv[0]))
                prob *= child["count"] / node["count"]
                if prob < prob_min:
                    break
                out.append(t)
                score += prob
                node = child
            if score >= best[1]:
                best = (out, score)
        return best


@pytest.mark.parametrize("seed", range(20))
def test_suffix_baseline_equals_a_literal_suffix_trie(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.randint(3, 8)
    kw = dict(max_tree_depth=depth, max_spec_factor=rng.choice([0.5, 1.0, 2.0]),
              min_token_prob=rng.choice([0.0, 0.1, 0.4]))
    d = SuffixDecodingBaseline(**kw)
    responses: list[list[int]] = []
    for _ in range(3):  # requests
        prompt = [rng.randrange(4) for _ in range(rng.randint(1, 15))]
        d.reset(prompt)
        response: list[int] = []
        for _ in range(8):
            local = Trie([prompt + response], depth)
            glob = Trie([*responses, response], depth)
            pattern = (prompt + response)[-depth:]
            want, score = local.speculate(pattern, 3, kw["max_spec_factor"],
                                          kw["min_token_prob"])
            g, g_score = glob.speculate(pattern, 3, kw["max_spec_factor"], kw["min_token_prob"])
            if g_score > score:
                want = g
            assert d.draft(3) == want, (seed, prompt, response, responses)
            new = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
            d.append(new)
            response += new
        responses.append(response)


def test_suffix_baseline_global_tree_holds_outputs_not_prompts() -> None:
    d = SuffixDecodingBaseline(min_token_prob=0.0)
    d.reset([1, 2, 3, 4, 5])  # a prompt only: never in the global tree
    d.append([6, 7, 8, 9])
    d.reset([7, 8])
    assert d.draft(3) == [9]  # from the first response (match length 1: 1 token)
    d.reset([3, 4])
    assert d.draft(3) == []
    off = SuffixDecodingBaseline(max_cached_requests=0)
    off.reset([1])
    off.append([6, 7, 8, 9])
    off.reset([7, 8])
    assert off.draft(3) == []


# --- the bench and the session streams ---------------------------------------------------------

def test_cross_request_replay_keeps_one_drafter_per_family() -> None:
    made: list[str] = []

    def factory() -> NgramDrafter:
        made.append("x")
        return NgramDrafter(memory=DraftMemory())

    streams = [Stream(f, (1, 2, 3), (4, 5, 6, 7)) for f in ("a", "a", "b", "a")]
    res = run_drafter_bench(streams, {"cross": CrossRequest(factory), "per": NgramDrafter})
    assert len(made) == 2  # one for a, one for b
    a = res["drafters"]["cross"]["families"]["a"]
    assert a["streams"] == 3 and a["tokens_per_pass"] > \
        res["drafters"]["per"]["families"]["a"]["tokens_per_pass"]
    fresh = replay(NgramDrafter(), streams[0])
    assert res["drafters"]["per"]["families"]["b"]["passes"] == fresh["passes"]


def test_session_streams_repeat_earlier_requests_not_their_own_prompt() -> None:
    texts = builtin_texts(SESSION_LENGTH, families=SESSION_FAMILIES)
    by = {f: [(p, o) for fam, p, o in texts if fam == f] for f in SESSION_FAMILIES}
    # file-edits: output j is output j-1 with one more rename, while prompt j has the original
    edits = by["file-edits"]
    for (p0, o0), (p1, o1) in zip(edits, edits[1:]):
        renamed = re.findall(r"rename `\w+` to `(\w+)`", p1)
        assert renamed[:-1] == re.findall(r"rename `\w+` to `(\w+)`", p0)
        assert all(name in o0 and name not in p1.split("```python")[1] for name in renamed[:-1])
    # agent-loop: step 2 re-quotes code read in step 1, no longer in its own prompt
    (_, _), (p1, _), (p2, o2), *_ = by["agent-loop"]
    quoted = o2.split("which I read before:\n")[1].split("\nI should")[0]
    assert quoted in p1 and quoted not in p2
    # chat-recall: answer 2 quotes answer 0, which fell out of the window
    (_, a0), _, (p2, a2), _, (p4, a4) = by["chat-recall"]
    first = a0.removesuffix("<|end|>")
    assert first in a2 and first not in p2 and first in a4 and first not in p4
