"""`--draft-units` on Core ML, through the stand-in (tests/coreml_standin.py): the draft model of
its own weights (the same vocabulary, other outputs) is loaded with the compute units it was
given, in its own process or in this one, and the output is plain greedy decoding's; with the MIL
interpreter `--draft-units` is refused before any draft is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ane_spec.cli import main
from ane_spec.decode.draft_setup import close_drafter, draft_spec, open_drafter
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.gates import open_pipeline

PROMPT = [21, 400, 77, 5, 9, 300, 12]


@pytest.fixture(scope="module")
def draft(coreml_draft: tuple[Path, Path]) -> tuple[Path, Path]:
    return coreml_draft


def _package_hashes(build_folder: Path) -> set[str]:
    """The digest of every package in a build: the compiled cache names each compiled model
    after it (runtime/compiled_cache.py), so a load's path says whose package it was."""
    found: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if str(node.get("path", "")).endswith(".mlpackage") and "blake3" in node:
                found.add(node["blake3"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(json.loads((build_folder / "manifest.json").read_text()))
    return found


def _units_of(log: Path, hashes: set[str]) -> tuple[set[str], set[str], set[str]]:
    """(compute units of the draft's loads, their reshape hints, the other loads' units)."""
    from tests import coreml_standin

    draft_units, hints, others = set(), set(), set()
    for load in coreml_standin.loads(log):
        if Path(load["url"]).stem in hashes:
            draft_units.add(load["compute_units"])
            hints.add(load["hints"].get("reshapeFrequency"))
        else:
            others.add(load["compute_units"])
    return draft_units, hints, others


def _log_loads(coreml_standin, monkeypatch: pytest.MonkeyPatch, log: Path) -> None:
    coreml_standin.set_rules(load_log=str(log))
    for key, value in coreml_standin.rules_env(load_log=str(log)).items():
        monkeypatch.setenv(key, value)


def test_drafts_on_the_gpu_and_cpu_units_equal_greedy(
        coreml_standin, coreml_build, draft, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--draft-units gpu` with the draft in its own process (which runs Core ML in a worker of
    its own), then `cpu` with the draft in this one: each loads every draft package with its
    units (CPU_AND_GPU, CPU_ONLY) and reshapeFrequency Frequent (the mixed shape: T=1 passes),
    the target keeps CPU_AND_NE, and the tokens are greedy's. The default units put the draft
    on the ANE in the fixed shape, as the target."""
    target_path, _ = coreml_build
    hashes = _package_hashes(draft[0])
    target = open_pipeline(target_path, "coreml", "fp32", verify=False)[1]
    ane = draft_spec(target, draft[0])
    assert (ane.compute_units, ane.decode_shape) == ("CPU_AND_NE", "fixed")
    options = GenerateOptions(max_tokens=12)
    greedy = DecodeSession(target).generate(PROMPT, options.model_copy(
        update={"speculative": False}))
    for units, process, expected in (("gpu", True, "CPU_AND_GPU"), ("cpu", False, "CPU_ONLY")):
        log = tmp_path / f"loads-{units}.jsonl"
        _log_loads(coreml_standin, monkeypatch, log)
        drafter = open_drafter(target, draft[0], units=units, mode="model", process=process,
                               measure=False)
        try:
            spec = DecodeSession(target, drafter=drafter).generate(PROMPT, options)
        finally:
            close_drafter(drafter)
        assert spec.tokens == greedy.tokens, units
        sources = spec.stats.to_dict()["draft_sources"]
        assert sources["model"]["passes"] == spec.stats.passes and sources["model"]["drafted"]
        draft_units, hints, others = _units_of(log, hashes)
        assert draft_units == {expected} and hints == {"Frequent"}, coreml_standin.loads(log)
        assert others <= {"CPU_AND_NE"}


def test_draft_units_with_the_interpreter_are_refused_before_the_draft_is_built(
        coreml_build, draft, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    target, _ = coreml_build
    monkeypatch.chdir(tmp_path)
    assert main(["generate", "--manifest", str(target), "--prompt", "x", "--max-tokens", "2",
                 "--backend", "mil", "--draft-model", str(draft[1]),
                 "--draft-units", "gpu"]) == 2
    err = capsys.readouterr().err
    assert "--draft-units picks Core ML compute units" in err and "Traceback" not in err
    assert "building" not in err and not (tmp_path / "local-artifacts").exists()


def test_the_doctor_measures_the_draft_beside_the_build(
        coreml_standin, coreml_build, draft, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`doctor --manifest M --draft-model D --draft-units gpu`: the draft-costs check runs in the
    doctor's worker, the draft in its own process on CPU_AND_GPU, and reports c_verify, c_draft
    and the overlap (the stand-in's times, said so); without --manifest the flag is refused."""
    from ane_spec.probes import doctor

    for key, value in coreml_standin.child_env().items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "loads.jsonl"
    _log_loads(coreml_standin, monkeypatch, log)
    monkeypatch.setattr(doctor, "CHECKS", [("environment", doctor.check_environment),
                                           ("draft-costs", doctor.check_draft_costs)])
    target, _ = coreml_build
    monkeypatch.chdir(tmp_path)
    assert main(["doctor", "--manifest", str(target), "--draft-model", str(draft[0]),
                 "--draft-units", "gpu", "--json"]) == 0
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    costs = checks["draft-costs"]
    assert costs["status"] == "passed", costs
    d = costs["details"]
    assert d["verify_ms"] > 0 and d["draft_ms"] > 0 and d["ratio"] > 0 and d["draft_units"] == "gpu"
    assert d["overlap"] is not None and 0 <= d["overlap"] <= 1
    assert costs["summary"].startswith("informational: a target pass ")
    assert "stand-in" in costs["summary"]
    draft_units, _, others = _units_of(log, _package_hashes(draft[0]))
    assert draft_units == {"CPU_AND_GPU"} and others <= {"CPU_AND_NE"}

    assert main(["doctor", "--draft-model", str(draft[0])]) == 2
    assert "give --manifest too" in capsys.readouterr().err
