"""An LM head over --max-head-mb, split into separate packages of whole vocabulary chunks: the
plan, the manifest's record of it, the runtime reading every package, and the property the split
rests on: each package performs the one-package head's ops in the same shapes per chunk, so its
outputs are bitwise the one-package head's on the same hidden states."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from ane_spec.errors import BuildError, ManifestError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import prefill_logits
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.topology import (
    DEFAULT_MAX_HEAD_MB,
    MIB,
    head_budget_problems,
    head_chunk_bytes,
    plan_head_packages,
)
from ane_spec.shards.weights import estimate_bytes

S = 32
CHUNKS = 5  # tiny's 1,024-row vocabulary: chunks of 204/205 rows, ~0.04 MiB each in int8
# Two chunks fit (0.076 MiB), three do not: packages of 2, 2 and 1 chunks, an uneven last one.
SPLIT_MB = 0.08


# --- the plan, without building -------------------------------------------------------------

def test_plan_fills_packages_greedily_with_whole_chunks() -> None:
    mib = MIB
    assert plan_head_packages([mib] * 5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert plan_head_packages([mib] * 5, 5) == [(0, 5)]          # fits: one package
    assert plan_head_packages([mib] * 4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    # A chunk over the budget gets a package of its own (refused unless forced, below).
    assert plan_head_packages([mib, 3 * mib, mib], 2) == [(0, 1), (1, 2), (2, 3)]
    # Phi-4-mini: 4 chunks of 50,016 x 3,072 int8 rows fit the default budget one per package,
    # exactly the packages ane-book measured resident; two together do not. A chunk's 8-bit
    # LUT fallback (auto's next form) fits alone too.
    chunks = [(i * 50_016, (i + 1) * 50_016) for i in range(4)]
    sizes = head_chunk_bytes(chunks, 3072, "int8-channel")
    assert [round(s / mib, 1) for s in sizes] == [146.6] * 4
    assert plan_head_packages(sizes, DEFAULT_MAX_HEAD_MB) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert head_budget_problems(chunks, sizes, DEFAULT_MAX_HEAD_MB, "int8-channel", 3072) == []
    assert 2 * sizes[0] > DEFAULT_MAX_HEAD_MB * mib >= estimate_bytes(50_016, 3072, "lut8")


def test_a_chunk_over_the_budget_names_the_head_chunks_that_fit() -> None:
    chunks = [(i * 50_016, (i + 1) * 50_016) for i in range(4)]
    sizes = head_chunk_bytes(chunks, 3072, "fp16")  # 293 MiB each
    (problem,) = head_budget_problems(chunks, sizes, 150, "fp16", 3072)
    assert "chunk [0,50016) holds 293.1 MiB of fp16 weights, over --max-head-mb 150" in problem
    assert "and so do 3 more" in problem and "146.6 MiB" in problem  # the measured source
    # 150 MiB holds 25,600 fp16 rows of 3,072: 200,064 rows need 8 chunks.
    assert "--head-chunks 8 or more (chunks of at most 25,600 rows)" in problem


# --- builds ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One-package and split builds of one model, logits and --head-argmax: each split is a
    rebuild of a copy of its one-package build, so its shards are the same packages."""
    root = tmp_path_factory.mktemp("head-split")
    gguf = write_synthetic_gguf(root / "m.gguf", preset("tiny", num_layers=1, embed_std=1.0,
                                                        branch_scale=1.0, seed=7))
    out: dict[str, Path] = {"gguf": gguf}
    for kind, argmax in (("logits", False), ("argmax", True)):
        one, split = root / f"{kind}-one", root / f"{kind}-split"
        request = BuildRequest(max_seq=S, head_chunks=CHUNKS, head_argmax=argmax)
        build(gguf, one, request)
        shutil.copytree(one, split)
        said: list[str] = []
        result = build(gguf, split, request.model_copy(update={"max_head_mb": SPLIT_MB}),
                       force=True, progress=said.append)
        assert result.reused == ["shards/layers_00_01.mlpackage"]  # only the head changed
        assert result.built == [f"head_vocab_{a:06d}_{b:06d}.mlpackage"
                                for a, b in ((0, 409), (409, 819), (819, 1024))]
        (line,) = [s for s in said if "split into" in s]
        assert line == ("LM head: 5 chunks over --max-head-mb 0.08, split into 3 packages: "
                        "[0,409) (2 chunks), [409,819) (2 chunks), [819,1024) (1 chunk)")
        out[f"{kind}-one"], out[f"{kind}-split"] = one, split
    return out


@pytest.mark.parametrize("kind", ["logits", "argmax"])
def test_manifest_records_the_split(builds: dict[str, Path], kind: str) -> None:
    one = load_manifest(builds[f"{kind}-one"]).manifest
    split = load_manifest(builds[f"{kind}-split"]).manifest
    assert [h.file.path for h in one.heads] == ["head.mlpackage"]
    assert [h.chunks for h in split.heads] == [[(0, 204), (204, 409)], [(409, 614), (614, 819)],
                                               [(819, 1024)]]
    assert split.head_chunks == one.head_chunks and split.build.head_chunks == CHUNKS
    names = [[o.name for o in h.outputs] for h in split.heads]
    if kind == "logits":
        assert names == [["logits_0", "logits_1"], ["logits_2", "logits_3"], ["logits_4"]]
    else:
        assert names[2] == ["max_4", "argmax_4"]
    assert all(h.file.bytes <= SPLIT_MB * MIB * 1.5 for h in split.heads)  # weights + metadata
    # Every package's interface is the one-package head's, chunk for chunk.
    whole = {o.name: o for o in one.heads[0].outputs}
    assert [o for h in split.heads for o in h.outputs] == [whole[n] for n in whole]


def _hidden_blocks(layout: str, d: int, blocks: int) -> list[np.ndarray]:
    """Hidden states [1, d, 4, 1] (or [1, d, 1, 4]) over a range of scales, as the last shard
    hands them to the head: many rows, so a chunk computed differently cannot hide."""
    rng = np.random.default_rng(3)
    out = []
    for n in range(blocks):
        rows = (rng.standard_normal((4, d)) * (0.1 * 4.0 ** (n % 4))).astype(np.float16).T
        out.append(rows[None, :, :, None] if layout == "BCT1" else rows[None, :, None, :])
    return out


@pytest.mark.parametrize("kind", ["logits", "argmax"])
def test_split_head_outputs_are_bitwise_the_one_package_heads(builds: dict[str, Path],
                                                              kind: str) -> None:
    """The same hidden states through both heads on the fp16 interpreter: every output of every
    package equals the one-package head's output of that name, bit for bit, over 32 rows."""
    _, one = open_pipeline(builds[f"{kind}-one"], "mil", "fp16")
    _, split = open_pipeline(builds[f"{kind}-split"], "mil", "fp16")
    assert len(split.heads) == 3 and len(one.heads) == 1
    for hidden in _hidden_blocks(one.layout, one.config.hidden_size, 8):
        want = one.head.predict({"x": hidden})
        got = split.head.predict({"x": hidden})
        assert sorted(got) == sorted(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
            assert got[name].tobytes() == want[name].tobytes(), name
        # Package by package, too: each one's outputs are the whole head's of those names.
        for part in split.heads:
            for name, value in part.predict({"x": hidden}).items():
                assert value.tobytes() == want[name].tobytes(), name
        rows_one, rows_split = one._read_head(want, 4), split._read_head(got, 4)
        assert rows_split.argmax.tolist() == rows_one.argmax.tolist()


def test_split_build_decodes_as_the_one_package_build(builds: dict[str, Path]) -> None:
    """Whole passes (embeddings, shard, head) over 24 positions: the same logits bit for bit,
    so the same greedy tokens; and the argmax builds pick those tokens."""
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, 1024, 24)]
    logits = {k: prefill_logits(open_pipeline(builds[f"logits-{k}"], "mil", "fp16")[1], tokens)
              for k in ("one", "split")}
    assert logits["split"].shape == (24, 1024)
    assert logits["split"].tobytes() == logits["one"].tobytes()
    _, argmax_split = open_pipeline(builds["argmax-split"], "mil", "fp16")
    state = argmax_split.new_state()
    picked = np.concatenate([argmax_split.run(tokens[i:i + 4], i, state).argmax
                             for i in range(0, 24, 4)])
    # The argmax head picks within fp16 ties of the logits head: on these logits, no ties.
    assert picked.tolist() == logits["one"].argmax(axis=1).tolist()


def test_core_ml_reads_every_head_package(coreml_standin, builds: dict[str, Path]) -> None:
    """The Core ML worker runs a pass in one call (`run_pass`): with a split head, every head
    package runs there and the rows it gathers are the interpreter's."""
    tokens = [int(t) for t in np.random.default_rng(6).integers(0, 1024, 8)]
    _, coreml = open_pipeline(builds["logits-split"], "coreml", "fp32")
    _, mil = open_pipeline(builds["logits-one"], "mil", "fp16")
    assert len(coreml.heads) == 3
    got = prefill_logits(coreml, tokens)
    want = prefill_logits(mil, tokens)
    assert got.tobytes() == want.tobytes()
    coreml.backend.close()


# --- bad builds and manifests -----------------------------------------------------------------

def _copy(builds: dict[str, Path], kind: str, tmp_path: Path) -> Path:
    dest = tmp_path / kind
    shutil.copytree(builds[kind], dest)
    return dest


def test_tampered_or_missing_head_package_is_refused(builds: dict[str, Path],
                                                     tmp_path: Path) -> None:
    art = _copy(builds, "logits-split", tmp_path)
    second = art / "head_vocab_000409_000819.mlpackage"
    weights = next(p for p in second.rglob("*") if p.is_file() and p.name == "weight.bin")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match="artifact 'head_vocab_000409_000819.mlpackage' does "
                                            "not match its recorded blake3"):
        load_manifest(art)
    shutil.rmtree(second)
    with pytest.raises(ManifestError, match="artifact 'head_vocab_000409_000819.mlpackage' is "
                                            "missing"):
        load_manifest(art)


def test_swapped_head_packages_are_refused_by_name(builds: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """File refs swapped between two head entries still hash right: the runtime's check of
    each package's outputs against its entry refuses them."""
    art = _copy(builds, "logits-split", tmp_path)
    doc = json.loads((art / "manifest.json").read_text())
    doc["heads"][0]["file"], doc["heads"][1]["file"] = doc["heads"][1]["file"], \
        doc["heads"][0]["file"]
    (art / "manifest.json").write_text(json.dumps(doc))
    load_manifest(art)  # hashes and tiling agree
    with pytest.raises(ManifestError, match="head package 'head_vocab_000409_000819.mlpackage' "
                                            "outputs 'logits_2, logits_3', but the manifest "
                                            "records logits_0, logits_1"):
        open_pipeline(art, "mil", "fp16")


@pytest.mark.parametrize("edit,message", [
    (lambda d: d["heads"].pop(1), "heads' chunks: ranges do not tile"),
    (lambda d: d["heads"].reverse(), "heads' chunks: ranges do not tile"),
    (lambda d: d["heads"][2]["outputs"][0].update(name="logits_0"),
     r"heads\[2\] outputs \['logits_0'\]"),
    (lambda d: d["heads"][2].update(file=d["heads"][1]["file"]), "two packages name the same"),
    (lambda d: d.update(heads=[]), "heads"),
])
def test_manifest_refuses_heads_that_do_not_fit_together(builds: dict[str, Path],
                                                         tmp_path: Path, edit, message) -> None:
    art = _copy(builds, "logits-split", tmp_path)
    doc = json.loads((art / "manifest.json").read_text())
    edit(doc)
    (art / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match=message):
        load_manifest(art, verify=False)


def test_manifest_from_before_split_heads_still_loads(builds: dict[str, Path],
                                                      tmp_path: Path) -> None:
    """Builds written before heads could be split name their one package `head`."""
    art = _copy(builds, "logits-one", tmp_path)
    doc = json.loads((art / "manifest.json").read_text())
    doc["head"] = doc.pop("heads")[0]
    (art / "manifest.json").write_text(json.dumps(doc))
    m = load_manifest(art).manifest
    assert [h.file.path for h in m.heads] == ["head.mlpackage"]
    _, pipeline = open_pipeline(art, "mil", "fp16")
    assert pipeline.run([1, 2], 0, pipeline.new_state()).argmax.shape == (2,)


def test_a_chunk_over_the_budget_is_refused_unless_forced(builds: dict[str, Path],
                                                          tmp_path: Path) -> None:
    request = BuildRequest(max_seq=S, head_chunks=CHUNKS, max_head_mb=0.02)
    # 204 rows of 192 int8 weights and an fp16 scale: 0.038 MiB; 0.02 MiB holds 108 rows.
    with pytest.raises(BuildError, match=r"LM-head chunk \[0,204\) holds 0\.038 MiB of auto "
                                         r"weights, over --max-head-mb 0\.02 .*--head-chunks 10 "
                                         r"or more \(chunks of at most 108 rows\).*"
                                         r"--force-ane-limits"):
        build(builds["gguf"], tmp_path / "refused", request)
    assert not (tmp_path / "refused").exists()
    with pytest.raises(BuildError, match="splits the LM head into 300 packages, more than the "
                                         "256 a build may have"):
        build(builds["gguf"], tmp_path / "refused", BuildRequest(max_seq=S, head_chunks=300,
                                                                 max_head_mb=0.001))
    art = _copy(builds, "logits-one", tmp_path)
    result = build(builds["gguf"], art, request.model_copy(update={"force_ane_limits": True}),
                   force=True)
    assert any(w.startswith("--force-ane-limits overrides: LM-head chunk [0,204)")
               for w in result.warnings)
    assert len(load_manifest(art).manifest.heads) == CHUNKS  # one chunk per package


def test_cli_build_prints_the_split(builds: dict[str, Path], tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    from ane_spec.cli import main

    art = _copy(builds, "logits-one", tmp_path)
    assert main(["build", str(builds["gguf"]), "--out", str(art), "--force", "--max-seq",
                 str(S), "--head-chunks", str(CHUNKS), "--max-head-mb", str(SPLIT_MB)]) == 0
    err = capsys.readouterr().err
    assert "[build] LM head: 5 chunks over --max-head-mb 0.08, split into 3 packages" in err
    assert "[build] LM head package 3/3 vocabulary [819,1024): 1 chunk built" in err


def test_doctor_checks_every_head_package(coreml_standin, builds: dict[str, Path]) -> None:
    """The doctor's per-package checks (through the Core ML stand-in) name each head package by
    its vocabulary rows, beside the shard; its argmax-head check compares a split argmax head
    with a logits head built beside it."""
    from ane_spec.probes import doctor

    checks = {c.name: c for c in doctor.run_doctor(
        builds["argmax-split"], decode_shape="mixed", gguf=str(builds["gguf"]),
        checks=[("decode-shape", doctor.check_decode_shape_placement),
                ("residency", doctor.check_residency),
                ("argmax-head", doctor.check_argmax_head)])}
    assert sorted(checks["decode-shape"].details["off_ane"]) == [
        "head 0-408", "head 409-818", "head 819-1023", "shard 0-0"]
    assert "in 4 package(s) read" in checks["residency"].summary
    assert checks["argmax-head"].status == "passed", checks["argmax-head"]


def test_lint_flags_a_head_package_over_the_head_budget(builds: dict[str, Path]) -> None:
    """A build from before heads were split can hold a head no one measured resident: the
    lint (and through it the residency gate and the doctor) says so; a layer shard is not a head."""
    from ane_spec.probes.residency import ane_lint

    one = builds["logits-one"] / "head.mlpackage"
    (warning,) = [w for w in ane_lint(one, max_head_mb=SPLIT_MB) if w.code == "head-oversize"]
    assert "over 0.08 MiB (ane-book's Phi-4-mini head" in warning.message
    assert [w for w in ane_lint(one) if w.code == "head-oversize"] == []  # default: 160 MiB
    shard = builds["logits-one"] / "shards/layers_00_01.mlpackage"
    assert [w for w in ane_lint(shard, max_head_mb=0.001) if w.code == "head-oversize"] == []


def test_a_package_over_the_budget_after_conversion_is_refused(
        builds: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan costs auto as int8 per channel; a chunk that falls back to a bigger form can
    take a package over --max-head-mb once converted. Here the plan is made to underestimate
    (half the real size), so it packs 4 chunks where 2 fit: their real size, 819 rows of 192
    int8 weights and an fp16 scale (0.152 MiB), refuses it."""
    from ane_spec.shards import build as build_module

    real = build_module.head_chunk_bytes
    monkeypatch.setattr(build_module, "head_chunk_bytes",
                        lambda *a: [s // 2 for s in real(*a)])
    with pytest.raises(BuildError, match=r"LM-head package \[0,819\) holds 0\.152 MiB of "
                                         r"weights, over --max-head-mb 0\.08 .*more --head-chunks"):
        build(builds["gguf"], tmp_path / "refused", BuildRequest(
            max_seq=S, head_chunks=CHUNKS, max_head_mb=SPLIT_MB))
    assert not (tmp_path / "refused").exists()
