"""`ane-spec demo` end to end on the embedded model: what a user sees in the first minute."""

from __future__ import annotations

from pathlib import Path

import pytest

from ane_spec.demo import DEMO_PROMPT, run_demo


@pytest.mark.slow
def test_demo_completes_the_prompt_identically_with_and_without_speculation(
        tmp_path: Path) -> None:
    lines: list[str] = []
    result = run_demo(tmp_path, say=lines.append)
    text = "\n".join(lines)
    assert result["identical"] and "identical tokens: yes" in text
    assert "NOT Phi-4-mini" in text and "tiny-code" in text
    for gate in ("row-invariance [mil/fp32]", "overflow [mil/fp32]", "parity [mil/fp32/fixed]", "block [mil/fp32]",
                 "drift [mil/fp32/fixed]"):
        assert f"{gate}: PASS" in text
    # The real completion is printed under the prompt, and it is code-shaped text.
    completion = result["completion"]
    assert result["prompt"] == DEMO_PROMPT and completion.strip()
    assert "   | " + completion.split("\n")[0] in text
    assert completion.startswith(" " * 8)  # it continues the method body it was given
    # The repetition penalty keeps it writing code rather than `name, name, name, ...`.
    assert len(set(completion.split())) >= 25


@pytest.mark.slow
def test_demo_on_core_ml_through_the_standin(tmp_path: Path, coreml_standin, capsys) -> None:
    """`ane-spec demo --backend coreml` end to end with Core ML's native layer replaced by the
    stand-in: every gate on Core ML passes, residency says it needs the hardware, and the
    speculative tokens equal greedy's."""
    from ane_spec.cli import main

    assert main(["demo", "--backend", "coreml", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for gate in ("row-invariance [coreml]", "parity [coreml/fixed]", "block [coreml]",
                 "drift [coreml/fixed]"):
        assert f"{gate}: PASS" in text, text
    assert "residency: SKIPPED (needs Apple hardware" in text
    assert "identical tokens: yes" in text and "on Core ML (CPU_AND_NE" in text


def test_a_failed_residency_on_tiny_code_is_expected() -> None:
    from ane_spec.demo import TINY_CODE_RESIDENCY_NOTE, gate_line
    from ane_spec.probes.report import GateReport

    failed = GateReport("residency", False, "coreml", None, {"compute_non_ane": 12}, {}, {})
    assert gate_line(failed).endswith(f"({TINY_CODE_RESIDENCY_NOTE})")
    other = GateReport("block", False, "coreml", None, {"min_cosine": 0.5}, {}, {})
    assert TINY_CODE_RESIDENCY_NOTE not in gate_line(other)


@pytest.mark.slow
def test_demo_on_a_model_with_a_draft_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """`demo --model T --draft-model D` on synthetic GGUFs (a 1-layer target; the draft one
    layer of other weights, the same vocabulary): the speculative reply with the model drafting
    is greedy's, the demo says who drafted; a draft of another vocabulary is refused before
    anything is built."""
    from ane_spec.cli import main
    from ane_spec.model.synthetic import preset, write_synthetic_gguf

    monkeypatch.chdir(tmp_path)  # nothing may land in ./local-artifacts
    target = write_synthetic_gguf(tmp_path / "t.gguf", preset("tiny", arch="llama",
                                                              num_layers=1))
    other = write_synthetic_gguf(tmp_path / "o.gguf", preset("tiny", arch="llama", num_layers=1,
                                                             vocab_size=2048))
    assert main(["demo", "--model", str(target), "--draft-model", str(other), "--out",
                 str(tmp_path / "refused"), "--max-seq", "128", "--max-tokens", "8"]) == 2
    err = capsys.readouterr().err
    assert "cannot draft for" in err and "Traceback" not in err
    assert not (tmp_path / "refused").exists() and not (tmp_path / "local-artifacts").exists()

    draft = write_synthetic_gguf(tmp_path / "d.gguf", preset(
        "tiny", arch="llama", num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2,
        ffn_size=256, rope_dims=32, seed=11))
    assert main(["demo", "--model", str(target), "--draft-model", str(draft), "--out",
                 str(tmp_path / "demo"), "--max-seq", "160", "--max-tokens", "20"]) == 0
    text = capsys.readouterr().out
    assert "identical tokens: yes (20 tokens)" in text, text
    assert "draft model: building d.gguf" in text and "pass costs" in text
    # The draft's build sits beside the demo's own, under --out, not in the working directory.
    assert (tmp_path / "demo" / "drafts" / "d-s160" / "manifest.json").is_file()
    assert not (tmp_path / "local-artifacts").exists()
    # The n-gram wins this prompt's steps; the model drafts at least every 16th
    # (draft_policy.EXPLORE_EVERY).
    drafted_by = next(line for line in text.splitlines() if "drafted by:" in line)
    assert "model " in drafted_by and "ngram " in drafted_by, drafted_by
