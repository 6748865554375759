"""shards/weight_sharing.py: a layer package's two functions store each weight once, matched by
shared memory where coremltools compares values, and the package is what coremltools' own
cross-function deduplication writes."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
    const_deduplication,
)

from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards import weight_sharing
from ane_spec.shards.build import BuildRequest, build


def test_same_memory_means_the_same_bytes_in_the_same_layout() -> None:
    a = np.arange(24, dtype=np.int8).reshape(4, 6)
    assert weight_sharing.same_memory(a, a)
    assert weight_sharing.same_memory(a, a.view())            # another object, same bytes
    assert weight_sharing.same_memory(a[:2], a[:2])
    assert not weight_sharing.same_memory(a, a.copy())        # equal values, other memory
    assert not weight_sharing.same_memory(a, a.T.T[:, ::1].reshape(6, 4))   # same bytes, other shape
    assert not weight_sharing.same_memory(a[:, :3], a[:, ::2])  # same start, other strides
    assert not weight_sharing.same_memory(a, a.view(np.uint8))  # same bytes, other type


def _packages(out: Path) -> dict[str, str]:
    return {f.relative_to(out).as_posix(): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(out.rglob("*"))
            if f.is_file() and ".mlpackage/" in f.as_posix() and f.name != "Manifest.json"}


def test_a_two_function_package_is_what_coremltools_dedup_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same build with coremltools' own find_constants (np.allclose over every pair) and
    with the shared-memory match: the same files byte for byte; most pairs matched without a
    comparison; and the weights stored once (the weight file of the two-function package no
    bigger than the decode-only build's: the issue allows 1.05x)."""
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset("tiny", num_layers=2))
    request = BuildRequest(topology="2", max_seq=128, residual_scale="off")
    matched: list[bool] = []
    same = weight_sharing.same_memory

    def counted(a: np.ndarray, b: np.ndarray) -> bool:
        matched.append(same(a, b))
        return matched[-1]

    monkeypatch.setattr(weight_sharing, "same_memory", counted)
    build(gguf, tmp_path / "fast", request)
    assert sum(matched) >= 2 * 7, matched   # each layer's seven matrices, at least
    with monkeypatch.context() as m:
        m.setattr(weight_sharing._SharedArrayDeduplication, "find_constants",
                  staticmethod(const_deduplication.find_constants))
        build(gguf, tmp_path / "coremltools", request)
    fast = _packages(tmp_path / "fast")
    assert len(fast) >= 4 and fast == _packages(tmp_path / "coremltools")

    build(gguf, tmp_path / "decode-only", request.model_copy(update={"prefill_t": 0}))
    layer = "shards/layers_00_02.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    both, alone = ((tmp_path / d / layer).stat().st_size for d in ("fast", "decode-only"))
    assert alone <= both <= 1.05 * alone
