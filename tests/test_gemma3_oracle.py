"""A Gemma 3 file against llama.cpp itself (llama-cpp-python, when installed).

Prompts of 7, 64 and 200 tokens on the `gemma3-tiny` fixture (window 8, layers local, local,
global, local), so both kinds of layer shape every row past the eighth. Thresholds as for the
other families (test_architectures_oracle.py): cosine >= 0.9995, argmax equal where llama.cpp's
top-2 margin is decisive. The fixture is conditioned so that each Gemma-specific step matters:
the test also checks that dropping the window, giving local layers the global RoPE, or using
SiLU instead of tanh-GELU falls well below the threshold against the same llama.cpp logits
(measured: 0.67, 0.94, 0.994 at 200 tokens), so passing is evidence, not slack. The shards
(topology 2,1,1: an all-local, an all-global and a local shard) are held to the other families'
floors: fp32 0.999 (int8 requantized weights), fp16 0.99, argmax equal where decisive.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import prefill_logits
from ane_spec.shards.build import BuildRequest, build
from tests.test_gemma3 import CONDITIONED

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional oracle)")
from tests.test_architectures_oracle import (  # noqa: E402
    N_CTX,
    cosines,
    decisive_argmax,
    llama_cpp_run,
    prompts,
)

pytestmark = pytest.mark.oracle


@pytest.fixture(scope="module")
def oracle(tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[Path, list[list[int]], list[np.ndarray]]:
    root = tmp_path_factory.mktemp("gemma3-oracle")
    path = write_synthetic_gguf(root / "gemma3.gguf", preset("gemma3-tiny", **CONDITIONED))
    token_lists = prompts(900)
    _, scores = llama_cpp_run(path, root, evals=token_lists)
    return path, token_lists, scores


def worst(ref: ReferenceModel, token_lists: list[list[int]], scores: list[np.ndarray]
          ) -> tuple[float, float]:
    """(min cosine, decisive argmax agreement) over every row of every prompt."""
    cos, agree = 1.0, 1.0
    for tokens, theirs in zip(token_lists, scores):
        ours = ref.logits(tokens).astype(np.float64)
        cos = min(cos, float(cosines(ours, theirs).min()))
        agree = min(agree, decisive_argmax(ours, theirs)[0])
    return cos, agree


def test_reference_matches_llama_cpp(oracle: tuple[Path, list[list[int]], list[np.ndarray]]
                                     ) -> None:
    path, token_lists, scores = oracle
    m = open_gguf(path)
    cos, agree = worst(ReferenceModel(m, context_window=N_CTX), token_lists, scores)
    print(f"gemma3 reference vs llama.cpp: min cosine {cos:.6f}, decisive argmax {agree:.3f}")
    assert cos >= 0.9995 and agree == 1.0

    # The same comparison catches each Gemma-specific step done wrong.
    no_window = ReferenceModel(m, context_window=N_CTX)
    no_window.config = m.config.model_copy(update={"sliding_window": 10**6})
    global_rope = ReferenceModel(m, context_window=N_CTX)
    global_rope.rope_local = global_rope.rope
    silu = ReferenceModel(m, context_window=N_CTX)
    silu.arch = replace(silu.arch, ffn_activation="silu")
    for name, ref in (("no window", no_window), ("global RoPE everywhere", global_rope),
                      ("silu", silu)):
        cos, _ = worst(ref, token_lists, scores)
        print(f"gemma3 reference with {name}: min cosine {cos:.6f}")
        assert cos < 0.999, name


def test_shards_match_llama_cpp(oracle: tuple[Path, list[list[int]], list[np.ndarray]],
                                tmp_path: Path) -> None:
    path, token_lists, scores = oracle
    build(path, tmp_path / "art", BuildRequest(topology="2,1,1", max_seq=256))
    for precision in ("fp32", "fp16"):
        pipeline = open_pipeline(tmp_path / "art", "mil", precision)[1]
        for tokens, theirs in zip(token_lists, scores):
            shards = prefill_logits(pipeline, tokens).astype(np.float64)
            cos = cosines(shards, theirs)
            agree, n = decisive_argmax(shards, theirs)
            print(f"gemma3 {precision} shards vs llama.cpp T={len(tokens)}: min cosine "
                  f"{cos.min():.6f}, decisive argmax {agree:.3f} of {n}")
            assert cos.min() >= (0.999 if precision == "fp32" else 0.99) and agree == 1.0
