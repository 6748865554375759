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
