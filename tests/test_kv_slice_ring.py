"""`--kv-write slice` on a build with KV rings (Gemma 3's sliding-window layers): a block that
wraps past the ring's last slot is written through two windows, one at the ring's end and one at
slot 0. The slice build computes the scatter build's bits, passes the probes, and fp16
speculative decoding past the wrap, with rejected drafts, equals greedy decoding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.runtime.host_inputs import ring_windows
from ane_spec.runtime.pipeline import ShardPipeline
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.static_checks import read_package_facts
from tests.kv_slice_checks import (
    assert_probes_pass,
    assert_same_run,
    assert_speculative_is_greedy_and_scatters,
    pipelines,
)

S = 64


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gemma3-tiny (window 8, varied output) with 32-slot rings on its local layers, both ways.
    Topology 2,1,1 (local, local | global | local): all-local and all-global shards, each with
    its own slice of the write inputs."""
    root = tmp_path_factory.mktemp("kv-slice-gemma")
    gguf = write_synthetic_gguf(root / "g.gguf", preset("gemma3-tiny", seed=11, embed_std=0.02))
    for form in ("scatter", "slice"):
        build(gguf, root / form, BuildRequest(topology="2,1,1", max_seq=S, prefill_t=8,
                                              kv_write=form))
    return {"scatter": root / "scatter", "slice": root / "slice"}


@pytest.fixture(scope="module")
def gemma_fp16(gemma: dict) -> dict[str, ShardPipeline]:
    return pipelines(gemma)


def test_a_ring_block_that_wraps_is_split_into_two_windows() -> None:
    assert ring_windows(np.array([30, 31, 0, 1]), 4, 32)[:2] == (28, 0)
    assert ring_windows(np.array([30, 31, 0, 1]), 4, 32)[2].tolist() == [False, False, True, True]
    first, second, taken = ring_windows(np.array([5, 6]), 4, 32)
    assert (first, second, taken.tolist()) == (5, 5, [False, False])
    assert ring_windows(np.array([31]), 4, 32)[:2] == (28, 28)
    with pytest.raises(AneSpecError, match="two windows of 4 slots"):
        ring_windows(np.array([31, 10]), 4, 32)


def test_ring_builds_write_two_windows_and_compute_the_scatters_bits(gemma: dict,
                                                                    gemma_fp16: dict) -> None:
    m = load_manifest(gemma["slice"]).manifest
    assert m.build.swa_ring == 32 and m.build.kv_write == "slice"
    for shard in m.shards:
        inputs = {i.name: i.shape for i in shard.inputs}
        assert inputs["kv_write_start"] == ["T", 3]
        assert inputs["kv_write_mask"] == [1, 1, 12, "T"]
        local = m.model.is_local(shard.layers[0])
        ops = read_package_facts(gemma["slice"] / shard.file.path).ops
        per_layer = 4 if local else 2  # K and V, two windows on a ring
        assert ops["slice_update"] == per_layer * (shard.layers[1] - shard.layers[0])
    pipes = gemma_fp16
    prompt = np.random.default_rng(4).integers(0, 1000, S).tolist()
    # Blocks of 3 cross the ring's end inside a pass (30..32); prefill chunks of 8 from 21
    # wrap too (29..36).
    assert assert_same_run(pipes, prompt, 3) == S
    assert assert_same_run(pipes, prompt[:S - 4], 3, prefill_at=21) == 21 + 5


def test_the_probes_pass_on_a_ring_slice_build(gemma_fp16: dict) -> None:
    assert_probes_pass(gemma_fp16["slice"])


def test_fp16_speculative_equals_greedy_past_the_ring_wrap(gemma_fp16: dict) -> None:
    """Prompts up to 30 tokens plus 24 generated run past the 32-slot ring's end, with drafts
    rejected on the way."""
    assert_speculative_is_greedy_and_scatters(gemma_fp16, vocab=1000, longest=30)
