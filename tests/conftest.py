"""Shared fixtures: synthetic GGUF files written once per test session by the real writer."""

from __future__ import annotations

import os

# Under xdist (-n 2) each worker has a core to itself: a BLAS or OpenMP pool per worker spins on
# the other worker's core (the real-model tests ran 4-5x slower than alone). Set before numpy or
# torch load; the servers, builds and children the tests start inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_var, "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from ane_spec.model.synthetic import preset, write_synthetic_gguf  # noqa: E402

# smollm2_gguf, qwen_coder_gguf: the catalog's real models, pulled once into the user's cache.
pytest_plugins = ("tests.real_models",)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 layers, d=192, varied greedy output (embed std 0.05, branches x4): decode tests."""
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", preset("tiny"))


@pytest.fixture(scope="session")
def tiny_gguf_conditioned(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Same shapes, well conditioned (embed std 1, branches x1): logit comparisons."""
    spec = preset("tiny", embed_std=1.0, branch_scale=1.0, seed=7)
    return write_synthetic_gguf(tmp_path_factory.mktemp("gguf") / "tiny-cond.gguf", spec)


@pytest.fixture(scope="session")
def tiny_build_512(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_gguf` built with a 512-token context (shards of 2 + 1 layers): the daemon suites
    that need room to generate (test_daemon_clients, test_daemon_hostile)."""
    from ane_spec.shards.build import BuildRequest, build

    out = tmp_path_factory.mktemp("tiny512") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=512))
    return out


@pytest.fixture(scope="session")
def coreml_build(tmp_path_factory: pytest.TempPathFactory):
    """(build folder, manifest): 2 layers in one shard + head, 64-token context, well
    conditioned: the stand-in's Core ML tests."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.shards.build import BuildRequest, build

    root = tmp_path_factory.mktemp("coreml")
    gguf = write_synthetic_gguf(root / "tiny2.gguf", preset("tiny", num_layers=2, embed_std=1.0,
                                                            branch_scale=1.0, seed=7))
    build(gguf, root / "art", BuildRequest(topology="2", max_seq=64))
    return root / "art", load_manifest(root / "art").manifest


@pytest.fixture(scope="session")
def coreml_draft(tmp_path_factory: pytest.TempPathFactory):
    """(draft build, its GGUF): a draft model for `coreml_build` of its own weights: 1 layer,
    128 wide, the tiny preset's vocabulary (the target's), a 64-token context like the
    target's."""
    from ane_spec.shards.build import BuildRequest, build

    root = tmp_path_factory.mktemp("coreml-draft")
    gguf = write_synthetic_gguf(root / "draft.gguf", preset(
        "tiny", num_layers=1, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_size=256,
        rope_dims=16, seed=11))
    build(gguf, root / "draft", BuildRequest(topology="1", max_seq=64))
    return root / "draft", gguf


@pytest.fixture(scope="session")
def context_build(tmp_path_factory: pytest.TempPathFactory):
    """A 2-layer, 64-token build whose next tokens depend on the whole context (changing every
    prompt token but the last changes the next 4 tokens: `test_coreml_worker` shows it), unlike
    `coreml_build`, whose output follows the last token only: slot tests need this one, or a
    slot holding the wrong K/V would go unseen."""
    from ane_spec.shards.build import BuildRequest, build

    root = tmp_path_factory.mktemp("context")
    gguf = write_synthetic_gguf(root / "ctx.gguf", preset("tiny", num_layers=2, embed_std=0.3,
                                                          branch_scale=4.0, seed=7))
    build(gguf, root / "art", BuildRequest(topology="2", max_seq=64))
    return root / "art"


@pytest.fixture
def coreml_standin(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory):
    """coremltools' native layer replaced by tests/coreml_standin.py for one test: the real
    CoreMLBackend, compiled cache and everything above them run on Linux. The compiled-model
    cache is a fresh folder."""
    from ane_spec.runtime.compiled_cache import CACHE_ENV
    from tests import coreml_standin

    monkeypatch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("standin-cache")))
    coreml_standin.install(monkeypatch)
    # Core ML runs in worker processes (runtime/coreml_worker.py): they install it too.
    for key, value in coreml_standin.child_env().items():
        monkeypatch.setenv(key, value)
    return coreml_standin
