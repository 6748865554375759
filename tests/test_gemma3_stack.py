"""Gemma 3 built into shards and run: the programs, parity with the reference, the window
mask the host feeds, and exact speculative decoding.

Topology 2,1,1 on `gemma3-tiny` (layers local, local, global, local) gives an all-local shard,
an all-global one and another local one, so each way the shared inputs are split is built. The
parity prompts (17 and 40 tokens, and 36 for the prefill function's two chunks) are longer than
the window of 8. A prefill function of 24 rows keeps the local layers' rings at W + 24 = 32
slots (the default 64 would make them 96, longer than the 64-slot context: no ring at all).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.manifests.store import load_manifest
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.parity import run_parity
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.runtime.host_inputs import MASK_VALUE, HostInputs
from ane_spec.shards.build import BuildRequest, build
from ane_spec.shards.static_checks import dtype_problems, read_package_facts
from tests.decode_checks import assert_speculative_equals_greedy
from tests.test_gemma3 import CONDITIONED

S = 64
TOPOLOGY = "2,1,1"
PREFILL_T = 24


@pytest.fixture(scope="module")
def conditioned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(GGUF, build) of the well-conditioned fixture, for logit comparisons."""
    root = tmp_path_factory.mktemp("gemma3-build")
    gguf = write_synthetic_gguf(root / "gemma3.gguf", preset("gemma3-tiny", **CONDITIONED))
    build(gguf, root / "art", BuildRequest(topology=TOPOLOGY, max_seq=S, prefill_t=PREFILL_T))
    return gguf, root / "art"


def test_packages_are_fp16_with_gemmas_ops(conditioned: tuple[Path, Path]) -> None:
    art = conditioned[1]
    m = load_manifest(art).manifest
    assert [tuple(s.layers) for s in m.shards] == [(0, 2), (2, 3), (3, 4)]
    assert m.rope_local is not None and (m.rope_local.freq_base, m.rope_local.freq_scale) == (
        1e4, 1.0)
    assert (m.rope.freq_base, m.rope.freq_scale) == (1e6, 0.5)
    for shard in m.shards:
        facts = read_package_facts(art / shard.file.path)
        n = shard.layers[1] - shard.layers[0]
        assert dtype_problems(facts) == [] and set(facts.io_dtypes.values()) == {"fp16"}
        assert not {"cast", "softmax", "identity", "silu"} & set(facts.ops)
        # Per layer: q|k|v, o, gate|up, down; attn, q, k, post-attn, ffn and post-ffn norms.
        assert facts.ops["conv"] == 4 * n and facts.ops["layer_norm"] == 6 * n
        assert facts.ops["gelu"] == n
        inputs = {i.name: i.shape for i in shard.inputs}
        # The local tables and masks ride in the same inputs as the global ones; local layers
        # keep KV rings of W + P = 32 slots (test_swa_ring.py), the global layer 2 S slots.
        assert inputs["rope_cos"] == ["T", 64] and inputs["attn_mask"] == [1, 1, "T", S + 32]
        slots = 32 if m.model.is_local(shard.layers[0]) else S
        assert facts.states[f"layer_{shard.layers[0]}_k"] == ([1, 1, slots, 64], "fp16")


def test_host_local_mask_is_llama_cpps_window() -> None:
    """Row q of the local mask shows slots q - W < s <= q (is_masked_swa: hidden when
    q - s >= W); the global half is the plain causal mask; the tables are [global | local]."""
    g = preset("gemma3-tiny").to_config()
    from ane_spec.model.rope import make_rope_spec

    ones = np.ones(32)
    glob = make_rope_spec(rope_dims=64, freq_base=1e6, attn_factor=1.0, freq_scale=0.5,
                          original_context_length=S, context_window=S, short_factors=ones,
                          long_factors=ones, factor_set="none")
    loc = glob.model_copy(update={"freq_base": 1e4, "freq_scale": 1.0})
    host = HostInputs(glob, S, max_t=5, rope_local=loc, window=g.sliding_window,
                      dtype=np.float32)
    positions = [0, 7, 8, 30, 63]
    inputs = host.rows(positions, [True] * len(positions))
    mask = inputs["attn_mask"]
    assert mask.shape == (1, 2, len(positions), S)
    slots = np.arange(S)
    for r, q in enumerate(positions):
        assert ((mask[0, 0, r] == 0) == (slots <= q)).all()
        assert ((mask[0, 1, r] == 0) == ((slots <= q) & (slots > q - 8))).all()
        assert set(np.unique(mask[0, :, r])) <= {0.0, MASK_VALUE}
    cos_g, _ = glob.tables(positions)
    cos_l, _ = loc.tables(positions)
    np.testing.assert_allclose(inputs["rope_cos"], np.concatenate([cos_g, cos_l], 1), rtol=1e-6)
    with pytest.raises(Exception, match="local RoPE and a window"):
        HostInputs(glob, S, rope_local=loc, window=0)


def test_shards_match_the_reference(conditioned: tuple[Path, Path]) -> None:
    gguf, art = conditioned
    m = open_gguf(gguf)
    for precision in ("fp32", "fp16"):
        loaded, pipeline = open_pipeline(art, "mil", precision)
        parity = run_parity(loaded, pipeline, m, lengths=(17, 40), decode_steps=4)
        print("gemma3", precision, parity.summary())
        assert parity.passed and parity.figures["prefill_positions"] > 0
        assert parity.figures["gguf_min_cosine"] >= 0.999
        if precision == "fp32":
            assert parity.figures["min_cosine"] >= 0.9999
            assert parity.figures["argmax_agreement"] == 1.0
    block = run_block(pipeline)
    rows = run_row_invariance(pipeline)
    # Overflowing filler rows leave every other slot, the rings' included, bit for bit.
    overflow = run_overflow(pipeline)
    print("gemma3", block.summary(), "|", rows.summary(), "|", overflow.summary())
    assert block.passed and rows.passed and overflow.passed
    # At the prefill function's shape as well: chunks of 24 rows over 32-slot rings, the
    # same bits as T=4 passes, and its padding rows poisoned change nothing.
    assert block.figures["prefill_identical"] and rows.figures["cross_shape_identical"]
    assert "prefill-padding" in {c["case"] for c in overflow.details["cases"]}


def test_fp16_speculative_equals_greedy(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Embedding std 0.02 (x sqrt(160): ~0.25 beside post-normed branches of ~1) varies the
    greedy output as the drafter needs; the default 0.05 repeats one token (distinct per 20 on
    the reference: 0.02 -> 5..9, 0.05 -> 1..5, 0.1 -> 1; branch_scale does nothing here, the
    post-norms undo it). Prompts up to 30 tokens plus 20 generated cross the window often."""
    root = tmp_path_factory.mktemp("gemma3-chaotic")
    gguf = write_synthetic_gguf(root / "gemma3.gguf",
                                preset("gemma3-tiny", seed=11, embed_std=0.02))
    build(gguf, root / "art", BuildRequest(topology="4", max_seq=S, prefill_t=PREFILL_T))
    for prefill in ("off", "on"):  # prompts in T=4 passes, and in chunks of 24 over the rings
        pipeline = open_pipeline(root / "art", "mil", "fp16", prefill=prefill)[1]
        assert_speculative_equals_greedy(pipeline, token_limit=1000, longest=30,
                                         label=f"gemma3 prefill {prefill}")


def test_the_overflow_probe_compares_ring_slots_by_the_position_they_hold() -> None:
    """Positions 0..63 written into a 32-slot ring: slot j holds 32 + j. A rejected draft at 63
    must not be compared (slot 31), the positions below it must (slots 0..30); without a wrap,
    slot = position as in a full-length state."""
    from ane_spec.probes.overflow import _slots_holding_positions_below

    assert _slots_holding_positions_below(32, 63, 64).tolist() == list(range(31))
    assert _slots_holding_positions_below(32, 12, 13) == slice(0, 12)
    assert _slots_holding_positions_below(64, 63, 64) == slice(0, 63)
    # Written 0..43: slots hold 32..43 (0..11) and 12..31; below 40: 32..39 and 12..31.
    assert _slots_holding_positions_below(32, 40, 44).tolist() == [*range(8), *range(12, 32)]
