"""The Core ML backend: refuses cleanly off macOS; on macOS, agrees with the MIL interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ane_spec.errors import AneSpecError
from ane_spec.runtime.backend import BackendUnavailable, LoadedProgram, make_backend
from ane_spec.runtime.compiled_cache import CACHE_ENV
from ane_spec.runtime.coreml_backend import (
    COMPUTE_UNITS,
    CoreMLBackend,
    compile_package,
    macos_problem,
    optimization_hints,
)

ON_MAC = sys.platform == "darwin"
mac_only = pytest.mark.skipif(not ON_MAC, reason="Core ML compiles and runs models only on "
                              "macOS; coremltools on Linux cannot predict or make states")
S = 64


@pytest.mark.skipif(ON_MAC, reason="off-macOS behaviour")
@pytest.mark.parametrize("units", COMPUTE_UNITS)
def test_off_macos_the_backend_is_unavailable(units: str) -> None:
    with pytest.raises(BackendUnavailable, match="needs macOS.*--backend mil"):
        CoreMLBackend(units)
    with pytest.raises(BackendUnavailable, match="macOS"):
        make_backend("coreml", compute_units=units)
    with pytest.raises(BackendUnavailable, match="macOS"):
        compile_package(Path("head.mlpackage"))


@pytest.mark.parametrize("units", ["NPU", "cpu_and_ne", ""])
def test_unknown_compute_units_list_the_choices(units: str) -> None:
    with pytest.raises(AneSpecError, match="ALL, CPU_ONLY, CPU_AND_GPU, CPU_AND_NE") as err:
        CoreMLBackend(units)
    assert not isinstance(err.value, BackendUnavailable)


def test_import_does_not_load_coremltools() -> None:
    code = ("import sys, ane_spec.runtime.coreml_backend; "
            "print(sorted(m for m in sys.modules if m.startswith('coremltools')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])})
    assert out.stdout.strip() == "[]"


def test_macos_version_gate() -> None:
    assert macos_problem("darwin", (15, 0)) is None and macos_problem("darwin", (26, 1)) is None
    assert macos_problem("darwin", (14, 6, 1)) == (
        "unavailable: needs macOS 15 (this is macOS 14.6.1)")
    assert macos_problem("linux", ()) == "unavailable: needs macOS 15 (this is linux)"


def test_require_macos_asks_coremltools_for_the_version(monkeypatch) -> None:
    """On a Mac the version comes from coremltools' own helper; an old one gets the one-line
    'unavailable' message, never a raw error."""
    import coremltools.models.utils as ct_utils

    from ane_spec.runtime import coreml_backend

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ct_utils, "_macos_version", lambda: (14, 4))
    with pytest.raises(BackendUnavailable) as err:
        coreml_backend.require_macos("the residency report")
    assert str(err.value) == ("unavailable: needs macOS 15 (this is macOS 14.4): the residency "
                              "report needs Core ML")
    assert "\n" not in str(err.value)

    def sw_vers_failed():
        raise Exception("Unable to determine the macOS version")

    monkeypatch.setattr(ct_utils, "_macos_version", sw_vers_failed)
    with pytest.raises(BackendUnavailable, match="could not read the macOS version"):
        coreml_backend.require_macos("x")
    if not ON_MAC:  # a new enough version gets as far as the native bridge, absent here
        monkeypatch.setattr(ct_utils, "_macos_version", lambda: (15, 2))
        with pytest.raises(BackendUnavailable, match="native Core ML bridge failed to load"):
            coreml_backend.require_macos("x")


def test_compile_package_goes_through_the_hash_keyed_cache(tmp_path: Path, monkeypatch) -> None:
    """compile_package keys the cache by the given digest, or by the package's own hash; the
    Core ML compiler is replaced (only macOS has it)."""
    import coremltools.models.utils as ct_utils

    from ane_spec.manifests.store import hash_path
    from ane_spec.runtime import coreml_backend

    calls = []

    def fake_compile_model(model: str, destination_path: str) -> str:
        calls.append(model)
        Path(destination_path).mkdir()
        return destination_path

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(coreml_backend, "require_macos", lambda what, advice="": None)
    monkeypatch.setattr(ct_utils, "compile_model", fake_compile_model)
    package = tmp_path / "build" / "head.mlpackage"
    (package / "Data").mkdir(parents=True)
    (package / "Data" / "weights.bin").write_bytes(b"w")
    digest = hash_path(package)[1]
    compiled = compile_package(package)
    assert compiled == tmp_path / "cache" / "compiled" / f"{digest}.mlmodelc"
    assert compile_package(package, digest) == compiled and calls == [str(package)]
    assert compile_package(package, "ab" * 32).name == "ab" * 32 + ".mlmodelc"
    assert len(calls) == 2 and sorted(p.name for p in package.parent.iterdir()) == [package.name]
    with pytest.raises(AneSpecError, match="not an .mlpackage"):
        compile_package(tmp_path / "missing.mlpackage")


def test_reshape_hint_follows_the_decode_shape(tmp_path: Path, monkeypatch) -> None:
    """fixed -> Infrequent, mixed -> Frequent, handed to CompiledMLModel as coremltools wants it
    (checked by coremltools' own validator). Loading is replaced off macOS."""
    import coremltools as ct
    import coremltools.models.model as ct_model

    from ane_spec.runtime import coreml_backend

    monkeypatch.setattr(ct_model, "_macos_version", lambda: (15, 0))  # the validator's check
    for frequency in ("Infrequent", "Frequent"):
        hints = optimization_hints(frequency)
        assert hints == {"reshapeFrequency": ct.ReshapeFrequency[frequency]}
        ct_model._verify_optimization_hint_input(hints)

    monkeypatch.setattr(coreml_backend, "require_macos", lambda what, advice="": None)
    assert make_backend("coreml", decode_shape="fixed").reshape_frequency == "Infrequent"
    mixed = make_backend("coreml", decode_shape="mixed", compute_units="CPU_ONLY")
    assert mixed.reshape_frequency == "Frequent"
    assert mixed.describe() == "Core ML (CPU_ONLY, reshapeFrequency Frequent)"
    with pytest.raises(AneSpecError, match="decode shape 'wide'"):
        make_backend("coreml", decode_shape="wide")
    with pytest.raises(AneSpecError, match="reshape frequency 'Sometimes'"):
        CoreMLBackend(reshape_frequency="Sometimes")

    seen = {}

    class Recorder:
        def __init__(self, path, compute_units, function_name=None, optimization_hints=None):
            seen.update(path=path, units=compute_units, hints=optimization_hints)

    monkeypatch.setattr(coreml_backend, "compile_package", lambda p, sha: tmp_path / f"{sha}.c")
    monkeypatch.setattr(ct.models, "CompiledMLModel", Recorder)
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    from ane_spec.shards.programs import save_package

    @mb.program(input_specs=[mb.TensorSpec((1, 4), dtype=types.fp16)],
                opset_version=ct.target.iOS18)
    def prog(scores):
        return mb.mul(x=scores, y=np.float16(2.0), name="doubled")

    package = tmp_path / "p.mlpackage"
    save_package(prog, package)
    # The backend that calls Core ML is the one inside the worker process; the proxy that
    # `make_backend` gives passes the same units and hint to it.
    assert (mixed.compute_units, mixed.reshape_frequency) == ("CPU_ONLY", "Frequent")
    program = CoreMLBackend("CPU_ONLY", "Frequent").load(package, digest="cd" * 32)
    assert seen == {"path": str(tmp_path / f"{'cd' * 32}.c"), "units": ct.ComputeUnit.CPU_ONLY,
                    "hints": {"reshapeFrequency": ct.ReshapeFrequency.Frequent}}
    assert program.input_names == ["scores"] and program.state_names == []


class FakeModel:
    def __init__(self) -> None:
        self.seen: list[tuple[dict, object]] = []

    def make_state(self) -> str:
        return "state"

    def predict(self, data: dict, state: object = "absent") -> dict:
        self.seen.append((data, state))
        return {"y": [1.0, 2.0]}


def test_program_casts_inputs_and_passes_state_only_when_stateful() -> None:
    from ane_spec.runtime.coreml_backend import CoreMLProgram

    model = FakeModel()
    stateless = CoreMLProgram(model, ["x"], ["y"], [])
    assert stateless.make_state() is None
    x = np.full((1, 4), 1 / 3, dtype=np.float32)
    out = stateless.predict({"x": x})
    assert isinstance(out["y"], np.ndarray) and x.dtype == np.float32
    data, state = model.seen[-1]
    # The fp16 values, in a float32 array of our own (coremltools swaps nothing) that the feed
    # ring keeps alive past the call (the bridge's lifetime rule, coremltools #2827).
    assert data["x"].dtype == np.float32 and state == "absent"
    assert np.array_equal(data["x"], x.astype(np.float16).astype(np.float32))
    assert data["x"] is not x and stateless.feeds.holds(data["x"])

    stateful = CoreMLProgram(model, ["x"], ["y"], ["layer_0_k"])
    assert stateful.make_state() == "state"
    stateful.predict({"x": x}, "state")
    assert model.seen[-1][1] == "state"
    with pytest.raises(AneSpecError, match="make_state"):
        stateful.predict({"x": x})


# --- macOS only ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts(coreml_build):
    return coreml_build


def layer_inputs(entry, pos: int, t: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Host inputs for tokens pos..pos+t-1 (arbitrary rotation angles: both backends get the
    same ones, and they only need to agree)."""
    shapes = {s.name: [t if d == "T" else d for d in s.shape] for s in entry.inputs}
    angles = rng.uniform(-np.pi, np.pi, size=shapes["rope_cos"])
    mask = np.full(shapes["attn_mask"], -1e4, dtype=np.float16)
    write = np.zeros(shapes["kv_write_mask"], dtype=np.float16)
    for i in range(t):
        mask[0, 0, i, : pos + i + 1] = 0
        write[0, 0, pos + i, i] = 1
    return {"x": rng.standard_normal(shapes["x"]).astype(np.float16),
            "rope_cos": np.cos(angles).astype(np.float16),
            "rope_sin": np.sin(angles).astype(np.float16), "attn_mask": mask,
            "kv_write_mask": write}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.ravel(a).astype(np.float64), np.ravel(b).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@mac_only
def test_compile_is_cached_outside_the_build(artifacts, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    out, m = artifacts
    package = out / m.heads[0].file.path
    compiled = compile_package(package, m.heads[0].file.digest)
    assert compiled == tmp_path / "compiled" / f"{m.heads[0].file.digest}.mlmodelc"
    assert compiled.is_dir() and not (out / "head.mlmodelc").exists()
    stamp = compiled.stat().st_mtime_ns
    assert compile_package(package) == compiled and compiled.stat().st_mtime_ns == stamp


@mac_only
@pytest.mark.parametrize("units,reshape", [("CPU_ONLY", "Infrequent"),
                                           ("CPU_AND_NE", "Infrequent"),
                                           ("CPU_AND_NE", "Frequent")])
def test_layers_and_head_agree_with_the_mil_interpreter(artifacts, units: str,
                                                        reshape: str) -> None:
    from ane_spec.runtime.mil_backend import MILBackend

    out, m = artifacts
    shard = m.shards[0]
    coreml, mil = CoreMLBackend(units, reshape), MILBackend("fp16")
    programs = [b.load(out / shard.file.path) for b in (coreml, mil)]
    heads = [b.load(out / m.heads[0].file.path) for b in (coreml, mil)]
    assert isinstance(programs[0], LoadedProgram)
    assert sorted(programs[0].state_names) == ["layer_0_k", "layer_0_v", "layer_1_k", "layer_1_v"]
    assert sorted(programs[0].input_names) == sorted(s.name for s in shard.inputs)
    assert programs[0].output_names == ["hidden"]
    states = [p.make_state() for p in programs]
    assert heads[0].make_state() is None

    rng = np.random.default_rng(0)
    for pos, t in [(0, 1), (1, 4)]:
        inputs = layer_inputs(shard, pos, t, rng)
        hidden = [p.predict(dict(inputs), s)["hidden"] for p, s in zip(programs, states)]
        assert hidden[0].shape == hidden[1].shape == (1, 192, t, 1)
        assert cosine(*hidden) > 0.999, (units, t)
        logits = [h.predict({"x": x})["logits_0"] for h, x in zip(heads, hidden)]
        assert cosine(*logits) > 0.999, (units, t)

    k = [p.read_state(s, "layer_1_k") for p, s in zip(programs, states)]
    assert k[0].dtype == np.float32 and k[0].shape == (1, 2, S, 32)
    assert not k[0][:, :, 5:].any()  # rows past the 5 written tokens stay zero
    assert cosine(k[0][:, :, :5], k[1][:, :, :5]) > 0.999
