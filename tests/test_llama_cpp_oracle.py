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
