"""The decode-shape policy: one object decides pass width, JIT widths, the guard and draft filling,
and nothing else in the package branches on the shape's name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import ane_spec
from ane_spec.daemon.config import ServeConfig
from ane_spec.errors import AneSpecError
from ane_spec.runtime.decode_shape import FILL_BELOW_RATIO, GUARD_FACTOR, DecodeShapePolicy

PACKAGE = Path(ane_spec.__file__).parent


def test_fixed_shape_is_uniform_and_calibrates_nothing() -> None:
    fixed = DecodeShapePolicy("fixed", 4)
    assert [fixed.pass_width(t) for t in (1, 2, 3, 4)] == [4, 4, 4, 4]
    assert fixed.jit_widths == [4] and fixed.reshape_frequency == "Infrequent"
    assert not fixed.needs_drift and not fixed.needs_pass_costs
    assert fixed.guard_margin(0.25) is None

    def never() -> float:
        raise AssertionError("the fixed shape measured a pass cost")

    assert fixed.fill_drafts(never) is True
    assert fixed.drafts_cannot_change_output(greedy=True, seeded=True)
    assert not fixed.drafts_cannot_change_output(greedy=False, seeded=True)


def test_mixed_shape_calibrates_the_guard_and_the_fill() -> None:
    mixed = DecodeShapePolicy("mixed", 4)
    assert [mixed.pass_width(t) for t in (1, 2, 4)] == [1, 2, 4]
    assert mixed.jit_widths == [1, 4] and mixed.reshape_frequency == "Frequent"
    assert mixed.needs_drift and mixed.needs_pass_costs
    assert mixed.guard_margin(None) is None and mixed.guard_margin(0.25) == GUARD_FACTOR * 0.25
    assert mixed.fill_drafts(lambda: FILL_BELOW_RATIO) is True
    assert mixed.fill_drafts(lambda: FILL_BELOW_RATIO + 0.1) is False
    assert not mixed.drafts_cannot_change_output(greedy=True, seeded=False)
    assert mixed.drafts_cannot_change_output(greedy=False, seeded=False)
    with pytest.raises(AneSpecError, match="decode shape 'wide'"):
        DecodeShapePolicy("wide", 4)  # type: ignore[arg-type]


def test_only_the_policy_branches_on_the_shape_name() -> None:
    """A comparison with "fixed" or "mixed" anywhere else is a second policy."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "decode_shape.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value in ("fixed", "mixed")
                    for c in [node.left, *node.comparators]):
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_serve_config_has_no_test_hooks() -> None:
    assert [f for f in ServeConfig.model_fields if f.startswith("test_")] == []
    with pytest.raises(ValueError, match="test_pass_delay_seconds"):
        ServeConfig(manifest=".", test_pass_delay_seconds=0.1)
