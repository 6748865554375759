"""The reference and tokenizer against llama.cpp itself (via llama-cpp-python, when installed).

Thresholds: llama.cpp quantizes activations to Q8_0 and keeps K/V in fp16, so an exact
re-implementation reaches cosine ~0.9998-0.9999 on well-conditioned synthetic models, while the
known bugs (no attention factor, all dims rotated, wrong factor set) land at 0.99 or below. 0.9995
separates the two (contract doc).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.tokenizer import Tokenizer

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional oracle)")

pytestmark = pytest.mark.oracle

TEXTS = [
    "Hello, world! It's a test.",
    "   leading spaces and    runs of   whitespace\t\ttabs",
    "numbers 1 12 123 1234 12345 3.14159 -42 1e10 2026-11-21",
    "They'll say I'M sure you've WE'D it's DON'T",
    "naïve café résumé façade Ærøskøbing São Paulo",
    "中文测试，日本語のテキスト、한국어 텍스트",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "line one\nline two\r\nline three\n\n\nend",
    "def f(x):\n    return x ** 2  # square\n",
    "<|system|>You are helpful.<|end|><|user|>Hi<|end|><|assistant|>",
    "mixed <|endoftext|> special <|tag|> tokens",
]


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def _llama(path: Path, n_ctx: int):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False,
                           n_threads=2, seed=0)


@pytest.mark.parametrize("n_ctx", [4096, 8192])
def test_reference_logits_match_llama_cpp(tiny_gguf_conditioned: Path, n_ctx: int) -> None:
    m = open_gguf(tiny_gguf_conditioned)
    llm = _llama(tiny_gguf_conditioned, n_ctx)
    rng = np.random.default_rng(n_ctx)
    for length in (7, 64):
        tokens = [int(t) for t in rng.integers(0, 958, length)]
        llm.reset()
        llm.eval(tokens)
        theirs = np.array(llm.scores[:length], dtype=np.float64)
        ours = ReferenceModel(m, context_window=n_ctx).logits(tokens)
        cos = _cos(ours, theirs)
        print(f"n_ctx={n_ctx} T={length}: min cosine {cos.min():.6f}, "
              f"argmax agreement {(ours.argmax(-1) == theirs.argmax(-1)).mean():.3f}")
        assert cos.min() >= 0.9995


def test_tokenization_matches_llama_cpp(tiny_gguf: Path) -> None:
    tok = Tokenizer.from_data(open_gguf(tiny_gguf).tokenizer_data)
    llm = llama_cpp.Llama(model_path=str(tiny_gguf), n_ctx=256, vocab_only=True, verbose=False)
    for text in TEXTS:
        for special in (True, False):
            theirs = llm.tokenize(text.encode(), add_bos=False, special=special)
            assert tok.encode(text, special=special) == theirs, (text, special)


LLAMA_SCORES = """
import json, sys
import numpy as np
import llama_cpp
path, n_ctx, out, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2,
                      seed=0)
llm.eval(tokens)
np.save(out, np.array(llm.scores[:len(tokens)], dtype=np.float32))
"""


def test_fp16_shards_match_llama_cpp(tiny_gguf_conditioned: Path, tmp_path: Path) -> None:
    """The shipped fp16-only packages, run by the fp16 interpreter, against llama.cpp itself.
    0.99 is the issue's floor for the ANE's arithmetic (measured 0.9996+ here); argmax must agree
    at every position of this well-conditioned fixture. llama.cpp runs in a subprocess, so a
    crash there fails this test, not the run."""
    import json
    import os
    import subprocess
    import sys

    from ane_spec.probes.gates import open_pipeline
    from ane_spec.runtime.pipeline import prefill_logits
    from ane_spec.shards.build import BuildRequest, build

    build(tiny_gguf_conditioned, tmp_path / "art", BuildRequest(topology="2,1", max_seq=256))
    _, pipeline = open_pipeline(tmp_path / "art", "mil", "fp16")
    for length in (7, 64, 200):
        tokens = [int(t) for t in np.random.default_rng(length).integers(0, 958, length)]
        dump = tmp_path / f"llama-{length}.npy"
        subprocess.run([sys.executable, "-c", LLAMA_SCORES, str(tiny_gguf_conditioned), "4096",
                        str(dump), json.dumps(tokens)], check=True, timeout=300,
                       env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])})
        theirs = np.load(dump).astype(np.float64)
        ours = prefill_logits(pipeline, tokens).astype(np.float64)
        cos = _cos(ours, theirs)
        agree = (ours.argmax(-1) == theirs.argmax(-1)).mean()
        print(f"fp16 shards vs llama.cpp, T={length}: min cosine {cos.min():.6f}, "
              f"argmax agreement {agree:.3f}")
        assert cos.min() >= 0.99 and agree == 1.0
