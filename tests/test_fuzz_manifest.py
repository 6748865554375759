"""Tampered builds through the real CLI: one clear line or a valid result, nothing outside read.

A real build of a small model is copied (hard links) per case and tampered with by hypothesis:
artifact paths pointing out of the build (`..`, absolute, symlinks, FIFOs, devices, deep folders),
wrong types and edge numbers anywhere in the manifest (NaN and 1e999 literals, 10^9 layers,
negative drift), wrong hashes, and artifacts whose content is malformed but whose size and hash
were recomputed (tokenizer.json, the embeddings' .npy files, package files). Each case runs
`ane-spec logits --manifest` (load with hash verification, open the pipeline, run two tokens) in
the fuzz worker under its memory and time limits, with the audit hook reporting any path
touched outside the case's folder. Run with `-s` to see the counts.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ane_spec.manifests.store import hash_path, load_manifest
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards.build import BuildRequest, build
from tests.fuzz_worker import Worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the memory limit (RLIMIT_AS) is enforced on Linux only")

LIMIT_MB = 300
TALLY: Counter = Counter()
BY_KIND: Counter = Counter()
SLOWEST: list[tuple[float, str]] = []
_case_ids = itertools.count()
FILE_REFS = [("tokenizer",), ("heads", 0, "file"), ("shards", 0, "file"),
             ("embeddings", "files", "qs"), ("embeddings", "files", "scales")]
# Paths into the traps each case folder holds (see `traps`), and plain hostile spellings.
HOSTILE_PATHS = [
    "../outside/secret.bin", "../../outside/secret.bin", "shards/../../outside/secret.bin",
    "/etc/passwd", "/dev/zero", "/dev/urandom", "/proc/self/environ", "../../../../usr",
    "link-out", "link-dir/secret.bin", "fifo", "link-to-fifo", "fifo-package.mlpackage",
    "link-package.mlpackage", "device-link", "deep", "", ".", "a//b", "./tokenizer.json",
    "tokenizer.json\x00.png", "\x1b[2J\x1b]0;pwned\x07", "x" * 5000, "C:\\evil", "~/.ssh/id_rsa",
    "embeddings", "shards",
]
EDGE_NUMBERS: list[Any] = [0, -1, 1, 2, 31, 33, 2**31, 2**63, 10**9, 10**30, 10**400, 0.5, -0.0,
                           1e308, 3.5, True, None, "1", "NaN", [], {}]
# JSON literals Python's json module would otherwise read as non-finite floats.
NON_FINITE_LITERALS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fuzz-manifest")
    gguf = write_synthetic_gguf(root / "m.gguf", preset("tiny", num_layers=1))
    build(gguf, root / "art", BuildRequest(max_seq=64, head_chunks=2))
    return root / "art"


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cases = tmp_path_factory.mktemp("fuzz-manifest-cases")
    outside = cases / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"not for the build\n" * 100)
    os.mkfifo(outside / "fifo")
    return cases


@pytest.fixture(scope="module")
def worker(pristine: Path, cases_dir: Path):
    warm = cases_dir / "warm.npy"
    w = Worker(LIMIT_MB, warmup=[["logits", "--manifest", str(pristine), "--tokens", "1,2",
                                  "--out", str(warm), "--backend", "mil"]])
    yield w
    w.close()
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(TALLY.items()))
    print(f"\nmanifest fuzz: {sum(TALLY.values())} cases: {outcomes}; by tampering: "
          f"{dict(sorted(BY_KIND.items()))}; worker starts {w.started}; slowest cases: "
          f"{sorted(SLOWEST, reverse=True)[:3]}")
    load_manifest(pristine)  # hard-linked copies: nothing may have written through them


def traps(art: Path, outside: Path, deep: bool) -> None:
    """Things a tampered path can name inside the build folder."""
    os.symlink(outside / "secret.bin", art / "link-out")
    os.symlink(outside, art / "link-dir")
    os.mkfifo(art / "fifo")
    os.symlink(outside / "fifo", art / "link-to-fifo")
    (art / "fifo-package.mlpackage").mkdir()
    os.mkfifo(art / "fifo-package.mlpackage" / "weight.bin")
    (art / "link-package.mlpackage").mkdir()
    os.symlink(outside / "secret.bin", art / "link-package.mlpackage" / "weight.bin")
    os.symlink("/dev/zero", art / "device-link")
    if deep:  # 300 nested folders: made only for the cases that name them
        folder = art / "deep"
        folder.mkdir()
        for _ in range(300):
            folder = folder / "d"
            folder.mkdir()
        (folder / "f").write_bytes(b"x")


def copy_build(pristine: Path, folder: Path, deep: bool = False) -> Path:
    art = folder / "art"
    shutil.copytree(pristine, art, copy_function=os.link)
    traps(art, folder.parent / "outside", deep)
    return art


def get(doc: Any, path: tuple) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def put(doc: Any, path: tuple, value: Any) -> None:
    get(doc, path[:-1])[path[-1]] = value


def leaves(doc: Any, prefix: tuple = ()) -> list[tuple]:
    if isinstance(doc, dict):
        return [p for k, v in doc.items() for p in leaves(v, (*prefix, k))] or [prefix]
    if isinstance(doc, list):
        return [p for i, v in enumerate(doc) for p in leaves(v, (*prefix, i))] or [prefix]
    return [prefix]


def rewrite(path: Path, data: bytes) -> None:
    """Replace a (hard-linked) file with new content without touching the shared inode."""
    path.unlink()
    path.write_bytes(data)


def refresh_ref(doc: dict, ref: tuple, art: Path) -> None:
    """Record the artifact's current size and hash, as a careful attacker would."""
    entry = get(doc, ref)
    size, digest = hash_path(art / entry["path"])
    entry["bytes"], entry["blake3"] = size, digest


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=8), lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


def malformed_npy(draw, original: bytes) -> bytes:
    header_len = int.from_bytes(original[8:10], "little")
    header = original[10:10 + header_len].decode("latin-1")
    how = draw(st.sampled_from(["dtype", "shape", "fortran", "truncate", "garbage", "pickle",
                                "huge header", "v2 header"]))
    if how == "dtype":
        return original.replace(b"'|i1'", b"'<f8'").replace(b"'<f2'", b"'<f8'")
    if how == "shape":
        new = header.replace("(1024,", "(1000000000,")
        return original[:10] + new.encode("latin-1") + original[10 + header_len:]
    if how == "fortran":
        return original.replace(b"'fortran_order': False", b"'fortran_order': True ")
    if how == "truncate":
        return original[:draw(st.integers(0, len(original) - 1))]
    if how == "garbage":
        return draw(st.binary(max_size=200))
    if how == "pickle":
        obj = np.array([{"evil": 1}], dtype=object)
        import io
        buf = io.BytesIO()
        np.save(buf, obj, allow_pickle=True)
        return buf.getvalue()
    if how == "huge header":
        return original[:8] + (65535).to_bytes(2, "little") + b"{" * 65535
    return b"\x93NUMPY\x02\x00" + (2**32 - 1).to_bytes(4, "little") + b"{'descr'"


@st.composite
def tampering(draw, pristine: Path) -> dict:
    """A description of what to do to a copy of the build (applied by `apply`)."""
    doc = json.loads((pristine / "manifest.json").read_text())
    kind = draw(st.sampled_from(["path", "path", "number", "type", "hash", "structure",
                                 "literal", "content", "content", "drift", "harmless"]))
    t: dict[str, Any] = {"kind": kind}
    if kind == "path":
        t["ref"] = draw(st.sampled_from(FILE_REFS))
        t["value"] = draw(st.sampled_from(HOSTILE_PATHS) | st.text(max_size=40))
    elif kind == "number":
        numeric = [p for p in leaves(doc) if isinstance(get(doc, p), (int, float))]
        t["at"] = draw(st.sampled_from(numeric))
        t["value"] = draw(st.sampled_from(EDGE_NUMBERS) | st.integers() | st.floats())
    elif kind == "type":
        t["at"] = draw(st.sampled_from(leaves(doc)))
        t["value"] = draw(JSON_VALUES)
    elif kind == "hash":
        t["ref"] = draw(st.sampled_from(FILE_REFS))
        t["field"] = draw(st.sampled_from(["blake3", "sha256", "bytes"]))
        t["value"] = draw(st.sampled_from(["0" * 64, "A" * 64, "abc", "", "z" * 64, -1, 0,
                                           2**63, 10**12]))
    elif kind == "structure":
        t["op"] = draw(st.sampled_from(["drop key", "extra key", "duplicate shard",
                                        "no shards", "no chunks", "swap chunks", "deep"]))
        t["at"] = draw(st.sampled_from([p for p in leaves(doc) if p]))
    elif kind == "literal":
        numeric = [p for p in leaves(doc) if isinstance(get(doc, p), float)]
        t["at"] = draw(st.sampled_from(numeric + [("drift",)]))
        t["value"] = draw(st.sampled_from(NON_FINITE_LITERALS))
    elif kind == "content":
        t["file"] = draw(st.sampled_from(["tokenizer", "qs", "scales", "weight.bin",
                                          "model.mlmodel", "package manifest"]))
        t["seed"] = draw(st.integers(0, 2**32 - 1))
    elif kind == "drift":
        t["value"] = draw(st.sampled_from([-1.0, 0.0, 0.001, 1e30, None, "x", [1]]))
    else:
        t["field"] = draw(st.sampled_from(["name", "created", "tool_version", "gates"]))
        t["value"] = draw(st.text(max_size=30))
    return t


def apply(t: dict, art: Path, draw_data) -> str:  # noqa: ANN001
    """Tamper with the copy at `art`; returns the manifest text to write."""
    doc = json.loads((art / "manifest.json").read_text())
    literal = None
    kind = t["kind"]
    if kind == "path":
        get(doc, t["ref"])["path"] = t["value"]
    elif kind in ("number", "type"):
        put(doc, t["at"], t["value"])
    elif kind == "hash":
        get(doc, t["ref"])[t["field"]] = t["value"]
    elif kind == "structure":
        op = t["op"]
        if op == "drop key":
            parent = get(doc, t["at"][:-1])
            del parent[t["at"][-1]]
        elif op == "extra key":
            doc["unexpected"] = 1
        elif op == "duplicate shard":
            doc["shards"].append(doc["shards"][0])
        elif op == "no shards":
            doc["shards"] = []
        elif op == "no chunks":
            doc["heads"][0]["chunks"] = []
        elif op == "swap chunks":
            doc["heads"][0]["chunks"].reverse()
        else:
            put(doc, t["at"], "DEEP")
            literal = ("\"DEEP\"", "[" * 100_000 + "]" * 100_000)
    elif kind == "literal":
        if t["at"] == ("drift",):
            doc["drift"] = {"mil-fp32": "LITERAL"}
        else:
            put(doc, t["at"], "LITERAL")
        literal = ("\"LITERAL\"", t["value"])
    elif kind == "content":
        rng = np.random.default_rng(t["seed"])
        f = t["file"]
        if f == "tokenizer":
            path, ref = art / "tokenizer.json", ("tokenizer",)
            tok = json.loads(path.read_text())
            variants = [b"", b"{", b"[]", b"{}", json.dumps({**tok, "tokens": 5}).encode(),
                        json.dumps({**tok, "merges": ["ab"]}).encode(),
                        json.dumps({**tok, "merges": ["q \u4e5d"]}).encode(),
                        json.dumps({**tok, "token_types": [9] * len(tok["tokens"])}).encode(),
                        json.dumps({**tok, "eos_token_id": 10**6}).encode(),
                        b"[" * 50_000, rng.bytes(300)]
            rewrite(path, variants[int(rng.integers(len(variants)))])
        elif f in ("qs", "scales"):
            path = art / "embeddings" / f"embed_{f}.npy"
            ref = ("embeddings", "files", f)
            rewrite(path, draw_data(path.read_bytes()))
        else:
            package = art / doc["shards"][0]["file"]["path"]
            ref = ("shards", 0, "file")
            target = {"weight.bin": "Data/com.apple.CoreML/weights/weight.bin",
                      "model.mlmodel": "Data/com.apple.CoreML/model.mlmodel",
                      "package manifest": "Manifest.json"}[f]
            path = package / target
            data = path.read_bytes()
            cut = int(rng.integers(0, len(data)))
            rewrite(path, data[:cut] + rng.bytes(int(rng.integers(0, 64))))
        refresh_ref(doc, ref, art)
    elif kind == "drift":
        doc["drift"] = {"mil-fp32": t["value"]}
    else:
        doc[t["field"]] = {} if t["field"] == "gates" else t["value"]
    text = json.dumps(doc, indent=1)
    if literal is not None:
        text = text.replace(*literal, 1)
    return text


@settings(max_examples=100, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(st.data())
def test_tampered_builds(worker: Worker, cases_dir: Path, pristine: Path, data) -> None:
    t = data.draw(tampering(pristine))
    folder = cases_dir / f"c{next(_case_ids)}"
    folder.mkdir()
    art = copy_build(pristine, folder, deep=t.get("value") == "deep")
    text = apply(t, art, lambda original: malformed_npy(data.draw, original))
    rewrite(art / "manifest.json", text.encode("utf-8", "surrogatepass"))
    out = folder / "logits.npy"
    outcome = worker.run(["logits", "--manifest", str(art), "--tokens", "1,2", "--out", str(out),
                          "--backend", "mil"], [folder])
    TALLY[outcome.kind if not outcome.outside else "touched-outside"] += 1
    BY_KIND[f"{t['kind']} {outcome.kind}"] += 1
    SLOWEST.append((round(outcome.seconds, 2), repr(t)[:80]))
    assert outcome.ok, (t, outcome)
    if outcome.kind == "refused":
        assert len(outcome.detail) < 1200 and outcome.detail.isprintable(), (t, outcome.detail)
    else:
        assert np.isfinite(np.load(out)).all(), t


def test_hostile_paths_are_refused_by_name(pristine: Path, tmp_path: Path) -> None:
    """In-process, each trap gets its own message; nothing behind it is opened."""
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.bin").write_bytes(b"s")
    os.mkfifo(tmp_path / "outside" / "fifo")
    art = copy_build(pristine, tmp_path)
    expected = {
        "../outside/secret.bin": "must be relative to the build folder, without '..'",
        "/etc/passwd": "must be relative to the build folder",
        "link-out": "'link-out' is a symlink",
        "link-dir/secret.bin": "'link-dir' is a symlink",
        "fifo": "'fifo' is a FIFO",
        "link-to-fifo": "is a symlink",
        "device-link": "is a symlink",
        "fifo-package.mlpackage": "is a FIFO inside a package folder",
        "link-package.mlpackage": "is a symlink inside a package folder",
    }
    from ane_spec.errors import ManifestError

    original = (art / "manifest.json").read_text()
    for path, message in expected.items():
        doc = json.loads(original)
        doc["heads"][0]["file"]["path"] = path
        rewrite(art / "manifest.json", json.dumps(doc).encode())
        with pytest.raises(ManifestError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_manifest(art)


def test_drift_never_written_unreadable(pristine: Path, tmp_path: Path) -> None:
    """A NaN or negative drift is refused before it reaches the file; the manifest stays
    loadable (it used to be written as null, and every later command refused it)."""
    from ane_spec.errors import ManifestError
    from ane_spec.manifests.store import record_drift

    art = tmp_path / "art"
    shutil.copytree(pristine, art)
    before = (art / "manifest.json").read_bytes()
    for bad in (float("nan"), float("inf"), -1e-3):
        with pytest.raises(ManifestError, match="not a finite number >= 0"):
            record_drift(art, "mil-fp32", bad)
    assert (art / "manifest.json").read_bytes() == before
    record_drift(art, "mil-fp32", 0.004)
    assert load_manifest(art).manifest.drift == {"mil-fp32": 0.004}


def test_graphs_of_another_revision_are_refused_at_load(pristine: Path, tmp_path: Path) -> None:
    """A build from before the finite-safe KV write and mask (or without a recorded revision),
    or from a newer compiler, is refused by name when the pipeline opens; the current one runs."""
    from ane_spec.errors import ManifestError
    from ane_spec.manifests.schema import GRAPH_REVISION
    from ane_spec.probes.gates import open_pipeline

    art = tmp_path / "art"
    shutil.copytree(pristine, art)
    original = json.loads((art / "manifest.json").read_text())
    assert original["graph_revision"] == GRAPH_REVISION
    for revision in (None, 0, GRAPH_REVISION - 1, GRAPH_REVISION + 1):
        doc = dict(original)
        if revision is None:
            del doc["graph_revision"]  # written before the revision was recorded
        else:
            doc["graph_revision"] = revision
        rewrite(art / "manifest.json", json.dumps(doc).encode())
        with pytest.raises(ManifestError, match=f"built with graph revision {revision or 0}; "
                           r"this ane-spec runs revision.*rebuild with `ane-spec build --force`"):
            open_pipeline(art, "mil", "fp16")
    rewrite(art / "manifest.json", json.dumps(original).encode())
    _, pipeline = open_pipeline(art, "mil", "fp16")
    assert pipeline.run([1, 2], 0, pipeline.new_state()).row_argmax(0) >= 0
