"""Replay bench: metrics on hand-computed streams, the vLLM-style baseline's rule, the built-in
streams, JSONL, and the project drafter against the baseline on every built-in family."""

from __future__ import annotations

import importlib
import inspect
import json
import random
import subprocess
import sys

import pytest

from ane_spec.bench.drafter_bench import (
    VllmNgramBaseline,
    format_by_drafter,
    format_markdown,
    losses,
    replay,
    run_drafter_bench,
)
from ane_spec.bench.streams import (
    FAMILIES,
    Stream,
    builtin_streams,
    builtin_texts,
    load_streams,
    save_streams,
    synthetic_tokenizer,
)
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.errors import AneSpecError


class Scripted:
    """A drafter that proposes a fixed list of drafts and records what it is told."""

    def __init__(self, drafts):
        self.drafts = list(drafts)
        self.calls = []

    def reset(self, prompt_tokens):
        self.calls.append(("reset", list(prompt_tokens)))

    def append(self, tokens):
        self.calls.append(("append", list(tokens)))

    def draft(self, k, *, fill=False):
        return self.drafts.pop(0)


def test_replay_counts_on_scripted_drafts():
    stream = Stream("t", (1, 2), (10, 11, 12, 13, 14, 15, 16))
    d = Scripted([[], [11, 12, 99], [14, 15, 16]])
    r = replay(d, stream, k=3)
    # pass 1: no draft, emits 10; pass 2: 2 accepted + correction 13; pass 3: all 3 accepted,
    # the output ends there (no bonus token left to emit).
    assert d.calls == [("reset", [1, 2]), ("append", [10]), ("append", [11, 12, 13]),
                       ("append", [14, 15, 16])]
    assert {k: r[k] for k in ("generated", "passes", "hits", "drafted", "accepted")} == {
        "generated": 7, "passes": 3, "hits": 2, "drafted": 6, "accepted": 5}
    res = run_drafter_bench([stream], {"s": lambda: Scripted([[], [11, 12, 99], [14, 15, 16]])})
    m = res["drafters"]["s"]["overall"]
    assert m["tokens_per_pass"] == pytest.approx(7 / 3)
    assert m["hit_rate"] == pytest.approx(2 / 3)
    assert m["acceptance"] == pytest.approx(5 / 6)


def test_replay_rejects_an_overlong_draft():
    with pytest.raises(AneSpecError, match="drafted 4 tokens for k=3"):
        replay(Scripted([[1, 2, 3, 4]]), Stream("t", (1,), (1, 2)), k=3)


def test_replay_metrics_on_a_tiny_stream_with_the_ngram_drafter():
    # prompt 1 2 3 4, output 1 2 3 4 5. Pass 1: 4 never occurred before -> no draft, emit 1.
    # Pass 2: 1 occurred at 0 -> draft 2 3 4, all accepted, + bonus 5. 5 tokens in 2 passes.
    stream = Stream("tiny", (1, 2, 3, 4), (1, 2, 3, 4, 5))
    res = run_drafter_bench([stream], {"ngram": NgramDrafter})
    m = res["drafters"]["ngram"]["families"]["tiny"]
    assert (m["passes"], m["generated"], m["drafted"], m["accepted"]) == (2, 5, 3, 3)
    assert (m["tokens_per_pass"], m["hit_rate"], m["acceptance"]) == (2.5, 0.5, 1.0)
    # fill: pass 1 guesses three tokens (most frequent token, 4, then what followed 4: none
    # -> 4 again ...), all wrong; pass 2 as before.
    res = run_drafter_bench([stream], {"ngram": NgramDrafter}, fill=True)
    m = res["drafters"]["ngram"]["overall"]
    assert (m["passes"], m["hits"], m["drafted"], m["accepted"]) == (2, 2, 6, 3)


def test_run_drafter_bench_validates():
    with pytest.raises(AneSpecError, match="no streams"):
        run_drafter_bench([], {"n": NgramDrafter})
    with pytest.raises(AneSpecError, match="no drafters"):
        run_drafter_bench([Stream("t", (1,), (1,))], {})


# -- the vLLM-style baseline ----------------------------------------------------------------------

def test_baseline_takes_the_earliest_occurrence_where_ours_takes_the_most_recent():
    hist = [5, 1, 5, 2, 5]
    base = VllmNgramBaseline(ngram_min=1, ngram_max=4)
    base.reset(hist)
    assert base.draft(3) == [1, 5, 2]
    ours = NgramDrafter(prefer="recent", earliest_from=None, chain=False)
    ours.reset(hist)
    assert ours.draft(3) == [2, 5]


def test_baseline_longest_match_bounds_and_history_end():
    hist = [2, 7, 1, 2, 9, 1, 2]     # (1,2) ends at 3; 2 alone first ends at 0
    base = VllmNgramBaseline(ngram_min=1, ngram_max=4)
    base.reset(hist)
    assert base.draft(3) == [9, 1, 2]
    base = VllmNgramBaseline(ngram_min=1, ngram_max=1)
    base.reset(hist)
    assert base.draft(3) == [7, 1, 2]
    base = VllmNgramBaseline(ngram_min=3, ngram_max=4)
    base.reset(hist)
    assert base.draft(3) == []
    base = VllmNgramBaseline(ngram_min=1, ngram_max=4)
    base.reset([1, 2, 1, 2])          # continuation cut at the end of the context
    assert base.draft(3) == [1, 2]
    base.append([1])
    assert base.draft(2) == [2, 1] and base.draft(0) == []
    with pytest.raises(AneSpecError, match="ngram_min <= ngram_max"):
        VllmNgramBaseline(ngram_min=3, ngram_max=2)


def _vllm_reference(hist, k, lo, hi):
    """vLLM's rule by brute force: longest suffix n in [lo, hi] seen earlier, first occurrence."""
    L = len(hist)
    for n in range(min(hi, L - 1), lo - 1, -1):
        for s in range(0, L - n):
            if hist[s:s + n] == hist[L - n:]:
                return hist[s + n:min(L, s + n + k)]
    return []


@pytest.mark.parametrize("seed", range(10))
def test_baseline_equals_brute_force(seed):
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    hi = rng.randint(lo, 5)
    base = VllmNgramBaseline(ngram_min=lo, ngram_max=hi)
    hist = [rng.randrange(rng.randint(2, 5)) for _ in range(rng.randint(0, 10))]
    base.reset(hist)
    for _ in range(40):
        assert base.draft(3) == _vllm_reference(hist, 3, lo, hi)
        new = [rng.randrange(4) for _ in range(rng.randint(1, 3))]
        base.append(new)
        hist += new


# -- streams --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def streams():
    return builtin_streams(per_family=4)


def test_builtin_streams_are_deterministic_real_text(streams):
    assert [s.family for s in streams] == [f for f in FAMILIES for _ in range(4)]
    assert builtin_streams(per_family=4) == streams
    assert builtin_streams(per_family=1, seed=1) != builtin_streams(per_family=1, seed=0)
    tok = synthetic_tokenizer()
    texts = builtin_texts(per_family=4)
    for s, (family, prompt, output) in zip(streams, texts):
        assert s.family == family and len(s.prompt) > 100 and len(s.output) > 100
        assert tok.decode(s.output) == output
    for family, prompt, output in texts:
        if family == "code":  # prompt + output: one contiguous slice of a real stdlib file
            header, body = prompt.split("\n", 1)
            module = header.rsplit(" ", 1)[1].rstrip(".")
            assert body + output in inspect.getsource(importlib.import_module(module))
    quote = next(out for fam, _, out in texts if fam == "quote")
    prompt = next(p for fam, p, _ in texts if fam == "quote")
    assert any(piece.strip(' ".') in prompt for piece in quote.split('"')[1::2] if len(piece) > 40)


def test_builtin_streams_are_the_same_in_another_process(tmp_path, streams):
    out = tmp_path / "s.jsonl"
    code = ("import sys; from ane_spec.bench.streams import builtin_streams, save_streams; "
            "save_streams(builtin_streams(per_family=4), sys.argv[1])")
    subprocess.run([sys.executable, "-c", code, str(out)], check=True, timeout=120)
    assert load_streams(out) == streams


def test_streams_jsonl_round_trip(tmp_path, streams):
    path = tmp_path / "s.jsonl"
    save_streams(streams, path)
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"family", "prompt", "output"}
    assert load_streams(path) == streams
    path.write_text('{"family": "x", "prompt": [1], "output": [1, -2]}\n')
    with pytest.raises(AneSpecError, match=r"s.jsonl:1: not a stream"):
        load_streams(path)
    path.write_text('\n{"family": "x", "prompt": [1]}\n')
    with pytest.raises(AneSpecError, match=r"s.jsonl:2"):
        load_streams(path)
    with pytest.raises(AneSpecError, match="cannot read"):
        load_streams(tmp_path / "missing.jsonl")
    with pytest.raises(AneSpecError, match="unknown stream families"):
        builtin_texts(1, families=["poetry"])


# -- the project drafter against the baseline -----------------------------------------------------

@pytest.mark.parametrize("fill", [False, True])
def test_project_drafter_does_not_lose_to_baseline(streams, fill):
    res = run_drafter_bench(streams, {
        "ours": NgramDrafter,
        "vllm": lambda: VllmNgramBaseline(ngram_min=1, ngram_max=4),
    }, fill=fill)
    assert res["families"] == list(FAMILIES)
    assert losses(res, "ours", "vllm") == {}
    for f in FAMILIES:
        ours = res["drafters"]["ours"]["families"][f]
        assert ours["generated"] == sum(len(s.output) for s in streams if s.family == f)
        assert 1.0 <= ours["tokens_per_pass"] <= 4.0
    md = format_markdown(res)
    assert md.count("\n| ") == 2 * (len(FAMILIES) + 1) + 1
    assert f"fill={'on' if fill else 'off'}" in md and "| overall | ours |" in md
    # The table drafter.py's docstring once held, now printed by the bench: a row per drafter.
    rows = format_by_drafter(res).splitlines()
    assert rows[2] == "| drafter | " + " | ".join([*FAMILIES, "overall"]) + " |"
    for line, (name, r) in zip(rows[4:], res["drafters"].items()):
        figures = [r["families"][f]["tokens_per_pass"] for f in FAMILIES]
        assert line == f"| {name} | " + " | ".join(
            f"{v:.3f}" for v in [*figures, r["overall"]["tokens_per_pass"]]) + " |"


def test_losses_reports_a_losing_family():
    res = {"families": ["a"], "drafters": {
        "x": {"families": {"a": {"tokens_per_pass": 1.5}}, "overall": {"tokens_per_pass": 1.5}},
        "y": {"families": {"a": {"tokens_per_pass": 2.0}}, "overall": {"tokens_per_pass": 1.0}},
    }}
    assert losses(res, "x", "y") == {"a": (1.5, 2.0)}
