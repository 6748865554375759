"""Gemma 3 files: read as llama.cpp reads them, and the reference's sliding window and RoPE.

The fixture is the odd-sized `gemma3-tiny` preset: q 192 wide on a 160-wide stream (head_dim
64, key_length written), 4 layers with a period of 3 (local, local, global, local), a window of
8, and linear RoPE scaling 1/2 that llama.cpp applies to the global layer only. Shards and
llama.cpp are compared in test_gemma3_stack.py / test_gemma3_oracle.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFValueType

from ane_spec.errors import GGUFError
from ane_spec.model.config import ModelConfig
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.inspect import describe, format_description
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.synthetic import PRESETS, preset, write_synthetic_gguf
from ane_spec.shards.topology import check_budget, min_head_chunks, plan_topology
from tests.gguf_edit import rewrite_gguf

S = 64
# Embedding std 0.25: the sqrt(160)-scaled embeddings are ~3 per element beside post-normed
# branches of ~1, so every part of the graph moves the logits (see test_gemma3_oracle.py).
CONDITIONED = dict(embed_std=0.25, branch_scale=1.0, seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic_gguf(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf",
                                preset("gemma3-tiny", **CONDITIONED))


def test_reads_gemma3_as_llama_cpp_does(tiny: Path) -> None:
    m = open_gguf(tiny)
    c = m.config
    assert (c.arch, c.head_dim, c.q_dim, c.hidden_size) == ("gemma3", 64, 192, 160)
    # Period 3 (llama_hparams::set_swa_pattern): il % 3 < 2 is local.
    assert c.swa_layers == (True, True, False, True) and c.sliding_window == 8
    assert c.attention_scale == 1 / 8  # 1/sqrt(key_length), not 1/sqrt(hidden / heads)
    for i in range(c.num_layers):
        for name in ("post_attention_norm", "post_ffw_norm"):
            assert m.tensors[f"blk.{i}.{name}.weight"].shape == (160,)
        assert m.tensors[f"blk.{i}.attn_q_norm.weight"].shape == (64,)
    # Global layers: base 1e6 with the file's linear scaling; local: base_swa, no scaling.
    glob, loc = m.rope_spec(S), m.rope_spec(S, local=True)
    assert (glob.freq_base, glob.freq_scale) == (1e6, 0.5)
    assert (loc.freq_base, loc.freq_scale, loc.factor_set) == (1e4, 1.0, "none")
    assert m.metadata["gemma3.attention.sliding_window_pattern"] == 3
    assert ("sliding window 8 on 3 of 4 layers (global: [2]), local rope base 10000 unscaled; "
            "global rope scale 0.5") in format_description(describe(m))


def test_pattern_keys_and_refusals(tiny: Path, tmp_path: Path) -> None:
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    # No pattern key: llama.cpp's default for gemma3, 6 (all four layers local here).
    p = rewrite_gguf(tiny, tmp_path / "p.gguf", arch="gemma3",
                     drop_keys=("gemma3.attention.sliding_window_pattern",))
    assert open_gguf(p).config.swa_layers == (True,) * 4
    # No window: no local layers at all, whatever the pattern says.
    p = rewrite_gguf(tiny, tmp_path / "w.gguf", arch="gemma3",
                     drop_keys=("gemma3.attention.sliding_window",))
    c = open_gguf(p).config
    assert not c.has_local_layers and c.sliding_window == 0
    p = rewrite_gguf(tiny, tmp_path / "s.gguf", arch="gemma3",
                     set_keys={"gemma3.final_logit_softcapping": (30.0, f32)})
    with pytest.raises(GGUFError, match="final_logit_softcapping' is 30.0"):
        open_gguf(p)
    p = rewrite_gguf(tiny, tmp_path / "b.gguf", arch="gemma3",
                     set_keys={"gemma3.attention.sliding_window_pattern":
                               ("6", GGUFValueType.STRING)})
    with pytest.raises(GGUFError, match="sliding_window_pattern' must be a non-negative integer"):
        open_gguf(p)
    p = rewrite_gguf(tiny, tmp_path / "base.gguf", arch="gemma3",
                     set_keys={"gemma3.rope.freq_base_swa": (float("inf"), f32)})
    with pytest.raises(GGUFError, match="rope_freq_base_swa must be a positive finite"):
        open_gguf(p)
    # The local base is the file's when it has one; llama.cpp's default 10000 when not.
    p = rewrite_gguf(tiny, tmp_path / "b2.gguf", arch="gemma3",
                     set_keys={"gemma3.rope.freq_base_swa": (20000.0, f32)})
    assert open_gguf(p).rope_spec(S, local=True).freq_base == 20000.0
    p = rewrite_gguf(p, tmp_path / "b3.gguf", arch="gemma3",
                     drop_keys=("gemma3.rope.freq_base_swa",))
    assert open_gguf(p).rope_spec(S, local=True).freq_base == 10000.0
    # gemma3.cpp's one exception to 1/sqrt(key_length): 62 layers (the 27B) use n_embd/n_head.
    meta = open_gguf(tiny).metadata | {"gemma3.block_count": 62}
    c = ModelConfig.from_gguf_metadata(meta, vocab_size=1031, tied_embeddings=True, arch="gemma3")
    assert c.attention_scale == 1 / math.sqrt(160 // 3) and len(c.swa_layers) == 62
    # A window of 0 is llama.cpp's LLAMA_SWA_TYPE_NONE too.
    p = rewrite_gguf(tiny, tmp_path / "w0.gguf", arch="gemma3",
                     set_keys={"gemma3.attention.sliding_window": (0, u32)})
    assert not open_gguf(p).config.has_local_layers


@pytest.mark.parametrize("name,params,vocab", [
    # HF's parameter counts of google/gemma-3-270m and gemma-3-1b-pt (tied embeddings once).
    ("gemma-3-270m", 268_098_176, 262144),
    ("gemma-3-1b", 999_885_952, 262144),
    # The 4B's language model alone (HF counts its vision tower too): not an HF figure, the
    # same formula as the two above.
    ("gemma-3-4b", 3_880_263_168, 262208),
])
def test_real_size_presets(name: str, params: int, vocab: int) -> None:
    c = PRESETS[name].to_config()
    assert (c.arch, c.vocab_size, c.head_dim, c.num_parameters()) == ("gemma3", vocab, 256, params)
    assert c.swa_layers.count(False) == c.num_layers // 6  # layers 5, 11, ..: global
    assert c.attention_scale == 1 / 16
    ranges = plan_topology(c, "int8-channel", 2000)
    check_budget(ranges, c, "int8-channel", 2000)
    # 262,144 logits need 6 head chunks under the ANE's channel limit (the default 4 is
    # refused with that figure, so a Gemma build passes --head-chunks 6).
    assert ranges[-1][1] == c.num_layers and min_head_chunks(vocab) == 6
    assert c.rope_freq_scale == (0.125 if name == "gemma-3-4b" else 1.0)


def one_layer_local(tmp_path: Path, window: int) -> ReferenceModel:
    """A one-layer model whose only layer is local (pattern 0: every layer local)."""
    spec = preset("gemma3-tiny", num_layers=1, swa_pattern=0, sliding_window=window,
                  **CONDITIONED)
    path = write_synthetic_gguf(tmp_path / f"local{window}.gguf", spec)
    return ReferenceModel(open_gguf(path), context_window=S)


def test_a_local_row_sees_exactly_the_last_window_positions(tmp_path: Path) -> None:
    """llama.cpp's is_masked_swa hides key p0 from row p1 when p1 - p0 >= W. With one local
    layer, row p depends on token p0 exactly when p - W < p0 <= p."""
    w = 8
    ref = one_layer_local(tmp_path, w)
    tokens = list(range(100, 130))
    base = ref.logits(tokens)
    for p0 in (0, 5, 12):
        changed = tokens.copy()
        changed[p0] = 7
        moved = np.abs(ref.logits(changed) - base).max(-1) > 1e-4
        assert moved.tolist() == [p0 <= p < p0 + w for p in range(len(tokens))], p0
    # Decoding one token at a time (the cache path) gives the same logits as the whole prompt.
    cache = ref.new_cache()
    steps = np.concatenate([ref.forward(tokens[:5], cache).numpy()]
                           + [ref.forward([t], cache).numpy() for t in tokens[5:]])
    np.testing.assert_allclose(steps, base, rtol=1e-4, atol=1e-4)

