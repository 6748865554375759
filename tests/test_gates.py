"""The gates on tiny builds: every layout and weight format passes, every known bug is caught."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ane_spec.cli import main
from ane_spec.manifests.store import load_manifest
from ane_spec.model.gguf_file import open_gguf
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline, run_gates
from ane_spec.probes.parity import run_parity
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.layer_graph import GraphVariant

S = 64


@pytest.fixture(scope="module")
def builds(tiny_gguf_conditioned: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One build per (layout, weights); shared by the tests below."""
    root = tmp_path_factory.mktemp("gate-builds")
    out = {}
    for layout, weights, topology in (("BCT1", "int8-channel", "2,1"), ("BC1T", "q8-block", "1,2"),
                                      ("BCT1", "fp16", "3")):
        path = root / f"{layout}-{weights}"
        build(tiny_gguf_conditioned, path, BuildRequest(topology=topology, max_seq=S,
                                                        layout=layout, weights=weights))
        out[(layout, weights)] = path
    return out


@pytest.mark.parametrize("key", [("BCT1", "int8-channel"), ("BC1T", "q8-block"), ("BCT1", "fp16")])
def test_every_layout_and_format_passes(builds: dict, tiny_gguf_conditioned: Path, key) -> None:
    m = open_gguf(tiny_gguf_conditioned)
    for precision in ("fp32", "fp16"):
        loaded, pipeline = open_pipeline(builds[key], "mil", precision)
        parity = run_parity(loaded, pipeline, m, lengths=(3, 17), decode_steps=4)
        block = run_block(pipeline)
        print(key, parity.summary(), "|", block.summary())
        assert parity.passed and block.passed
        if precision == "fp32":
            # The acceptance bars: cosine >= 0.9999 at every position, same argmax everywhere
            # (this fixture has no near-ties), block cosine >= 0.99999 with matching states.
            assert parity.figures["min_cosine"] >= 0.9999
            assert parity.figures["argmax_agreement"] == 1.0
            assert block.figures["min_cosine"] >= 0.99999 and block.figures["states_match"]
        assert parity.figures["gguf_min_cosine"] >= 0.999


BROKEN = {
    "all dims rotated": GraphVariant(rotate_all_dims=True),
    "attention factor dropped": GraphVariant(drop_attn_factor=True),
    "K and V swapped in the scatter": GraphVariant(swap_kv_scatter=True),
    "attention output flattened [head, token, dim]": GraphVariant(flatten="head_token_dim"),
}


@pytest.mark.parametrize("bug", list(BROKEN))
def test_broken_builds_fail_a_gate(tiny_gguf_conditioned: Path, tmp_path: Path, bug: str) -> None:
    out = tmp_path / "broken"
    build(tiny_gguf_conditioned, out, BuildRequest(topology="3", max_seq=S, weights="q8-block"),
          variant=BROKEN[bug])
    loaded, pipeline = open_pipeline(out, "mil", "fp32")
    parity = run_parity(loaded, pipeline, open_gguf(tiny_gguf_conditioned), lengths=(3, 17),
                        decode_steps=4)
    block = run_block(pipeline)
    print(bug, parity.summary(), "|", block.summary())
    assert not (parity.passed and block.passed), f"no gate caught: {bug}"
    if bug.startswith("attention output flattened"):
        # Invisible at T=1; the block gate is the one that sees it.
        assert not block.passed


def test_gate_results_land_in_the_manifest_and_json(builds: dict, capsys) -> None:
    path = builds[("BCT1", "int8-channel")]
    assert main(["probe", "block", "--manifest", str(path), "--backend", "mil", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("gate", "passed", "backend", "precision", "min_cosine"):
        assert key in report
    assert report["gate"] == "block" and report["passed"] is True
    assert list(report)[-1] == "passed"  # the verdict closes the JSON
    gates = load_manifest(path).manifest.gates
    assert gates["block:mil-fp32"].passed and (path / gates["block:mil-fp32"].report).is_file()

    assert main(["probe", "all", "--manifest", str(path), "--backend", "mil"]) == 0
    out = capsys.readouterr().out
    assert "row-invariance [mil/fp32]: PASS" in out and "residency: SKIPPED" in out
    assert "overflow [mil/fp32]: PASS" in out
    assert "parity [mil/fp32/fixed]: PASS" in out and "drift [mil/fp32/fixed]: PASS" in out
    manifest = load_manifest(path).manifest
    # Figures that depend on the pass width record the decode shape they were measured at.
    assert manifest.gates["parity:mil-fp32-fixed"].decode_shape == "fixed"
    assert manifest.drift["mil-fp32-fixed"] == 0.0  # row-invariant: a padded pass == a block row
    assert manifest.gates["row-invariance:mil-fp32"].passed
    assert manifest.gates["overflow:mil-fp32"].passed


def test_artifact_logits_match_the_reference_dump(builds: dict, tiny_gguf_conditioned: Path,
                                                 tmp_path: Path) -> None:
    tokens = "5,17,300,2,900,41,7"
    ref, art = tmp_path / "ref.npy", tmp_path / "art.npy"
    assert main(["logits", str(tiny_gguf_conditioned), "--tokens", tokens, "--context", str(S),
                 "--out", str(ref)]) == 0
    assert main(["logits", "--manifest", str(builds[("BC1T", "q8-block")]), "--tokens", tokens,
                 "--out", str(art), "--backend", "mil"]) == 0
    a, b = np.load(ref), np.load(art)
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    assert a.shape == b.shape == (7, 1024) and cos.min() > 0.9999


def test_run_gates_residency_is_skipped_with_a_reason(builds: dict) -> None:
    [report] = run_gates(builds[("BCT1", "fp16")], ("residency",), backend="mil",
                         precision="fp32", save=False)
    assert report.skipped and "macOS" in report.skipped


def test_drift_refuses_non_finite_logits(builds: dict, tmp_path: Path) -> None:
    """A build whose weights hold NaN (tampered after the build; loaded unverified) gives NaN
    logits: the drift probe says so instead of handing the guard a NaN margin."""
    import shutil

    from ane_spec.errors import AneSpecError
    from ane_spec.probes.drift import measure_drift

    art = tmp_path / "nan-build"
    shutil.copytree(builds[("BCT1", "fp16")], art)
    blob = next((art / "shards").rglob("weight.bin"))
    data = bytearray(blob.read_bytes())
    data[len(data) // 2:len(data) // 2 + 4096] = b"\xff" * 4096  # fp16 0xffff is NaN
    blob.write_bytes(bytes(data))
    _, pipeline = open_pipeline(art, "mil", "fp32", verify=False, decode_shape="mixed")
    with pytest.raises(AneSpecError, match="non-finite logits"):
        measure_drift(pipeline)
    assert "mil-fp32-mixed" not in load_manifest(art, verify=False).manifest.drift
