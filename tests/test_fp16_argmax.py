"""The float16 argmax shortcut must answer exactly what np.argmax of the float values answers:
checked on every finite half-precision bit pattern, on rows built to tie, and through a real
build's head. A row holding any non-finite value (every NaN and inf bit pattern) is refused on
every path, the same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.fp16_argmax import NonFiniteLogits, argmax, chunked_argmax, order_keys
from ane_spec.runtime.pipeline import BlockOutput
from ane_spec.shards.build import BuildRequest, build

ALL_HALVES = np.arange(65536, dtype=np.uint16).view(np.float16)
NON_NAN = ALL_HALVES[~np.isnan(ALL_HALVES)]
FINITE = ALL_HALVES[np.isfinite(ALL_HALVES)]
NON_FINITE = ALL_HALVES[~np.isfinite(ALL_HALVES)]  # +-inf and 2,046 NaNs of either sign


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


finite_halves = st.floats(width=16, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float16, st.integers(1, 300), elements=finite_halves | st.sampled_from(
    [0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8])),
       st.lists(st.integers(1, 299), max_size=3))
def test_argmax_and_chunked_argmax_match_numpy(row: np.ndarray, cuts: list[int]) -> None:
    expected = int(row.astype(np.float32).argmax())
    assert argmax(row) == expected
    bounds = sorted({0, *[c for c in cuts if c < len(row)], len(row)})
    parts = [(a, row[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert chunked_argmax(parts) == expected
    assert chunked_argmax([(a, v.astype(np.float32)) for a, v in parts]) == expected


def _every_path(row: np.ndarray, cut: int) -> dict[str, object]:
    """Each way a token is chosen from one row: the keys on float16, numpy on float32, chunked
    (cut at `cut`) in both dtypes, and a pass's row_argmax fresh (head buffers), after the row was
    read, and from its float32 logits alone."""
    wide = row.astype(np.float32)
    parts = [(0, row[:cut]), (cut, row[cut:])]

    def fresh() -> int:
        return BlockOutput(1, lambda i: wide, argmax_row=lambda i: chunked_argmax(parts)
                           ).row_argmax(0)

    def after_read() -> int:
        out = BlockOutput(1, lambda i: wide, argmax_row=lambda i: chunked_argmax(parts))
        try:
            out.row_logits(0)
        except NonFiniteLogits:
            pass  # the read refuses too; the argmax after it must not answer regardless
        return out.row_argmax(0)

    return {"fp16": lambda: argmax(row), "fp32": lambda: argmax(wide),
            "chunked-fp16": lambda: chunked_argmax(parts),
            "chunked-fp32": lambda: chunked_argmax([(a, v.astype(np.float32)) for a, v in parts]),
            "pass-fresh": fresh, "pass-after-read": after_read,
            "pass-logits-only": lambda: BlockOutput.of_logits(wide[None]).row_argmax(0)}


def test_every_path_refuses_every_non_finite_half() -> None:
    """Each NaN and inf bit pattern, in the first chunk or a later one, first or last in it,
    beside finite values larger and smaller: every path raises. (Before: a negative NaN 0xFE00
    made the keys path answer the largest finite value, a NaN after the first chunk was skipped
    by the chunked argmax, and a row already read went through numpy, which answers the NaN.)"""
    rng = np.random.default_rng(3)
    for n, bad in enumerate(NON_FINITE):
        row = rng.choice(FINITE, 24)
        at = [0, 5, 11, 12, 17, 23][n % 6]  # first chunk (0..11) or second (12..23)
        row[at] = bad
        for path, choose in _every_path(row, 12).items():
            with pytest.raises(NonFiniteLogits, match="non-finite logits"):
                choose()
                pytest.fail(f"{path} chose a token beside {row.view(np.uint16)[at]:#06x}")


def test_every_path_agrees_on_finite_rows() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        row = rng.choice(FINITE, 24)
        row[rng.integers(0, 24, 3)] = row.max()  # ties
        expected = int(row.astype(np.float32).argmax())
        assert {path: choose() for path, choose in _every_path(row, 12).items()} == dict.fromkeys(
            _every_path(row, 12), expected)


def test_a_head_argmax_row_with_a_non_finite_maximum_is_refused() -> None:
    """A --head-argmax build reports each row's winning value; a NaN or inf there is refused,
    and a finite row beside it still answers."""
    for bad in (np.nan, np.inf, -np.inf):
        out = BlockOutput(2, None, argmax=np.array([3, 7]), max_logit=np.array([1.5, bad]))
        assert out.row_argmax(0) == 3
        with pytest.raises(NonFiniteLogits, match="row 1 of the pass"):
            out.row_argmax(1)


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


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
def test_a_real_pass_with_nan_logits_is_refused(build_dir: Path, precision: str) -> None:
    """NaN K/V in a visible slot (what a corrupted state would hold) makes a real pass's logits
    NaN: the head-buffer argmax, the logits read and decoding all refuse with one clear error."""
    _, pipeline = open_pipeline(build_dir, "mil", precision)
    state = pipeline.new_state()
    pipeline.run([5, 6, 7, 8], 0, state)
    shard = pipeline.shards[0]
    name = shard.state_names[0]
    kv = shard.read_state(state.shard_states[0], name)
    kv[:, :, 2, :] = np.nan
    shard.write_state(state.shard_states[0], name, kv)
    fast = pipeline.run([9], 4, pipeline.copy_state(state))
    with pytest.raises(NonFiniteLogits, match="row 0 of the pass holds non-finite logits"):
        fast.row_argmax(0)
    read = pipeline.run([9], 4, pipeline.copy_state(state))
    for step in (lambda: read.row_logits(0), lambda: read.row_argmax(0)):
        with pytest.raises(NonFiniteLogits):
            step()
    # Decoding: a session that already holds the prompt's K/V reuses it for the next request.
    session = DecodeSession(pipeline)
    session.generate([5, 6, 7, 8], GenerateOptions(max_tokens=1, speculative=False))
    shard.write_state(session.state.shard_states[0], name, kv)
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        session.generate([5, 6, 7, 8, 9], GenerateOptions(max_tokens=4))
