"""The doctor's mask-ops check (probes/mask_ops.py): equal/greater_equal/select/clip semantics on
the device, their placement, and the --mask-form it advises. Judging and advice are tested on
fabricated device outputs; the whole check runs through the Core ML stand-in, whose compute-plan
table puts `select` on the CPU or every op on the Neural Engine, so both advices are reached."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from ane_spec.probes import doctor, mask_ops
from ane_spec.probes.doctor import run_doctor
from ane_spec.probes.doctor_report import to_json, to_lines, to_markdown
from ane_spec.runtime.mil_interpreter import MILInterpreter

ON_ANE = {"equal": "NeuralEngine", "greater_equal": "NeuralEngine", "select": "NeuralEngine",
          "clip": "NeuralEngine"}


@pytest.fixture(scope="module")
def right(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """(inputs, outputs) of the probe program as the fp16 interpreter computes it: right."""
    path = mask_ops.build_probe(tmp_path_factory.mktemp("mask-ops") / "p.mlpackage")
    inputs = mask_ops.probe_inputs()
    return inputs, MILInterpreter.from_package(path, precision="fp16").predict(inputs)


def test_the_probe_holds_every_case_it_judges(right) -> None:
    inputs, outputs = right
    rows = inputs["rows"]
    assert np.isnan(rows).any() and np.isposinf(rows).any() and np.isneginf(rows).any()
    assert (inputs["mask"] < 0).any() and (inputs["mask"] == 0).any()
    # Hidden slots holding NaN and inf: select must replace those too.
    hidden = np.broadcast_to(inputs["mask"] < 0, rows.shape)
    assert np.isnan(rows[hidden]).any() and np.isinf(rows[hidden]).any()
    results, clip_nan = mask_ops.judge(outputs, inputs)
    assert all(r.right for r in results.values()), results
    assert clip_nan == "clip(NaN) -> NaN"  # the interpreter's min/max propagate NaN


def _spoil(outputs: dict, name: str, how) -> dict:
    spoiled = {k: np.array(v, np.float32) for k, v in outputs.items()}
    spoiled[name] = how(spoiled[name])
    return spoiled


@pytest.mark.parametrize("op, how", [
    ("equal", lambda a: np.ones_like(a)),                            # equal(NaN, NaN) true
    ("greater_equal", lambda a: np.ones_like(a)),                    # every slot visible
    ("select", lambda a: np.where(a == -32768, np.nan, a)),          # hidden NaN passed through
    ("clip", lambda a: np.where(np.abs(a) == 65504, np.inf * np.sign(a), a)),  # inf kept
    ("finite_rows", lambda a: np.where(a == 0, np.nan, a)),          # NaN not cleaned
])
def test_each_wrong_op_is_caught_and_steers_the_advice(right, op: str, how) -> None:
    inputs, outputs = right
    results, _ = mask_ops.judge(_spoil(outputs, op, how), inputs)
    assert [k for k, r in results.items() if not r.right] == [op]
    assert results[op].wrong > 0 and results[op].example.startswith("element ")
    form, reason = mask_ops.recommend(results, ON_ANE)
    if op == "clip":  # both forms rely on clip: the select ops alone decide the form
        assert form == "select"
    else:
        assert form == "additive" and reason.startswith(f"{op} wrong on this device")


def test_placement_decides_when_every_op_is_right(right) -> None:
    results, _ = mask_ops.judge(right[1], right[0])
    assert mask_ops.recommend(results, ON_ANE)[0] == "select"
    form, reason = mask_ops.recommend(results, ON_ANE | {"greater_equal": "CPU"})
    assert form == "additive" and reason.startswith("greater_equal on CPU")
    form, reason = mask_ops.recommend(results, ON_ANE | {"select": "unplanned"})
    assert form is None and "not planned here" in reason


@pytest.fixture
def standin_children(coreml_standin, monkeypatch: pytest.MonkeyPatch):
    for key, value in coreml_standin.child_env().items():
        monkeypatch.setenv(key, value)
    return coreml_standin


@pytest.mark.parametrize("table", [
    {"default": "NeuralEngine"},
    {"default": "NeuralEngine", "ops": {"select": "CPU"}},
    None,
])
def test_without_a_build_the_check_reports_the_ops_and_gives_no_placement_advice(
        standin_children, monkeypatch: pytest.MonkeyPatch, table) -> None:
    """The check runs in the doctor's worker child on the stand-in (Core ML's Python layer, the
    interpreter's fp16 arithmetic). With no build, whatever the plan would say of the small
    probe program (placed on the CPU whatever its ops on a Mac), no placement is read and no
    form is advised: placement needs --manifest."""
    rules = {"small_program_elements": 4_000_000} | ({"plan_devices": table} if table else {})
    for key, value in standin_children.rules_env(**rules).items():
        monkeypatch.setenv(key, value)
    checks = run_doctor(checks=[("mask-ops", doctor.check_mask_ops)])
    check = checks[0]
    assert check.status == "passed", check.summary
    assert check.details["recommended_mask_form"] is None and check.details["placement"] == {}
    assert "placement needs --manifest" in check.summary
    assert "stand-in" in check.details["stand_in"]
    assert all(r["right"] for r in check.details["semantics"].values())
    line = "mask form for this Mac: undetermined"
    assert line in to_lines(checks) and line in to_markdown(checks, None)
    assert json.loads(to_json(checks, None))["mask_form"]["mask_form"] is None


def test_the_probe_runs_through_the_backend_with_the_lifetime_rule(standin_children,
                                                                   monkeypatch) -> None:
    """The probe's prediction goes through make_backend("coreml") (the worker, float32 arrays
    kept alive past the call), not CompiledMLModel.predict on fp16 arrays that die with it."""
    seen = []
    from ane_spec.runtime import backend as backend_module

    real = backend_module.make_backend

    def recording(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "make_backend", recording)
    run = doctor.DoctorRun(None, __import__("pathlib").Path(
        __import__("tempfile").mkdtemp(prefix="mask-ops-")))
    verdict = doctor.check_mask_ops(run)
    assert verdict.status == "passed", verdict.summary
    assert seen and seen[0][0] == ("coreml",)
    assert standin_children.lifetime_violations == []


@pytest.mark.skipif(sys.platform == "darwin", reason="what is skipped off macOS")
def test_off_a_mac_the_check_is_skipped_with_core_mls_reason() -> None:
    check = run_doctor(checks=[("mask-ops", doctor.check_mask_ops)])[0]
    assert check.status == "skipped" and check.summary.startswith("unavailable: needs macOS")
    assert "mask form" not in to_lines([check])


def test_with_a_build_its_own_plan_places_the_ops(standin_children, coreml_build,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With --manifest the build's first layer shard is planned: its placement of the ops it
    holds is the one the advice rests on (a standalone probe may be placed otherwise)."""
    for key, value in standin_children.rules_env(
            plan_devices={"default": "NeuralEngine", "ops": {"equal": "GPU"}}).items():
        monkeypatch.setenv(key, value)
    check = run_doctor(coreml_build[0], checks=[("mask-ops", doctor.check_mask_ops)])[0]
    assert check.status == "passed", check.summary
    assert check.details["placement_source"] == dict.fromkeys(
        ("equal", "greater_equal", "select", "clip"), "shard 0-1")
    assert check.details["placement"]["equal"] == "GPU"
    assert check.details["recommended_mask_form"] == "additive"
    assert "equal on GPU" in check.details["reason"] and "plan of shard 0-1" in check.summary


@pytest.mark.parametrize("table, form", [
    ({"default": "NeuralEngine"}, "select"),
    ({"default": "NeuralEngine", "ops": {"select": "CPU"}}, "additive"),
])
def test_a_build_shard_s_plan_decides_the_advice(
        standin_children, coreml_build, monkeypatch: pytest.MonkeyPatch, table, form) -> None:
    """With --manifest the advice follows the build shard's plan both ways."""
    for key, value in standin_children.rules_env(plan_devices=table).items():
        monkeypatch.setenv(key, value)
    check = run_doctor(coreml_build[0], checks=[("mask-ops", doctor.check_mask_ops)])[0]
    assert check.status == "passed", check.summary
    assert check.details["recommended_mask_form"] == form, check.summary
