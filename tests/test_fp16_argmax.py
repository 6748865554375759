"""The float16 argmax shortcut must answer exactly what np.argmax of the float values answers:
checked on every one of the 65,536 half-precision bit patterns, on rows built to tie, and
through a real build's head."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.fp16_argmax import argmax, chunked_argmax, order_keys
from ane_spec.shards.build import BuildRequest, build

ALL_HALVES = np.arange(65536, dtype=np.uint16).view(np.float16)
NON_NAN = ALL_HALVES[~np.isnan(ALL_HALVES)]


def test_keys_order_every_half_like_its_value() -> None:
    keys = order_keys(NON_NAN).astype(np.int64)
    values = NON_NAN.astype(np.float64)
    by_value = np.argsort(values, kind="stable")
    assert np.all(np.diff(keys[by_value]) >= 0)
    # equal keys exactly where the values are equal (+0.0 and -0.0 are the only such pair)
    assert np.array_equal(np.diff(keys[by_value]) == 0, np.diff(values[by_value]) == 0)
    assert order_keys(np.array([-0.0, 0.0], np.float16)).tolist() == [0, 0]


def test_argmax_of_every_pair_of_halves_matches_numpy() -> None:
    """Each half against a sample of others, in both orders: the first maximum wins."""
    rng = np.random.default_rng(0)
    for other in rng.choice(NON_NAN, 64):
        for row in (np.stack([NON_NAN, np.full_like(NON_NAN, other)], 1),
                    np.stack([np.full_like(NON_NAN, other), NON_NAN], 1)):
            keys = order_keys(row.ravel()).reshape(row.shape)
            assert np.array_equal(keys.argmax(1), row.astype(np.float32).argmax(1))


finite_halves = st.floats(width=16, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float16, st.integers(1, 300), elements=finite_halves | st.sampled_from(
    [0.0, -0.0, 65504.0, -65504.0, float("inf"), float("-inf"), 6e-8, -6e-8])),
       st.lists(st.integers(1, 299), max_size=3))
def test_argmax_and_chunked_argmax_match_numpy(row: np.ndarray, cuts: list[int]) -> None:
    expected = int(row.astype(np.float32).argmax())
    assert argmax(row) == expected
    bounds = sorted({0, *[c for c in cuts if c < len(row)], len(row)})
    parts = [(a, row[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert chunked_argmax(parts) == expected
    assert chunked_argmax([(a, v.astype(np.float32)) for a, v in parts]) == expected


def test_ties_across_chunks_go_to_the_first() -> None:
    row = np.zeros(12, np.float16)
    row[[4, 9]] = 3.0
    row[2] = -0.0
    assert chunked_argmax([(0, row[:6]), (6, row[6:])]) == 4
    assert chunked_argmax([(0, np.zeros(3, np.float16)), (3, -np.zeros(3, np.float16))]) == 0


@pytest.fixture(scope="module")
def build_dir(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fp16-argmax") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=32, head_chunks=3))
    return out


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_pass_argmax_from_the_head_buffers_equals_the_logits_argmax(build_dir: Path,
                                                                     precision: str) -> None:
    _, pipeline = open_pipeline(build_dir, "mil", precision)
    state = pipeline.new_state()
    rng = np.random.default_rng(1)
    for position in range(0, 24, 4):
        tokens = rng.integers(0, 958, 4).tolist()
        fast = pipeline.run(tokens, position, state)
        assert fast._argmax_row is not None
        slow = [int(fast.row_logits(r).argmax()) for r in range(4)]
        fresh = pipeline.run(tokens, position, pipeline.copy_state(state))
        assert [fresh.row_argmax(r) for r in range(4)] == slow
        assert not fresh._logits  # answered without reading a float32 row
