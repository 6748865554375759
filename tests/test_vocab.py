"""The synthetic vocabulary builder: Phi-4-mini's layout at any size, a real trained BPE."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time

import pytest

from ane_spec.errors import TokenizerError
from ane_spec.model import vocab as vocab_mod
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE
from ane_spec.model.tokenizer import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    Tokenizer,
    TokenizerData,
    bytes_to_unicode,
)
from ane_spec.model.vocab import CORPUS, build_synthetic_vocab

SPECIALS = ["<|endofprompt|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>", "<|tool|>",
            "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>", "<|tag|>"]


def _digest(data: TokenizerData) -> str:
    return hashlib.sha256(data.model_dump_json().encode()).hexdigest()


@pytest.fixture(scope="module")
def real() -> TokenizerData:
    vocab_mod._trained.cache_clear()
    t0 = time.perf_counter()
    data = build_synthetic_vocab(200064)
    elapsed = time.perf_counter() - t0
    print(f"build_synthetic_vocab(200064), cold: {elapsed:.2f} s, {len(data.merges)} merges")
    assert elapsed < 10
    return data


def _check_layout(data: TokenizerData, n: int) -> None:
    assert len(data.tokens) == len(data.token_types) == n
    eot = n - 65
    assert data.tokens[eot] == "<|endoftext|>" and data.token_types[eot] == TOKEN_CONTROL
    assert data.tokens[n - 46:n - 35] == SPECIALS
    assert set(data.token_types[n - 46:n - 35]) == {TOKEN_CONTROL}
    assert (data.bos_token_id, data.eos_token_id, data.unknown_token_id,
            data.padding_token_id) == (eot,) * 4
    assert not data.add_bos_token and not data.add_eos_token
    assert data.model == "gpt2" and data.pre == "gpt-4o"
    assert data.chat_template == PHI4_MINI_CHAT_TEMPLATE
    # Bytes first, in GPT-2 order; then merge results; nothing NORMAL past n - 67.
    assert data.tokens[:256] == list(bytes_to_unicode().values())
    n_normal = data.token_types.count(TOKEN_NORMAL)
    assert data.token_types[:n_normal] == [TOKEN_NORMAL] * n_normal
    assert n_normal <= n - 66
    # Everything else is a [PAD<id>] filler of type UNUSED.
    special_ids = {eot, *range(n - 46, n - 35)}
    for i in range(n_normal, n):
        if i not in special_ids:
            assert data.tokens[i] == f"[PAD{i}]" and data.token_types[i] == TOKEN_UNUSED, i
    # One new token per merge (the trained merges never repeat a result here).
    assert len(data.merges) == n_normal - 256


def test_real_size_layout(real: TokenizerData) -> None:
    _check_layout(real, 200064)
    assert real.tokens[199999] == "<|endoftext|>"
    assert real.tokens[200018] == "<|endofprompt|>" and real.tokens[200028] == "<|tag|>"
    assert real.tokens[200020] == "<|end|>" and real.tokens[200019] == "<|assistant|>"
    # The corpus, not the size, limits the merges here.
    assert 1500 < len(real.merges) < 200064 - 256 - 66


@pytest.mark.parametrize("n", [512, 1024, 4096])
def test_small_sizes(n: int) -> None:
    data = build_synthetic_vocab(n)
    _check_layout(data, n)
    if n <= 1024:  # the size, not the corpus, limits the merges: the BPE region is full
        assert len(data.merges) == n - 66 - 256
    assert data.tokens[n - 44] == "<|end|>"


def test_1024_ids() -> None:
    data = build_synthetic_vocab(1024)
    assert data.eos_token_id == 959 and data.tokens[959] == "<|endoftext|>"
    assert [data.tokens.index(s) for s in SPECIALS] == list(range(978, 989))


def test_too_small_is_refused() -> None:
    with pytest.raises(TokenizerError, match=">= 512"):
        build_synthetic_vocab(511)


def test_merges_are_valid(real: TokenizerData) -> None:
    index = {t: i for i, t in enumerate(real.tokens)}
    for rank, merge in enumerate(real.merges):
        a, b = merge.split(" ")
        assert a in index and b in index, merge
        # Each merge builds the next new token from tokens that already existed.
        assert index[a + b] == 256 + rank and index[a] < index[a + b] > index[b], merge
    alphabet = set(bytes_to_unicode().values())
    for t in real.tokens[:256 + len(real.merges)]:
        assert set(t) <= alphabet


def test_deterministic(real: TokenizerData) -> None:
    vocab_mod._trained.cache_clear()
    assert _digest(build_synthetic_vocab(200064)) == _digest(real)
    # ... and across processes (tokenizers' trainer is multi-threaded and hash-seeded).
    code = ("import hashlib; from ane_spec.model.vocab import build_synthetic_vocab as b; "
            "print(hashlib.sha256(b(200064).model_dump_json().encode()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"})
    assert out.stdout.strip() == _digest(real)


def test_seed_text_changes_merges() -> None:
    a = build_synthetic_vocab(4096)
    b = build_synthetic_vocab(4096, seed_text="zyzzyva quokka " * 50)
    assert a.merges != b.merges and "Ġquokka" in b.tokens and "Ġquokka" not in a.tokens
    _check_layout(b, 4096)
    # A seed text that spells special or filler names cannot make them BPE tokens.
    c = build_synthetic_vocab(2048, seed_text="<|end|>[PAD2000] " * 100)
    _check_layout(c, 2048)
    Tokenizer.from_data(c)


def test_vocab_tokenizes_like_a_real_one(real: TokenizerData) -> None:
    tok = Tokenizer.from_data(real)
    ids = tok.encode(CORPUS)
    assert len(ids) < len(CORPUS.encode()) / 3  # the merges compress their own corpus
    assert tok.decode(ids) == CORPUS
    assert tok.encode(" the") == [tok.id_of("Ġthe")]
    # Out-of-corpus text still encodes (bytes are always there) and round-trips.
    text = "Zebrafish ᚠᛇᚻ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🦀"
    assert tok.decode(tok.encode(text)) == text
