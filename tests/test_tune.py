"""`ane-spec tune` (issue 35 item 1): every open variant built, measured in its own process and
reported; tune.json written; `ane-spec build --tuned` applies it, explicit flags winning; a
variant that crashes, hangs or raises costs its own row only.

The end-to-end run goes through the Core ML backend on the stand-in (tests/coreml_standin.py,
which computes with the interpreter: its timings mean nothing), with one variant's head made to
kill its Core ML worker at its first prediction, as a failed ANE compile does (coremltools
#2758). The isolation tests run on the interpreter backend, the product's path on Linux, with a
measuring function that dies, hangs or raises for one variant each.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from ane_spec.bench import tune as tune_mod
from ane_spec.bench.tune import VariantJob, choose, measure_variant, plan_variants, run_tune
from ane_spec.bench.tune_model import DIMENSIONS, FLAGS, Check, VariantResult, load_tune
from ane_spec.bench.tune_report import write_tune
from ane_spec.bench import tune_source
from ane_spec.bench.tune_source import DEFAULTS
from ane_spec.shards.build import BuildRequest, build
from ane_spec.cli import BITS_CHOICES, DIMENSION_CHOICES, main
from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import load_manifest
from ane_spec.runtime.compiled_cache import CACHE_ENV
from ane_spec.model.synthetic import preset, write_synthetic_gguf


def _tune(args: list[str]) -> tuple[str, str]:
    import contextlib
    import io

    stdout, stderr = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(["tune", *args])
    print(f"tune {' '.join(args)}: {time.monotonic() - started:.0f} s")
    assert code == 0, stderr.getvalue()[-2000:]
    return stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def standin_tune(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """`ane-spec tune` through the command line on the Core ML backend and the stand-in: a
    1-layer tiny model, the head layout and the K/V write (3 variants), 3 timed passes. The
    first prefill prediction of the run kills its Core ML worker, as a failed ANE compile does
    (coremltools #2758): the baseline's."""
    from tests import coreml_standin

    out = tmp_path_factory.mktemp("tune") / "out"
    patch = pytest.MonkeyPatch()
    try:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("tune-cache")))
        coreml_standin.install(patch)
        env = coreml_standin.child_env() | coreml_standin.rules_env(
            kill_at_first_predict="#prefill", kill_once_file=str(out.parent / "killed"))
        for key, value in env.items():
            patch.setenv(key, value)
        stdout, stderr = _tune(["--out", str(out), "--preset", "tiny", "--layers", "1",
                                "--max-seq", "64", "--backend", "coreml", "--reps", "3",
                                "--warmup", "1", "--bits", "interpreter", "--deadline", "300",
                                "--dimensions", "head_layout,kv_write"])
    finally:
        patch.undo()
    return out, stdout, stderr


def test_tune_on_the_interpreter_reports_every_variant(tmp_path: Path) -> None:
    """The product's path on Linux: every variant of every choice built, measured in its own
    process and reported; the timings said to be the interpreter's."""
    out = tmp_path / "out"
    stdout, stderr = _tune(["--out", str(out), "--preset", "tiny", "--layers", "1",
                            "--max-seq", "128", "--backend", "mil", "--reps", "3",
                            "--warmup", "1", "--bits", "interpreter"])
    result = load_tune(out / "tune.json")
    names = [r.name for r in result.variants]
    assert names == ["baseline", "mask_form=additive", "layout=BC1T", "head_layout=vocab-last",
                     "prefill_t=16", "prefill_t=32", "prefill_t=128", "kv_write=slice"]
    for row in result.variants:
        assert row.outcome == "ok", (row.name, row.reason)
        assert row.decode_ms > 0 and row.prefill_ms_per_token > 0
        assert row.options["prefill_t"] * row.prefill_ms_per_token == pytest.approx(
            row.prefill_ms, rel=1e-3)
        assert row.placement.startswith("not measured: the MIL interpreter has no placement")
        [check] = row.checks
        assert check.passed is None and "the backend is the interpreter itself" in check.summary
    assert set(result.choices) == set(DIMENSIONS)
    assert result.timings.startswith("the fp16 MIL interpreter") and "NOT the device" in \
        result.timings
    assert all("interpreter, not the device" in c.rests_on for c in result.choices.values())
    page = (out / "tune.md").read_text()
    assert "NOT the device's" in page
    for name in names:
        assert f"| {name} |" in page
    assert "prefill time per prompt token, ms:" in page
    assert (out / "tune.png").stat().st_size > 1000  # matplotlib is installed here
    assert not (out / "variants").exists()  # the variants' builds and the model are removed
    assert "not the Neural Engine's" in stderr and "timings are the interpreter's" in stdout


def test_tune_through_core_ml_measures_and_checks_each_variant(standin_tune) -> None:
    out, stdout, _ = standin_tune
    result = load_tune(out / "tune.json")
    assert [r.name for r in result.variants] == ["baseline", "head_layout=vocab-last",
                                                 "kv_write=slice"]
    # The baseline's Core ML worker died under it: its row says so, the others ran.
    dead, *rows = result.variants
    assert dead.outcome == "crashed" and dead.build_seconds > 0, dead
    assert dead.reason.startswith("the Core ML worker died (signal 9 (SIGKILL))"), dead.reason
    for row in rows:
        assert row.outcome == "ok", (row.name, row.reason)
        assert row.decode_ms > 0 and row.prefill_ms > 0
        # Through the stand-in the logits are the interpreter's bit for bit.
        [check] = row.checks
        assert check.name == "interpreter" and check.passed, check
        assert "bitwise-equal rows 12/12" in check.summary
        # The stand-in's compute plan has no devices: placement unknown, and said.
        assert row.placement.startswith("unknown"), row.placement
    assert set(result.choices) == {"head_layout", "kv_write"}
    # With the default crashed, the alternative that passed is the choice, and it says why.
    for d, value in (("head_layout", "vocab-last"), ("kv_write", "slice")):
        choice = result.choices[d]
        assert choice.value == value and "(the only one that passed)" in choice.rests_on
        assert "crashed (the Core ML worker died" in choice.rests_on
    assert result.backend.startswith("coreml") and result.timings.startswith("Core ML")
    assert "tune.json" in stdout and "--tuned" in stdout


def test_build_tuned_applies_the_choices_and_explicit_flags_win(
        standin_tune, tmp_path: Path) -> None:
    out, _, _ = standin_tune
    tuned = load_tune(out / "tune.json")
    # Choices that differ from every default, so applying them shows in the manifest.
    data = json.loads((out / "tune.json").read_text())
    wanted = {"mask_form": "additive", "layout": "BC1T", "head_layout": "vocab-last",
              "prefill_t": 32, "kv_write": "slice"}
    for d, v in wanted.items():  # the run chose two of them; the file may hold all five
        data["choices"][d] = {"value": v, "flag": FLAGS[d], "rests_on": "edited", "measured": True}
    edited = tmp_path / "tune.json"
    edited.write_text(json.dumps(data))
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset("tiny", num_layers=1))
    assert main(["build", str(gguf), "--out", str(tmp_path / "a"), "--max-seq", "64",
                 "--tuned", str(edited)]) == 0
    b = load_manifest(tmp_path / "a").manifest.build
    assert {d: getattr(b, d) for d in wanted} == wanted
    # Explicit flags win over the file, and the rest still come from it.
    assert main(["build", str(gguf), "--out", str(tmp_path / "b"), "--max-seq", "64",
                 "--tuned", str(edited), "--kv-write", "scatter", "--layout", "BCT1"]) == 0
    b = load_manifest(tmp_path / "b").manifest.build
    assert (b.kv_write, b.layout) == ("scatter", "BCT1")
    assert (b.mask_form, b.head_layout, b.prefill_t) == ("additive", "vocab-last", 32)
    # The file the run wrote applies as it is.
    assert main(["build", str(gguf), "--out", str(tmp_path / "c"), "--max-seq", "64",
                 "--tuned", str(out / "tune.json")]) == 0
    b = load_manifest(tmp_path / "c").manifest.build
    assert {d: getattr(b, d) for d in tuned.choices} == tuned.build_options()


def test_build_tuned_says_what_it_applied_and_what_a_flag_overrode(
        standin_tune, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out, _, _ = standin_tune
    data = json.loads((out / "tune.json").read_text())
    data["choices"]["kv_write"]["value"] = "slice"
    edited = tmp_path / "tune.json"
    edited.write_text(json.dumps(data))
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset("tiny", num_layers=1))
    assert main(["build", str(gguf), "--out", str(tmp_path / "a"), "--max-seq", "64",
                 "--tuned", str(edited), "--kv-write", "scatter"]) == 0
    err = capsys.readouterr().err
    assert "--kv-write scatter given: it wins over" in err and "'s slice" in err
    assert "tuned: --head-layout" in err


@pytest.mark.parametrize("content, message", [
    ("{", "not a readable JSON file"),
    ('{"version": 1}', "not a tune.json of this ane-spec"),
])
def test_a_bad_tune_json_is_one_line(tmp_path: Path, content: str, message: str,
                                     capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "tune.json"
    bad.write_text(content)
    with pytest.raises(AneSpecError, match=message):
        load_tune(bad)
    assert main(["build", "x.gguf", "--out", str(tmp_path / "o"), "--tuned", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not (tmp_path / "o").exists()


def test_a_tuned_value_outside_the_flags_choices_is_refused(standin_tune, tmp_path: Path) -> None:
    out, _, _ = standin_tune
    data = json.loads((out / "tune.json").read_text())
    data["choices"]["prefill_t"] = data["choices"]["kv_write"] | {"value": 4096}
    bad = tmp_path / "tune.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(AneSpecError, match="prefill_t 4096 is not one of 16, 32, 64, 128"):
        load_tune(bad)


# --- isolation ----------------------------------------------------------------------------


DEADLINE = 60


def misbehaving_measure(job: VariantJob, progress) -> dict:  # noqa: ANN001
    """Runs in the variant's process: dies, hangs or raises for one variant each."""
    if job.name == "layout=BC1T":
        os._exit(3)
    if job.name == "kv_write=slice":
        time.sleep(600)
    if job.name == "mask_form=additive":
        raise ValueError("a conversion refused this variant")
    return measure_variant(job, progress)


def test_a_variant_that_dies_hangs_or_raises_costs_only_its_row(tmp_path: Path) -> None:
    """Rows in order: baseline (measured), additive (raises), BC1T (its process exits), the
    vocab-last head (measured, after the death), slice (hangs past the deadline). The deadline
    leaves a real variant's spawn, build and load room on a loaded machine."""
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset("tiny", num_layers=1))
    request = {"topology": "1", "max_seq": 64, "residual_scale": "off", **DEFAULTS}
    started = time.monotonic()
    result = run_tune(gguf, tmp_path / "out", request, backend="mil", backend_label="mil",
                      source="test", reps=2, warmup=0, deadline_s=DEADLINE, bits=[],
                      dimensions=["mask_form", "layout", "head_layout", "kv_write"],
                      measure=misbehaving_measure)
    print(f"{time.monotonic() - started:.0f} s")
    rows = {r.name: r for r in result.variants}
    assert list(rows) == ["baseline", "mask_form=additive", "layout=BC1T",
                          "head_layout=vocab-last", "kv_write=slice"]
    for name in ("baseline", "head_layout=vocab-last"):
        assert rows[name].outcome == "ok" and rows[name].decode_ms > 0, rows[name]
    assert rows["layout=BC1T"].outcome == "crashed"
    assert rows["layout=BC1T"].reason == "its process died (exit code 3)"
    assert rows["kv_write=slice"].outcome == "hung"
    assert f"{DEADLINE} s deadline" in rows["kv_write=slice"].reason
    assert DEADLINE <= rows["kv_write=slice"].seconds < DEADLINE + 30
    assert rows["mask_form=additive"].outcome == "error"
    assert "ValueError: a conversion refused this variant" in rows["mask_form=additive"].reason
    # Nothing else passed in those dimensions: the defaults stand, and the file says why.
    for d in ("mask_form", "layout", "kv_write"):
        assert result.choices[d].value == DEFAULTS[d]
    assert "slice hung" in result.choices["kv_write"].rests_on
    json_path, md_path = write_tune(result, tmp_path / "out")
    assert load_tune(json_path).variants[2].outcome == "crashed"
    assert "| layout=BC1T | crashed: its process died (exit code 3) |" in md_path.read_text()


def test_a_variant_computing_wrong_is_reported_wrong(tmp_path: Path) -> None:
    """A check that fails makes the row `wrong`, and a wrong variant never wins."""
    rows = [
        VariantResult(name="baseline", dimension=None, options=dict(DEFAULTS), outcome="ok",
                      decode_ms=10.0, prefill_ms=64.0, prefill_ms_per_token=1.0),
        VariantResult(name="kv_write=slice", dimension="kv_write",
                      options=DEFAULTS | {"kv_write": "slice"}, outcome="wrong",
                      reason="failed: overflow (FAIL)", decode_ms=1.0,
                      checks=[Check(name="overflow", passed=False, summary="FAIL")]),
        VariantResult(name="layout=BC1T", dimension="layout",
                      options=DEFAULTS | {"layout": "BC1T"}, outcome="ok", decode_ms=9.7),
        VariantResult(name="mask_form=additive", dimension="mask_form",
                      options=DEFAULTS | {"mask_form": "additive"}, outcome="ok",
                      decode_ms=8.0),
    ]
    choices = choose(rows, 0.05, "interpreter")
    assert choices["kv_write"].value == "scatter" and "slice wrong" in choices["kv_write"].rests_on
    assert choices["layout"].value == "BCT1" and "within the 5% margin" in \
        choices["layout"].rests_on
    assert choices["mask_form"].value == "additive"
    assert "20% faster than the default select" in choices["mask_form"].rests_on


def test_variants_that_cannot_be_built_are_skipped_rows() -> None:
    planned, skipped = plan_variants(dict(DEFAULTS), 64, head_argmax=True)
    assert [n for n, _, _ in planned] == ["baseline", "mask_form=additive", "layout=BC1T",
                                          "prefill_t=16", "prefill_t=32", "kv_write=slice"]
    assert {r.name: r.outcome for r in skipped} == {"head_layout=vocab-last": "skipped",
                                                    "prefill_t=128": "skipped"}


def test_the_command_lines_names_are_the_modules() -> None:
    assert DIMENSION_CHOICES == DIMENSIONS and BITS_CHOICES == tune_mod.BITS


def test_tune_manifest_rebuilds_the_build_with_its_own_options(tiny_gguf: Path,
                                                               tmp_path: Path) -> None:
    """`tune --manifest`'s baseline is the user's build: its source rebuilt with the options it
    recorded gives the same packages (fingerprints) and the same build options."""
    build(tiny_gguf, tmp_path / "user", BuildRequest(
        topology="2,1", max_seq=96, prefill_t=32, layout="BC1T", kv_write="slice",
        head_layout="vocab-last", mask_form="additive", head_chunks=5))
    source, request, description = tune_source.from_manifest(tmp_path / "user")
    assert source == tiny_gguf and "user" in description
    build(source, tmp_path / "again", BuildRequest(**request))
    a, b = (load_manifest(tmp_path / f).manifest for f in ("user", "again"))
    assert a.build == b.build
    assert [s.fingerprint for s in a.shards] == [s.fingerprint for s in b.shards]
    assert [h.fingerprint for h in a.heads] == [h.fingerprint for h in b.heads]
    assert {d: request[d] for d in DIMENSIONS} == {
        "mask_form": "additive", "layout": "BC1T", "head_layout": "vocab-last", "prefill_t": 32,
        "kv_write": "slice"}
