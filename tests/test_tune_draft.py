"""`ane-spec tune --draft-model` (issue 34: the `tune` entry that measures the draft on the Mac):
the draft model measured beside the build on each compute units, each in its own process, and
the choice of whether and where it runs.

On the interpreter (the product's path here) and through the Core ML stand-in (the Mac's path:
three units, the draft's packages loaded with each), end to end through the command line; the
isolation and the choice with a measuring function that dies, raises or reports figures.
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest

from ane_spec.bench.tune_draft import DraftJob, choose_draft, run_draft_tune
from ane_spec.bench.tune_model import DraftRow, load_tune
from ane_spec.cli import main
from tests.test_draft_coreml import _log_loads, _package_hashes, _units_of

TOKENS = "16"


def _tune(args: list[str]) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["tune", *args])
    return code, stdout.getvalue(), stderr.getvalue()


def _assert_measured(row: DraftRow) -> None:
    assert row.outcome == "ok", row
    assert row.verify_ms > 0 and row.draft_ms > 0 and row.ratio > 0
    for mode in ("greedy", "ngram", "model", "both"):
        assert getattr(row, f"{mode}_tok_s") > 0, mode
    for mode in ("ngram", "model", "both"):
        assert getattr(row, f"{mode}_tokens_per_pass") >= 1, mode
    # Every pass of the `both` decode was drafted by one source or the other.
    assert sum(n["passes"] for n in row.both_sources.values()) > 0, row.both_sources


def test_tune_measures_the_draft_on_the_interpreter(coreml_build, coreml_draft,
                                                    tmp_path: Path) -> None:
    """--draft-only: no variant is built, the build's source GGUF is not needed; one row (the
    interpreter), its costs and three decodes; tune.json and tune.md say whether it pays."""
    target, _ = coreml_build
    out = tmp_path / "out"
    code, stdout, stderr = _tune(["--out", str(out), "--manifest", str(target), "--backend", "mil",
                                  "--draft-model", str(coreml_draft[0]), "--draft-only",
                                  "--draft-tokens", TOKENS])
    assert code == 0, stderr[-2000:]
    result = load_tune(out / "tune.json")
    assert result.variants == [] and result.choices == {}
    draft = result.draft
    assert draft.draft == str(coreml_draft[0]) and draft.new_tokens == int(TOKENS)
    assert draft.prompt_tokens == 64 - int(TOKENS)  # the build's context, less the new tokens
    [row] = draft.rows
    assert row.units == "interpreter"
    _assert_measured(row)
    assert row.overlap is not None and 0 <= row.overlap <= 1  # the draft ran in its own process
    choice = draft.choice
    assert choice.measured and choice.units is None
    assert choice.serve_flags.startswith("--draft-model DRAFT") == choice.use_draft
    assert f"vs {row.ngram_tok_s:.4g} with the n-grams alone" in choice.rests_on
    page = (out / "tune.md").read_text()
    assert "## Draft model" in page and "| interpreter | ok |" in page
    assert "## Variants" not in page and not (out / "tune.png").exists()
    assert "draft model: serve with" in stdout or "serve without --draft-model" in stdout
    assert "apply with: ane-spec build" not in stdout  # no variant: nothing for --tuned


def test_tune_measures_the_draft_on_each_core_ml_units(coreml_standin, coreml_build, coreml_draft,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mac's path, through the stand-in: one row per units, each measured in its own
    process, the draft's packages loaded with that units (CPU_AND_NE, CPU_AND_GPU, CPU_ONLY)
    and the target's with CPU_AND_NE; a chosen units is given as --draft-units."""
    target, _ = coreml_build
    log = tmp_path / "loads.jsonl"
    _log_loads(coreml_standin, monkeypatch, log)
    out = tmp_path / "out"
    code, stdout, stderr = _tune(["--out", str(out), "--manifest", str(target), "--backend",
                                  "coreml", "--draft-model", str(coreml_draft[0]), "--draft-only",
                                  "--draft-tokens", TOKENS, "--deadline", "300"])
    assert code == 0, stderr[-2000:]
    draft = load_tune(out / "tune.json").draft
    assert [r.units for r in draft.rows] == ["ane", "gpu", "cpu"]
    for row in draft.rows:
        _assert_measured(row)
    draft_units, _, others = _units_of(log, _package_hashes(coreml_draft[0]))
    assert draft_units == {"CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"}, coreml_standin.loads(log)
    assert others == {"CPU_AND_NE"}
    choice = draft.choice
    assert choice.measured
    if choice.use_draft:
        assert choice.serve_flags.startswith(f"--draft-model DRAFT --draft-units {choice.units}")
        assert f"draft model: serve with --draft-model {coreml_draft[0]} --draft-units " \
               f"{choice.units}" in stdout


# --- isolation and the choice -------------------------------------------------------------------

def misbehaving_measure(job: DraftJob, progress) -> dict:  # noqa: ANN001
    """Runs in the worker process: gpu's dies, cpu's raises, ane's reports figures."""
    if job.units == "gpu":
        os._exit(3)
    if job.units == "cpu":
        raise RuntimeError("the draft's compile failed")
    return {"units": job.units, "outcome": "ok", "verify_ms": 50.0, "draft_ms": 10.0,
            "ratio": 0.2, "overlap": 0.9, "greedy_tok_s": 20.0, "ngram_tok_s": 30.0,
            "ngram_tokens_per_pass": 1.5, "model_tok_s": 48.0, "model_tokens_per_pass": 2.6,
            "both_tok_s": 45.0, "both_tokens_per_pass": 2.5,
            "both_sources": {"model": {"passes": 5, "drafted": 15, "accepted": 8}}}


def test_a_units_that_dies_or_raises_costs_only_its_row(tmp_path: Path) -> None:
    result = run_draft_tune(str(tmp_path / "t"), str(tmp_path / "d"), backend="coreml",
                            margin=0.05, deadline_s=60, max_seq=128, measure=misbehaving_measure)
    ane, gpu, cpu = result.rows
    assert ane.outcome == "ok" and ane.model_tok_s == 48.0
    assert gpu.outcome == "crashed" and "exit code 3" in gpu.reason, gpu
    assert cpu.outcome == "error" and "the draft's compile failed" in cpu.reason, cpu
    assert result.prompt_tokens == 64 and result.new_tokens == 64
    choice = result.choice
    # The draft alone (48 tok/s) beat both drafters (45): serve is told the mode too.
    assert choice.use_draft and (choice.units, choice.mode) == ("ane", "model")
    assert choice.serve_flags == "--draft-model DRAFT --draft-units ane --draft-mode model"
    assert "gpu crashed" in choice.rests_on and "cpu error" in choice.rests_on


def _row(units: str, both: float, model: float = 10.0, ngram: float = 30.0,
         outcome: str = "ok") -> DraftRow:
    return DraftRow(units=units, outcome=outcome, verify_ms=50.0, draft_ms=10.0, ratio=0.2,
                    overlap=0.5, greedy_tok_s=20.0, ngram_tok_s=ngram,
                    ngram_tokens_per_pass=1.5, model_tok_s=model, model_tokens_per_pass=2.0,
                    both_tok_s=both, both_tokens_per_pass=2.5,
                    reason="" if outcome == "ok" else "differed from greedy")


def test_the_fastest_correct_units_is_chosen_only_past_the_margin() -> None:
    choice = choose_draft([_row("ane", 40.0), _row("gpu", 45.0), _row("cpu", 60.0, outcome="wrong")],
                          0.05, units_flag=True)
    assert choice.use_draft and (choice.units, choice.mode) == ("gpu", "both")  # cpu: wrong
    assert choice.serve_flags == "--draft-model DRAFT --draft-units gpu"
    assert "cpu wrong (differed from greedy)" in choice.rests_on
    # 31 tok/s against the n-grams' 30 is inside a 5% margin: the free drafter stays.
    slow = choose_draft([_row("ane", 31.0), _row("gpu", 20.0)], 0.05, units_flag=True)
    assert not slow.use_draft and slow.measured and slow.serve_flags == ""
    assert slow.rests_on.startswith("no draft model: 31 tok/s with the draft on ane, mode both")
    # Faster, but at the n-grams' 2.5 tokens per pass: the draft added nothing but noise.
    same = _row("ane", 40.0).model_copy(update={"ngram_tokens_per_pass": 2.5})
    noise = choose_draft([same], 0.05, units_flag=True)
    assert not noise.use_draft and "no more tokens per pass than the n-grams' 2.5" in \
        noise.rests_on
    none = choose_draft([_row("ane", 40.0, outcome="wrong")], 0.05, units_flag=True)
    assert not none.use_draft and not none.measured
    # The interpreter has no --draft-units to give.
    mil = choose_draft([_row("interpreter", 40.0)], 0.05, units_flag=False)
    assert mil.use_draft and mil.units is None and mil.serve_flags == "--draft-model DRAFT"


@pytest.mark.parametrize("args, message", [
    (["--draft-only"], "--draft-only needs --draft-model and --manifest"),
    (["--draft-model", "x"], "--draft-model is measured beside a build: give --manifest too"),
])
def test_draft_flags_without_a_build_are_one_line(args: list[str], message: str,
                                                  tmp_path: Path) -> None:
    code, _, stderr = _tune(["--out", str(tmp_path / "out"), *args])
    assert code == 2 and message in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out").exists()
