"""`ane-spec doctor`: every check says passed, failed or skipped with a reason; here (no Core ML)
the interpreter and static checks run for real and the Core ML ones are skipped."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

from ane_spec.cli import main
from ane_spec.probes import doctor
from ane_spec.probes.doctor import CHECKS, Verdict, core_ml_check, run_doctor
from ane_spec.probes.doctor_report import to_markdown
from ane_spec.shards.build import BuildRequest, build

ON_MAC = sys.platform == "darwin"
CORE_ML_PROBES = {"neural-engine", "synthetic-t4 d1024 (Core ML)", "synthetic-t4 phi (Core ML)",
                  "mask-ops"}
CORE_ML_BUILD = {"residency", "cold-jit", "warm-latency", "peak-memory", "state-reads",
                 "draft-costs", "ane-vs-cpu"}
CORE_ML_ONLY = CORE_ML_PROBES | CORE_ML_BUILD
MODEL_CHECKS = {"row-invariance", "overflow", "block", "drift", "parity", "prefill"}
BUILD_FIGURES = {"kv-slots", "activation-range"}


@pytest.fixture(scope="module")
def build_dir(tiny_gguf_conditioned: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("doctor") / "art"
    build(tiny_gguf_conditioned, out, BuildRequest(topology="3", max_seq=64))
    return out


def by_name(checks) -> dict:
    return {c.name: c for c in checks}


@pytest.mark.skipif(ON_MAC, reason="what is skipped off macOS")
def test_without_a_build_runs_what_runs_here() -> None:
    checks = by_name(run_doctor())
    assert list(checks) == [name for name, _ in CHECKS]
    for name in ("environment", "fp16-only", "ane-lint", "synthetic-t4 tiny (interpreter fp16)"):
        assert checks[name].status == "passed", checks[name]
    env = checks["environment"].details
    assert env["decode_shape"] == "fixed" and env["reshape_frequency"] == "Infrequent"
    assert env["core_ml"].startswith("unavailable: needs macOS 15 (this is linux)")
    assert "1 package(s)" in checks["fp16-only"].summary  # the d1024 probe package, built here
    for name in CORE_ML_PROBES:
        assert checks[name].status == "skipped"
        assert checks[name].summary.startswith("unavailable: needs macOS 15 (this is linux)")
    assert "a Core ML check" in checks["synthetic-t4 phi (Core ML)"].summary
    for name in MODEL_CHECKS | CORE_ML_BUILD | BUILD_FIGURES:
        assert checks[name].status == "skipped" and checks[name].summary == (
            "needs --manifest (a build)")


@pytest.mark.skipif(ON_MAC, reason="what is skipped off macOS")
def test_with_a_build_json_and_markdown(build_dir: Path, tmp_path: Path, capsys) -> None:
    report = tmp_path / "REPORT.md"
    code = main(["doctor", "--manifest", str(build_dir), "--json", "--out", str(report),
                 "--decode-shape", "mixed"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    checks = {c["name"]: c for c in out["checks"]}
    assert [c["name"] for c in out["checks"]] == [name for name, _ in CHECKS]
    assert all(c["status"] in ("passed", "failed", "skipped") and c["summary"]
               for c in out["checks"])
    assert out["environment"]["reshape_frequency"] == "Frequent"  # the mixed decode shape
    for name in MODEL_CHECKS | {"fp16-only", "ane-lint"}:
        assert checks[name]["status"] == "passed", checks[name]
    assert checks["fp16-only"]["summary"].startswith("2 package(s)")
    assert checks["row-invariance"]["details"]["backend"] == "mil"
    assert checks["drift"]["summary"].startswith("[mil/fp16/mixed]")
    assert checks["parity"]["details"]["min_cosine"] >= 0.999
    for name in CORE_ML_ONLY:
        assert checks[name]["status"] == "skipped"
        assert checks[name]["summary"].startswith("unavailable: needs macOS 15"), checks[name]
    # The K/V states of one conversation against the ANE budget: S=256 tiny states are tiny.
    assert checks["kv-slots"]["status"] == "passed"
    assert checks["kv-slots"]["details"]["ane_slots"] > 100
    assert "resident slots fit" in checks["kv-slots"]["summary"]
    # The build's calibration: the conditioned tiny model's stream is far inside fp16.
    act = checks["activation-range"]
    assert act["status"] == "passed" and act["summary"].startswith("residual scale: 2^0 (auto)")
    assert act["details"]["calibration"]["residual_margin"] > 100
    # decode-shape (mixed, no Core ML here) and argmax-head (a logits build) skip too.
    assert out["counts"] == {"passed": 12, "failed": 0, "skipped": 13}

    markdown = report.read_text()
    assert markdown.startswith("## ane-spec doctor") and "| parity | passed |" in markdown
    # Pastes into an issue: a few header lines and one table row per check.
    # (5,000 characters: the first line names the Python and why the native bridge did not
    # load, and the prefill check states both functions' costs)
    assert len(markdown.splitlines()) <= len(CHECKS) + 10 and len(markdown) < 5000


def test_a_failing_check_fails_the_command(tiny_gguf_conditioned: Path, tmp_path: Path,
                                           capsys) -> None:
    """q8-block weights carry per-block scales, a pattern known to leave the ANE."""
    out = tmp_path / "q8"
    build(tiny_gguf_conditioned, out, BuildRequest(topology="3", max_seq=64, weights="q8-block"))
    only = [c for c in CHECKS if c[0] in ("fp16-only", "ane-lint")]
    checks = by_name(run_doctor(out, checks=only))
    assert checks["fp16-only"].status == "passed"
    lint = checks["ane-lint"]
    assert lint.status == "failed" and "per-block-scales" in lint.summary
    assert to_markdown(list(checks.values()), str(out)).count("| failed |") == 1


def test_a_crashing_check_is_a_failure_and_the_rest_still_run() -> None:
    def boom(run) -> Verdict:
        raise RuntimeError("kaput\nsecond line")

    checks = run_doctor(checks=[("boom", boom), ("environment", doctor.check_environment)])
    assert [(c.name, c.status) for c in checks] == [("boom", "failed"), ("environment", "passed")]
    assert checks[0].summary == "error: RuntimeError: kaput"


def test_an_old_mac_is_skipped_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import coremltools.models.utils as ct_utils

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ct_utils, "_macos_version", lambda: (14, 6))
    only = [c for c in CHECKS if c[0] in ("neural-engine", "synthetic-t4 d1024 (Core ML)")]
    checks = run_doctor(checks=only)
    assert [c.status for c in checks] == ["skipped", "skipped"]
    assert checks[0].summary == ("unavailable: needs macOS 15 (this is macOS 14.6): this check "
                                 "needs Core ML")


def test_bad_arguments_are_clear_errors(tmp_path: Path, capsys) -> None:
    assert main(["doctor", "--manifest", str(tmp_path)]) == 2
    assert "no manifest here" in capsys.readouterr().err


@pytest.mark.skipif(not ON_MAC, reason="the Core ML checks need macOS 15 and a Neural Engine")
def test_on_a_mac_every_core_ml_check_runs(build_dir: Path) -> None:
    checks = by_name(run_doctor(build_dir))
    assert checks["environment"].details["core_ml"] == "available"
    for name in CORE_ML_ONLY | MODEL_CHECKS:
        assert not checks[name].summary.startswith("error:"), checks[name]
        assert checks[name].status != "skipped" or name in ("parity", "draft-costs"), \
            checks[name]
    assert "first predictions" in checks["cold-jit"].summary
    assert set(checks["residency"].details) == {"shard 0-2", "shard 0-2 prefill", "head",
                                                "planned_t", "planned_prefill_t"}


# --- through the Core ML stand-in (tests/coreml_standin.py) -----------------------------------

HARDWARE = {"synthetic-t4 d1024 (Core ML)", "synthetic-t4 phi (Core ML)",
            "residency", "cold-jit", "warm-latency", "peak-memory", "ane-vs-cpu"}


@pytest.fixture
def standin_everywhere(coreml_standin, monkeypatch: pytest.MonkeyPatch):
    """The stand-in in this process and in the doctor's worker children (sitecustomize)."""
    for key, value in coreml_standin.child_env().items():
        monkeypatch.setenv(key, value)
    return coreml_standin


def test_doctor_end_to_end_through_the_standin(build_dir: Path, tmp_path: Path,
                                               standin_everywhere, capsys) -> None:
    """`ane-spec doctor --manifest M --out R.md` with Core ML's native layer replaced: the real
    Core ML path runs in the worker child; what needs Apple hardware is skipped, saying why."""
    report = tmp_path / "R.md"
    code = main(["doctor", "--manifest", str(build_dir), "--out", str(report)])
    assert code == 0, capsys.readouterr()
    body = json.loads(report.with_suffix(".json").read_text())
    checks = {c["name"]: c for c in body["checks"]}
    assert list(checks) == [name for name, _ in CHECKS]
    assert body["environment"]["core_ml"] == "available"
    for name in HARDWARE:
        assert checks[name]["status"] == "skipped", checks[name]
        assert "needs Apple hardware" in checks[name]["summary"], checks[name]
    assert "structure only" in checks["residency"]["summary"]
    # mask-ops computes on the stand-in; with no plan table, placement and advice are unknown.
    assert checks["mask-ops"]["status"] == "passed", checks["mask-ops"]
    assert body["mask_form"]["mask_form"] is None and "select unplanned" in checks[
        "mask-ops"]["summary"]
    # MLComputeDevice.get_all_compute_devices() runs through the stand-in, which says so.
    assert checks["neural-engine"]["status"] == "passed", checks["neural-engine"]
    assert checks["neural-engine"]["summary"].startswith("Neural Engine with 16 cores (device "
                                                         "list from a stand-in")
    for name in MODEL_CHECKS | BUILD_FIGURES | {"environment", "fp16-only", "ane-lint"}:
        assert checks[name]["status"] == "passed", checks[name]
    # The model checks ran on Core ML (the stand-in), not on the interpreter fallback.
    assert checks["row-invariance"]["details"]["backend"] == "coreml"
    assert checks["drift"]["summary"].startswith("[coreml")
    # The block gate's T=1 rows switch shapes on the Infrequent-hinted shard: counted.
    assert body["cost"]["shape_switches"] >= 1 and body["cost"]["seconds"] > 0
    markdown = report.read_text()
    assert "| row-invariance | passed |" in markdown and "shape switch" in markdown
    assert checks["decode-shape"]["status"] == "passed"  # fixed: Infrequent
    assert "Infrequent" in checks["decode-shape"]["summary"]
    # 1,000 reads of a K state in the Core ML worker leave its RSS where it was.
    assert checks["state-reads"]["status"] == "passed", checks["state-reads"]
    assert checks["draft-costs"]["status"] == "skipped"  # no --draft-model
    assert checks["draft-costs"]["summary"].startswith("needs --draft-model")


def test_mixed_decode_shape_is_measured_off_the_ane(build_dir: Path, standin_everywhere) -> None:
    """Issue 28 item 5: mixed loads with reshapeFrequency Frequent; the doctor says it is
    expected off the ANE and measures where it runs. The stand-in's Frequent + RangeDim +
    CPU_AND_NE rule reports "not on the ANE" for every package, so the verdict is "failed"."""
    checks = by_name(run_doctor(build_dir, decode_shape="mixed", checks=[
        ("environment", doctor.check_environment),
        ("decode-shape", doctor.check_decode_shape_placement)]))
    env = checks["environment"]
    assert "expected off the ANE" in env.summary and "#2600" in env.details["expected_placement"]
    c = checks["decode-shape"]
    assert c.status == "failed", c
    assert "runs off the ANE under reshapeFrequency Frequent, as expected" in c.summary
    assert "flexible-input guide" in c.summary and "#2600" in c.summary
    assert c.details["off_ane"] == ["head", "shard 0-2"]
    assert all("not on the ANE" in where for where in c.details["placement"].values())
    fixed = by_name(run_doctor(build_dir, decode_shape="fixed", checks=[
        ("decode-shape", doctor.check_decode_shape_placement)]))["decode-shape"]
    assert fixed.status == "passed" and "Infrequent" in fixed.summary


def test_mixed_decode_shape_help_says_it_is_expected_off_the_ane(capsys) -> None:
    for command in (["generate", "--help"], ["doctor", "--help"]):
        with pytest.raises(SystemExit):
            main(command)
        text = " ".join(capsys.readouterr().out.split())
        assert "Frequent" in text and "#2600" in text and "off the ANE" in text.replace(
            "OFF", "off"), command


@core_ml_check
def kill_self(run) -> Verdict:
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@core_ml_check
def worker_pid(run) -> Verdict:
    return Verdict("passed", f"pid {os.getpid()}", {"pid": os.getpid()})


def test_a_native_crash_is_reported_and_later_checks_still_run(standin_everywhere,
                                                               tmp_path: Path) -> None:
    """A check whose process dies of a signal (as a libc++ abort or a segfault in Core ML
    would) reads `crashed: signal N during <check>`; the report is on disk after every check;
    the next Core ML check gets a fresh worker."""
    from ane_spec.probes.doctor_report import to_json, write_atomically

    snapshots = []

    def save(done) -> None:
        write_atomically(tmp_path / "R.json", to_json(done, None))
        snapshots.append(json.loads((tmp_path / "R.json").read_text())["counts"])

    checks = run_doctor(checks=[("pid", worker_pid), ("kill-self", kill_self),
                                ("environment", doctor.check_environment),
                                ("pid again", worker_pid)], on_check=save)
    assert [(c.name, c.status) for c in checks] == [
        ("pid", "passed"), ("kill-self", "failed"), ("environment", "passed"),
        ("pid again", "passed")]
    assert checks[1].summary == f"crashed: signal {int(signal.SIGKILL)} during kill-self"
    pids = {checks[0].details["pid"], checks[3].details["pid"], os.getpid()}
    assert len(pids) == 3  # two workers, neither of them this process
    assert [sum(s.values()) for s in snapshots] == [1, 2, 3, 4]


def test_ane_vs_cpu_warns_on_small_macs() -> None:
    from ane_spec.probes.doctor import small_mac_warning

    assert "16 GB" in small_mac_warning(16 * 10**9) and "second full copy" in small_mac_warning(
        8 * 10**9)
    assert small_mac_warning(32 * 10**9) is None and small_mac_warning(None) is None


@pytest.mark.parametrize("where", ["interpreter", "standin"])
def test_argmax_head_agrees_with_a_logits_head(tiny_gguf_conditioned: Path,
                                               tmp_path_factory: pytest.TempPathFactory,
                                               request: pytest.FixtureRequest,
                                               where: str) -> None:
    """Issue 28 item 3: the doctor builds a logits head beside a --head-argmax build and
    compares ids on the same hidden states (on Core ML - the stand-in - or the interpreter)."""
    if where == "standin":
        request.getfixturevalue("standin_everywhere")
    out = tmp_path_factory.mktemp("argmax") / "art"
    build(tiny_gguf_conditioned, out, BuildRequest(topology="3", max_seq=64, head_argmax=True))
    check = by_name(run_doctor(out, checks=[("argmax-head", doctor.check_argmax_head)]))[
        "argmax-head"]
    assert check.status == "passed", check
    assert check.details["rows"] == 64 and check.details["agree"] == 64, check
    assert check.details["widest_chunk"] <= 16384
    assert check.summary.startswith("argmax head agrees with a logits head on ")
    assert ("Core ML" in check.details["backend"]) == (where == "standin"), check.details
    logits = by_name(run_doctor(request.getfixturevalue("build_dir"), checks=[
        ("argmax-head", doctor.check_argmax_head)]))["argmax-head"]
    assert logits.status == "skipped" and "not a --head-argmax build" in logits.summary


@pytest.mark.parametrize("cpu_ms,status", [(11.0, "failed"), (40.0, "passed")])
def test_mixed_decode_shape_on_a_mac_is_timed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                              cpu_ms: float, status: str) -> None:
    """On real Core ML (no placement reported) the verdict comes from the clock: T=1 on
    CPU_AND_NE under Frequent against CPU_ONLY, from warm-latency and ane-vs-cpu."""
    from ane_spec.runtime import coreml_backend

    monkeypatch.setattr(coreml_backend, "hardware_problem", lambda: None)
    monkeypatch.setattr(doctor.DoctorRun, "need_build_on_coreml", lambda self: None)
    run = doctor.DoctorRun(None, tmp_path, "mixed")
    run.measurements = {"CPU_AND_NE": {"t1_ms": 10.0}, "CPU_ONLY": {"t1_ms": cpu_ms}}
    verdict = doctor.check_decode_shape_placement(run)
    assert verdict.status == status, verdict
    assert "timed: T=1 CPU_AND_NE 10.0 ms" in verdict.summary and "#2600" in verdict.summary
    run.measurements = {}
    with pytest.raises(doctor.Skip, match="no T=1 timings"):
        doctor.check_decode_shape_placement(run)


# --- state reads leave nothing behind (issue 35) ----------------------------------------------

def state_reads(build: Path, work: Path) -> Verdict:
    """The check, called here rather than in the doctor's worker child (the end-to-end test
    above runs it there): one process start fewer. The Core ML worker it starts, where the
    states and the RSS watched live, is still a child with the stand-in's rules."""
    from ane_spec.manifests.store import load_manifest

    run = doctor.DoctorRun(load_manifest(build), work)
    try:
        return doctor.run_one(doctor.check_state_reads, run)
    finally:
        run.pipelines["CPU_AND_NE"].backend.close()


def test_state_reads_keep_the_core_ml_workers_memory_flat(tiny_build_512: Path, tmp_path: Path,
                                                         standin_everywhere) -> None:
    """1,000 reads of layer 0's K state through the slot-capture path, in the Core ML worker
    (the stand-in's readState autoreleases a copy of the state per read, freed by the pool
    runtime/autorelease.py opens): the worker's RSS stays well under the bound."""
    check = state_reads(tiny_build_512, tmp_path)
    assert check.status == "passed", check
    d = check.details
    assert d["where"] == "Core ML worker" and d["state"] == "layer_0_k"
    assert tuple(d["shape"]) == (1, 2, 512, 32) and d["state_bytes"] == 64 << 10
    assert d["reads"] == 1000 and d["bound_bytes"] == 32 << 20 and d["reads_per_s"] > 0
    assert d["growth_bytes"] < 8 << 20, d  # a leak of a copy a read would be 62.5 MiB
    assert d["rss_before"] > 0 and d["rss_after"] > 0
    assert check.summary.startswith("Core ML worker RSS ") and "reads/s" in check.summary
    assert "stand-in" in check.summary


def test_state_reads_fail_when_each_read_leaks_a_copy(tiny_build_512: Path, tmp_path: Path,
                                                      standin_everywhere,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in's `leak_reads`: each read's copy is never freed, as with no autorelease pool
    around readState on the worker's thread. 1,000 reads grow the worker by 1,000 copies."""
    for key, value in standin_everywhere.rules_env(leak_reads=True).items():
        monkeypatch.setenv(key, value)
    check = state_reads(tiny_build_512, tmp_path)
    assert check.status == "failed", check
    d = check.details
    assert d["growth_bytes"] >= d["bound_bytes"] and d["bytes_per_read"] >= 0.9 * (64 << 10), d
    assert re.match(r"Core ML worker RSS grew \d+\.\d MiB over 1,000 reads of layer_0_k: "
                    r"\+[\d,]+ B per read \(bound 32\.0 MiB", check.summary), check.summary


# --- the prefill function (issue 33) ----------------------------------------------------------

def test_prefill_check_through_the_standin(build_dir: Path, standin_everywhere,
                                           monkeypatch) -> None:
    """On Core ML (the stand-in, in the doctor's worker child): c(P)/c(4), prefill tok/s and the
    first pass of each function, each first pass paying the stand-in's per-shape first-call
    cost; it says the timings are not the device's, and what only a Mac can tell."""
    for key, value in standin_everywhere.rules_env(first_call_seconds=0.3).items():
        monkeypatch.setenv(key, value)
    check = by_name(run_doctor(build_dir, checks=[("prefill", doctor.check_prefill)]))["prefill"]
    assert check.status == "passed", check
    d = check.details
    assert d["prefill_t"] == 64 and d["decode_t"] == 4 and d["ratio"] > 0, d
    assert d["prefill_tok_s"] > 0 and d["decode_tok_s"] > 0
    assert list(d["jit_s"]) == ["decode T=4", "prefill T=64"], d["jit_s"]
    assert d["jit_s"]["decode T=4"] >= 0.6 and d["jit_s"]["prefill T=64"] >= 0.3  # 2 + 1 first
    assert check.summary.startswith("prefill T=64: c(P)/c(4) ")
    assert "prompt tok/s through the prefill function" in check.summary
    assert "first passes (JIT): decode T=4 " in check.summary
    assert "Core ML (CPU_AND_NE" in d["backend"]
    assert "not the device's figures" in check.summary and "needs Apple hardware" in (
        d["not_the_device"])
    assert "only a Mac's Neural Engine tells the real c(P)/c(4)" in check.summary


@pytest.mark.skipif(ON_MAC, reason="the interpreter fallback is what runs off macOS")
def test_prefill_check_on_the_interpreter_says_so(build_dir: Path) -> None:
    check = by_name(run_doctor(build_dir, checks=[("prefill", doctor.check_prefill)]))["prefill"]
    assert check.status == "passed", check
    assert "timed on the fp16 MIL interpreter (unavailable: needs macOS 15" in check.summary
    assert check.details["backend"].startswith("MIL") and check.details["jit_s"]


@pytest.mark.parametrize("prefill_s,status", [(0.5, "failed"), (0.03, "passed")])
def test_prefill_check_on_a_mac_fails_where_the_prefill_function_does_not_pay(
        build_dir: Path, tmp_path: Path, monkeypatch, prefill_s: float, status: str) -> None:
    """On Core ML proper the verdict is the clock's: a 64-row pass dearer than the 16 decode
    passes it replaces fails (auto never uses it). The measurement and cold-jit's record stand
    for a Mac's (only a Mac has them)."""
    from ane_spec.decode import prefill_plan
    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime import coreml_backend

    monkeypatch.setattr(coreml_backend, "hardware_problem", lambda: None)
    monkeypatch.setattr(prefill_plan, "measure", lambda pipeline: prefill_plan.PrefillCosts(
        64, 4, 0.010, prefill_s, prefill_s + 0.001))
    run = doctor.DoctorRun(load_manifest(build_dir), tmp_path)
    run.__dict__["coreml_problem"] = None  # as on a Mac
    run.pipelines["CPU_AND_NE"] = doctor.DoctorRun(run.build, tmp_path).pipeline()
    run.measurements["first_prediction_s"] = {"shard 0-2": {"T=4": 2.5, "prefill T=64": 4.0},
                                              "head": {"T=4": 0.5}}
    verdict = doctor.check_prefill(run)
    assert verdict.status == status, verdict
    assert verdict.details["jit_s"] == {"decode T=4": 3.0, "prefill T=64": 4.0}
    assert "first passes (JIT): decode T=4 3.00s, prefill T=64 4.00s" in verdict.summary
    assert "not the device" not in verdict.summary
    if status == "failed":
        assert "costs more than the 16 decode passes it replaces" in verdict.summary


def test_prefill_check_skips_a_build_without_a_prefill_function(build_dir: Path,
                                                                tmp_path: Path) -> None:
    from ane_spec.manifests.store import load_manifest

    loaded = load_manifest(build_dir)
    build = loaded.manifest.build.model_copy(update={"prefill_t": 0, "prefill_function": None})
    loaded.manifest = loaded.manifest.model_copy(update={"build": build})
    verdict = doctor.run_one(doctor.check_prefill, doctor.DoctorRun(loaded, tmp_path))
    assert verdict.status == "skipped" and "no prefill function" in verdict.summary


def test_the_first_line_names_the_python_and_whether_the_native_bridge_loaded(
        coreml_standin) -> None:
    """Off macOS the bridge is missing (its reason named); on the stand-in it is loaded."""
    import platform

    from ane_spec.probes.doctor_report import to_lines

    def first_line() -> str:
        checks = run_doctor(checks=[("environment", doctor.check_environment)])
        return to_lines(checks).splitlines()[0]

    assert first_line().startswith(
        f"PASS  environment: Python {platform.python_version()}, Core ML native bridge loaded;")


def test_off_a_mac_the_first_line_says_the_bridge_did_not_load() -> None:
    import platform

    from ane_spec.probes.doctor_report import to_lines

    checks = run_doctor(checks=[("environment", doctor.check_environment)])
    line = to_lines(checks).splitlines()[0]
    assert f"environment: Python {platform.python_version()}, Core ML native bridge not loaded (" \
        in line


def test_install_refuses_python_3_14() -> None:
    """coremltools 9.0 has macOS wheels for CPython 3.10-3.13 only; on 3.14 pip would install
    its sdist without the native libraries, so the project refuses that Python at install."""
    import tomllib

    from packaging.specifiers import SpecifierSet

    spec = SpecifierSet(tomllib.loads((Path(__file__).parents[1] / "pyproject.toml")
                                      .read_text())["project"]["requires-python"])
    assert [v in spec for v in ("3.10", "3.11", "3.12", "3.13", "3.14", "3.15")] == [
        True, True, True, True, False, False]
