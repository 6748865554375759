"""The prefill function (`build --prefill-t P`) under the gates, on tiny builds: its logits over
every row, parity, block, row invariance and overflow at its shape, and a build whose prefill
function alone is wrong (each gate must see it).

P = 16 at S = 64, so gate prompts span several chunks and the KV scatter's write-mask matmul
(K = T) takes the interpreter's BLAS path at T = P and its explicit sum at T = 4
(runtime/mil_ops.py): the cross-shape comparison covers both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ane_spec.shards.build as build_module
from ane_spec.manifests.store import load_manifest
from ane_spec.model.gguf_file import open_gguf
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.parity import run_parity
from ane_spec.probes.row_invariance import run_row_invariance, state_arrays
from ane_spec.runtime.mil_backend import MILBackend
from ane_spec.runtime.pipeline import ShardPipeline, prefill_logits
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.layer_graph import CORRECT, GraphVariant

S, P = 64, 16
# seeds/003's bug (the attention output reshaped without its transpose): invisible at T=1, so
# it must show wherever T > 1, here in the prefill function alone.
FLATTENED = GraphVariant(flatten="head_token_dim")


@pytest.fixture(scope="module")
def builds(tiny_gguf_conditioned: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("prefill-gates")
    request = BuildRequest(topology="2,1", max_seq=S, prefill_t=P)
    build(tiny_gguf_conditioned, root / "good", request)
    real = build_module.layer_program

    def prefill_broken(first_layer, layers, c, max_seq, layout, variant=CORRECT, **kwargs):
        if kwargs.get("tokens") is not None:  # the prefill function; the decode one stays right
            variant = FLATTENED
        return real(first_layer, layers, c, max_seq, layout, variant, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build_module, "layer_program", prefill_broken)
        build(tiny_gguf_conditioned, root / "broken", request)
    return {"good": root / "good", "broken": root / "broken", "gguf": tiny_gguf_conditioned}


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [rng.integers(0, 958, n).tolist() for n in (5, 17, 50, S)]


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_prefill_logits_equal_decode_passes_bit_for_bit(builds: dict, precision: str) -> None:
    """Every row's logits through the prefill function (the head run on each row) and every
    state afterwards: the same bits as the same prompt in T=4 passes, prompts of 5..64 tokens
    (1..4 chunks, the last padded)."""
    pipeline = open_pipeline(builds["good"], "mil", precision)[1]
    rows = 0
    for prompt in prompts():
        by_chunks, by_blocks = pipeline.new_state(), pipeline.new_state()
        chunked = prefill_logits(pipeline, prompt, by_chunks, prefill=True)
        blocked = prefill_logits(pipeline, prompt, by_blocks)
        assert chunked.shape == blocked.shape == (len(prompt), pipeline.config.vocab_size)
        assert np.array_equal(chunked, blocked), len(prompt)
        for a, b in zip(state_arrays(pipeline, by_chunks), state_arrays(pipeline, by_blocks)):
            assert a.tobytes() == b.tobytes()  # the same bits: no zero's sign differs either
        rows += len(prompt)
    assert rows == 136


def test_the_gates_pass_at_the_prefill_shape(builds: dict) -> None:
    gguf = open_gguf(builds["gguf"])
    for precision in ("fp32", "fp16"):
        loaded, pipeline = open_pipeline(builds["good"], "mil", precision)
        parity = run_parity(loaded, pipeline, gguf, lengths=(3, 17), decode_steps=4)
        block = run_block(pipeline)
        rows = run_row_invariance(pipeline)
        overflow = run_overflow(pipeline)
        for report in (parity, block, rows, overflow):
            print(precision, report.summary())
        f = parity.figures
        assert parity.passed and f["prefill_positions"] == f["positions"] == 3 + 17 + 24 + 12
        assert f["prefill_min_cosine"] >= (0.9999 if precision == "fp32" else 0.999)
        assert f["prefill_vs_decode_identical_rows"] == f["prefill_positions"]
        assert block.passed and block.figures["prefill_identical"]
        assert rows.passed and rows.figures["cross_shape_identical"]
        assert rows.figures["plans_per_case"] == 7 + 7 and rows.figures["prefill_t"] == P
        assert overflow.passed and sum(c["case"] == "prefill-padding"
                                       for c in overflow.details["cases"]) == 10


def test_a_broken_prefill_function_fails_every_gate_that_runs_it(builds: dict) -> None:
    """The decode function is right (its figures pass); the prefill function flattens its
    attention output [head, token, dim]: parity's prefill figures, block's prefill check and
    row invariance at shape P each fail."""
    loaded, pipeline = open_pipeline(builds["broken"], "mil", "fp32")
    parity = run_parity(loaded, pipeline, open_gguf(builds["gguf"]), lengths=(3, 17),
                        decode_steps=4)
    block = run_block(pipeline)
    rows = run_row_invariance(pipeline)
    for report in (parity, block, rows):
        print(report.summary())
    f = parity.figures
    assert f["min_cosine"] >= 0.9999 and f["decisive_argmax_agreement"] == 1.0
    assert not parity.passed and f["prefill_min_cosine"] < 0.99
    assert f["prefill_vs_decode_identical_rows"] < f["prefill_positions"]
    assert block.figures["min_cosine"] >= 0.99999 and block.figures["states_match"]
    assert not block.passed and not block.figures["prefill_identical"]
    assert not rows.passed and not rows.figures["cross_shape_identical"]
    assert all(name.split(", plan ")[1].startswith("prefill-")
               for name in rows.details["failures"])
    assert rows.figures["verdict"].startswith(f"ROW INVARIANCE BROKEN at T={P} on MIL")


def _blas_rounds_columns_alike() -> bool:
    """Whether this CPU's BLAS gives the first 4 columns of a [320, 192] x [192, n] product the
    same bits for n = 4 and n = 16 (the batched kernels' qkv conv at T=4 and T=P)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((320, 192)).astype(np.float32)
    x = rng.standard_normal((192, 16)).astype(np.float32)
    return np.array_equal(w @ x[:, :4], (w @ x)[:, :4])


@pytest.mark.skipif(_blas_rounds_columns_alike(), reason="this CPU's BLAS rounds a product's "
                    "columns alike at 4 and 16 columns, so the batched kernels agree across shapes")
def test_batched_kernels_differ_across_shapes(builds: dict) -> None:
    """The interpreter's one-BLAS-call-per-block kernels round a 16-column conv differently from
    a 4-column one (the first op that differs is each shard's qkv conv): a real backend on
    which the cross-shape check fails. In fp16 the rounding of every op hides the differences
    within a shape here (measured: every plan of one shape agrees), not across them."""
    pipeline = ShardPipeline(load_manifest(builds["good"]), MILBackend("fp16", kernels="batched"))
    report = run_row_invariance(pipeline)
    print(report.summary())
    assert not report.figures["cross_shape_identical"] and report.figures["deterministic"]
    assert report.figures["cross_shape_max_logit_diff"] > 0
    if report.passed:
        assert "ACROSS SHAPES the results differ" in report.figures["verdict"]
