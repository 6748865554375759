"""The embedded tiny-code model against llama.cpp (optional: skipped without llama-cpp-python).

llama.cpp runs in a child process (scripts/llama_cpp_oracle.py's worker), so a crash inside it
fails one test instead of the run. `python scripts/llama_cpp_oracle.py` runs the same checks at
full size and prints the figures.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from ane_spec.assets import tiny_code_model
from ane_spec.cli import main
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.tokenizer import Tokenizer

if importlib.util.find_spec("llama_cpp") is None:
    pytest.skip("llama-cpp-python is not installed (optional oracle)", allow_module_level=True)

pytestmark = pytest.mark.oracle

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "llama_cpp_oracle.py"
_spec = importlib.util.spec_from_file_location("llama_cpp_oracle", SCRIPT)
oracle = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oracle)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def gguf() -> Path:
    return tiny_code_model()


@pytest.fixture(scope="module")
def tokenizer(gguf: Path) -> Tokenizer:
    return Tokenizer.from_data(open_gguf(gguf).tokenizer_data)


def test_llama_cpp_loads_it(gguf: Path) -> None:
    info = oracle.call_llama_cpp("load", gguf, {})
    config = open_gguf(gguf).config
    assert info["n_vocab"] == config.vocab_size and info["n_embd"] == config.hidden_size
    # llama.cpp also counts the two LongRoPE tables (rope_dims/2 floats each), HF does not.
    assert info["n_params"] == config.num_parameters() + config.rope_dims


def test_tokenization_matches_llama_cpp(gguf: Path, tokenizer: Tokenizer) -> None:
    texts = oracle.TOKENIZE_TEXTS + oracle.code_prompts()
    theirs = oracle.call_llama_cpp("tokenize", gguf, {"texts": texts})
    for i, text in enumerate(texts):
        assert tokenizer.encode(text, special=True) == theirs["special"][i], text
        assert tokenizer.encode(text, special=False) == theirs["plain"][i], text


def test_greedy_matches_ane_spec_generate(gguf: Path, tokenizer: Tokenizer,
                                          tmp_path_factory: pytest.TempPathFactory,
                                          capsys: pytest.CaptureFixture) -> None:
    """Token for token: the q8-block build (the file's own Q8_0 blocks) on the fp32 interpreter.

    A difference is accepted only at a near tie of llama.cpp's own logits (margin < NEAR_TIE,
    its activation quantization's measured effect) where our token is its runner-up; the prefix
    before it must be identical. Tokens after a tie legitimately differ (different history).
    """
    manifest = oracle.build_q8_block(gguf, tmp_path_factory.mktemp("q8") / "art")
    prompts = oracle.code_prompts(n=3)
    max_tokens = 40
    theirs = oracle.call_llama_cpp("greedy", gguf, {
        "prompts": [tokenizer.encode(p, special=True) for p in prompts], "max_tokens": max_tokens})
    identical = 0
    for prompt, expected, top2 in zip(prompts, theirs["outputs"], theirs["top2"]):
        capsys.readouterr()
        assert main(["generate", "--manifest", str(manifest), "--prompt", prompt,
                     "--max-tokens", str(max_tokens), "--backend", "mil", "--precision", "fp32",
                     "--json"]) == 0
        ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tokens"]
        row = oracle.compare_greedy(ours, expected, top2)
        print(prompt[:30].replace("\n", " "), row)
        assert row["identical"] or row["near_tie"], row
        identical += row["identical"]
        assert len(set(expected)) > 2  # not the random-weight trap of one token repeated
    assert identical >= 2


def test_bits_per_byte_beat_gzip(gguf: Path) -> None:
    """llama.cpp's code length for held-out stdlib Python against `gzip -9` on the same bytes."""
    text, _ = oracle.held_out_text(24_000)
    bits = oracle.call_llama_cpp("bits", gguf, {"text": text})
    assert bits["detokenized_bytes"] == bits["bytes"]  # the tokens cover the text exactly
    model = bits["bits"] / bits["bytes"]
    gz, how = oracle.gzip_bits(text.encode())
    print(f"{bits['bytes']} held-out bytes: llama.cpp {model:.3f} bits/byte, {how} "
          f"{gz / bits['bytes']:.3f}")
    assert model < gz / bits["bytes"]
