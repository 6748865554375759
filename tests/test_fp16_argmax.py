"""The float16 argmax shortcut must answer exactly what np.argmax of the float values answers:
checked on every finite half-precision bit pattern (on both of its paths: the raw bits when the
maximum is positive, order keys otherwise), on rows built to tie, and through a real build's head.
A row holding any non-finite value (every NaN and inf bit pattern) is refused on every path, the
same way."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.fp16_argmax import NonFiniteLogits, argmax, order_keys
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


def test_argmax_of_rows_of_every_half_matches_numpy() -> None:
    """Every finite half, in rows of three with random others: rows whose maximum is positive
    (the raw-bits path), zero of either sign (where -0.0 == +0.0 must tie) and negative (the
    order-keys path), the first maximum winning."""
    rng = np.random.default_rng(5)
    paths = {"bits": 0, "keys": 0}
    for pool in (FINITE, FINITE[FINITE <= 0], np.array([0.0, -0.0, -1.0, 2.0], np.float16)):
        rows = rng.choice(pool, size=(len(FINITE), 3))
        rows[np.arange(len(FINITE)), rng.integers(0, 3, len(FINITE))] = rng.permutation(FINITE)
        expected = rows.astype(np.float32).argmax(axis=1)
        for row, want in zip(rows, expected):
            assert argmax(row) == want, row.view(np.uint16)
            paths["bits" if row.max() > 0 else "keys"] += 1
    assert min(paths.values()) > 10_000


finite_halves = st.floats(width=16, allow_nan=False, allow_infinity=False)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float16, st.integers(1, 300), elements=finite_halves | st.sampled_from(
    [0.0, -0.0, 65504.0, -65504.0, 6e-8, -6e-8])))
def test_argmax_matches_numpy(row: np.ndarray) -> None:
    expected = int(row.astype(np.float32).argmax())
    assert argmax(row) == expected
    assert argmax(row.astype(np.float32)) == expected
    assert BlockOutput(1, lambda i: row).row_argmax(0) == expected


def _every_path(row: np.ndarray) -> dict[str, object]:
    """Each way a token is chosen from one row: the float16 argmax, numpy on float32, and a
    pass's row_argmax fresh (from the head's float16 row), after the row's logits or values were
    read, and from float32 logits alone."""
    wide = row.astype(np.float32)

    def after(read: str) -> int:
        out = BlockOutput(1, lambda i: row)
        try:
            out.row_logits(0) if read == "logits" else out.row_values(0, np.array([0, 3]))
        except NonFiniteLogits:
            pass  # the read refuses too; the argmax after it must not answer regardless
        return out.row_argmax(0)

    return {"fp16": lambda: argmax(row), "fp32": lambda: argmax(wide),
            "pass-fresh": lambda: BlockOutput(1, lambda i: row).row_argmax(0),
            "pass-after-logits": lambda: after("logits"),
            "pass-after-values": lambda: after("values"),
            "pass-logits-only": lambda: BlockOutput.of_logits(wide[None]).row_argmax(0)}


def test_every_path_refuses_every_non_finite_half() -> None:
    """Each NaN and inf bit pattern, first, last or inside a row, beside finite values larger
    and smaller: every path raises. (Before: a negative NaN 0xFE00 made the keys path answer the
    largest finite value, a NaN after the first chunk was skipped by a chunked argmax, and a row
    already read went through numpy, which answers the NaN.)"""
    rng = np.random.default_rng(3)
    for n, bad in enumerate(NON_FINITE):
        row = rng.choice(FINITE, 24)
        at = [0, 5, 11, 12, 17, 23][n % 6]
        row[at] = bad
        for path, choose in _every_path(row).items():
            with pytest.raises(NonFiniteLogits, match="non-finite logits"):
                choose()
                pytest.fail(f"{path} chose a token beside {row.view(np.uint16)[at]:#06x}")


def test_every_path_agrees_on_finite_rows() -> None:
    rng = np.random.default_rng(4)
    for _ in range(200):
        row = rng.choice(FINITE, 24)
        row[rng.integers(0, 24, 3)] = row.max()  # ties
        expected = int(row.astype(np.float32).argmax())
        assert {path: choose() for path, choose in _every_path(row).items()} == dict.fromkeys(
            _every_path(row), expected)


def test_a_head_argmax_row_with_a_non_finite_maximum_is_refused() -> None:
    """A --head-argmax build reports each row's winning value; a NaN or inf there is refused,
    and a finite row beside it still answers."""
    for bad in (np.nan, np.inf, -np.inf):
        out = BlockOutput(2, None, argmax=np.array([3, 7]), max_logit=np.array([1.5, bad]))
        assert out.row_argmax(0) == 3
        with pytest.raises(NonFiniteLogits, match="row 1 of the pass"):
            out.row_argmax(1)


def test_signed_zeros_tie() -> None:
    """-0.0 == +0.0: the first of them is the maximum, whichever sign comes first."""
    assert argmax(np.array([-1.0, -0.0, 0.0, -0.0], np.float16)) == 1
    assert argmax(np.array([-1.0, 0.0, -0.0], np.float16)) == 1
    assert argmax(np.array([-0.0, -0.0], np.float16)) == 0


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
        fresh = pipeline.run(tokens, position, pipeline.copy_state(state))
        fast = pipeline.run(tokens, position, state)
        slow = [int(fast.row_logits(r).argmax()) for r in range(4)]
        assert [fresh.row_argmax(r) for r in range(4)] == slow
        assert not fresh._logits  # answered without a float32 copy of any row


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
