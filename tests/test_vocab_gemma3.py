"""The synthetic Gemma 3 vocabulary (vocab_gemma3): its layout, SentencePiece tokenization with
byte fallback, its end-of-generation set, and (with llama-cpp-python) all of these as llama.cpp
itself reads the same vocabulary from a GGUF."""

from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from pathlib import Path

import pytest

from ane_spec.errors import TokenizerError
from ane_spec.model import vocab as vocab_mod
from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE
from ane_spec.model.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
    TokenizerData,
)
from ane_spec.model.vocab import CORPUS, build_synthetic_vocab
from ane_spec.model.vocab_gemma3 import GEMMA3_MIN_VOCAB_SIZE, corpus_alphabet

REAL = 262144
# Characters the corpus never holds twice, so they have no piece: byte fallback.
RARE = "中文 😀 ☃ 𝄞 ऄ"


@pytest.fixture(scope="module")
def real() -> TokenizerData:
    return build_synthetic_vocab(REAL, family="gemma3")


@pytest.fixture(scope="module")
def small() -> TokenizerData:
    return build_synthetic_vocab(2048, family="gemma3")


def test_real_size_layout(real: TokenizerData) -> None:
    t, k = real.tokens, real.token_types
    assert len(t) == len(k) == len(real.scores or []) == REAL
    assert t[:6] == ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "[multimodal]"]
    assert t[6] == "<unused0>" and t[104] == "<unused98>"
    assert (t[105], t[106]) == ("<start_of_turn>", "<end_of_turn>")
    assert set(k[:5]) == {TOKEN_CONTROL} and k[5] == TOKEN_USER_DEFINED
    assert set(k[6:107]) == {TOKEN_CONTROL}
    assert t[107] == "\n" and t[137] == "\n" * 31 and t[138] == "  " and t[167] == " " * 31
    assert (t[168], t[237]) == ("<table>", "</footer>")
    assert set(k[107:238]) == {TOKEN_USER_DEFINED}
    assert t[238:494] == [f"<0x{b:02X}>" for b in range(256)]
    assert set(k[238:494]) == {TOKEN_BYTE}
    # The image tail at its real ids, <unused99>.. after it.
    assert (t[255999], t[256000], t[256001], t[-1]) == (
        "<start_of_image>", "<end_of_image>", "<unused99>", f"<unused{99 + REAL - 256002}>")
    assert set(k[255999:]) == {TOKEN_CONTROL}
    # NORMAL pieces from 494 on, merges first (SentencePiece order: '▁t'-like pairs), then
    # UNUSED [PAD<id>] fillers up to the tail.
    n_normal = k.count(TOKEN_NORMAL)
    assert k[494:494 + n_normal] == [TOKEN_NORMAL] * n_normal
    assert len(t[494]) == 2 and 1500 < n_normal < 20000  # the corpus limits it
    assert all(t[i] == f"[PAD{i}]" and k[i] == TOKEN_UNUSED
               for i in range(494 + n_normal, 255999))
    assert len(set(t)) == REAL
    # Scores rank the pieces strictly (SentencePiece: -rank); added tokens sit at -1000.
    s = real.scores or []
    assert all(a > b for a, b in zip(s[494:494 + n_normal], s[495:494 + n_normal]))
    assert s[105] == s[106] == -1000.0
    d = real
    assert (d.model, d.bos_token_id, d.eos_token_id, d.unknown_token_id,
            d.padding_token_id) == ("llama", 2, 1, 3, 0)
    assert d.add_bos_token and not d.add_eos_token and not d.add_space_prefix
    assert d.chat_template == GEMMA3_CHAT_TEMPLATE and not d.merges


def test_deterministic_and_any_size(small: TokenizerData) -> None:
    vocab_mod._gemma3.cache_clear()
    again = build_synthetic_vocab(2048, family="gemma3")
    assert again == small and again is not small
    # ... and across processes (tokenizers' trainer is multi-threaded and hash-seeded).
    code = ("import hashlib; from ane_spec.model.vocab import build_synthetic_vocab as b; "
            "print(hashlib.sha256(b(2048, family='gemma3').model_dump_json().encode())"
            ".hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={"PYTHONHASHSEED": "12345", "RAYON_NUM_THREADS": "1"},
                         cwd=Path(__file__).parent.parent)
    assert out.stdout.strip() == hashlib.sha256(small.model_dump_json().encode()).hexdigest()
    # A seed text adds its words; one spelling fixed or filler names cannot make them pieces.
    seeded = build_synthetic_vocab(2048, family="gemma3",
                                   seed_text="zyzzyva quokka " * 50 + "<b>[PAD1500]</b> " * 50)
    assert "▁quokka" in seeded.tokens and "▁quokka" not in small.tokens
    assert seeded.tokens.count("<b>") == 1 and seeded.tokens.count("</b>") == 1
    assert [i for i, t in enumerate(seeded.tokens) if t == "[PAD1500]"] in ([], [1500])
    assert any(t.startswith("[PA") for t in seeded.tokens[494:])  # the seed was learned
    for n in (GEMMA3_MIN_VOCAB_SIZE, 1500, 5000):
        d = build_synthetic_vocab(n, family="gemma3")
        assert len(d.tokens) == n and d.tokens[-1].startswith("<unused")
        assert d.tokens[n - len(d.tokens) + 105] == "<start_of_turn>"
        # Every character the corpus holds twice keeps a piece, however small the vocabulary.
        assert set(corpus_alphabet(CORPUS)) <= set(d.tokens)
    with pytest.raises(TokenizerError, match=f"vocab_size >= {GEMMA3_MIN_VOCAB_SIZE}"):
        build_synthetic_vocab(GEMMA3_MIN_VOCAB_SIZE - 1, family="gemma3")


@pytest.mark.parametrize("size", ["small", "real"])
def test_round_trip_and_byte_fallback(size: str, request: pytest.FixtureRequest) -> None:
    data: TokenizerData = request.getfixturevalue(size)
    tok = Tokenizer.from_data(data)
    for line in CORPUS.splitlines(keepends=True) + [CORPUS]:
        ids = tok.encode(line)
        assert tok.decode(ids) == line
    # Pieces, not characters: on the corpus's English prose the learned merges give 3.6
    # characters a token at 2048 entries and 4.9 at full size (a real vocabulary: ~4.5); a
    # tokenizer falling back to characters or bytes would give 1 or less.
    prose = CORPUS[:CORPUS.index("def fibonacci")]
    assert len(tok.encode(prose)) < len(prose) / 3
    ids = tok.encode(f"The {RARE} end")
    assert tok.decode(ids) == f"The {RARE} end"
    byte_ids = [i for i in ids if tok.token_type(i) == TOKEN_BYTE]
    rare_bytes = "".join(c for c in RARE if c != " ").encode()
    assert bytes(int(tok.token_text(i)[3:5], 16) for i in byte_ids) == rare_bytes
    assert tok.token_text(ids[0]) == "The"  # add_space_prefix false: no ▁ in front
    assert tok.encode("a", add_special=True) == [2, tok.id_of("a")]  # <bos>, no <eos>


def test_specials_and_whitespace_tokens(small: TokenizerData) -> None:
    tok = Tokenizer.from_data(small)
    ids = tok.encode("<start_of_turn>user\nHi<end_of_turn>\n", special=True)
    assert ids[0] == 105 and 106 in ids and ids[ids.index(106) - 1] != 106
    assert tok.id_of("\n") in ids
    # Without special parsing, the markup is text; newline and space runs are USER_DEFINED
    # tokens matched anywhere, as llama.cpp matches them.
    plain = tok.encode("<start_of_turn>", special=False)
    assert 105 not in plain and tok.decode(plain) == "<start_of_turn>"
    assert tok.encode("\n\n\n") == [109] and tok.encode("    ") == [140]


def test_end_of_generation(real: TokenizerData) -> None:
    """llama.cpp's rule on this layout: EOS <eos>, EOT found by text (<end_of_turn>), and the
    text-matched EOG list, which holds "</s>" and so takes Gemma 3's HTML tag too."""
    tok = Tokenizer.from_data(real)
    assert tok.eog_ids == {1, 106, 212} and real.tokens[212] == "</s>"
    assert tok.token_type(212) == TOKEN_CONTROL  # retyped, as llama.cpp does


def _write_vocab_gguf(data: TokenizerData, path: Path) -> None:
    """A vocabulary-only GGUF with the metadata a converted Gemma 3 carries."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in (("context_length", 4096), ("embedding_length", 64),
                        ("feed_forward_length", 128), ("block_count", 1), ("head_count", 2),
                        ("head_count_kv", 2), ("layer_norm_rms_eps", 1e-5),
                        ("rope_dimension_count", 32), ("tokenizer_model", "llama"),
                        ("tokenizer_pre", "default"), ("token_list", data.tokens),
                        ("token_types", data.token_types), ("token_scores", data.scores),
                        ("add_space_prefix", data.add_space_prefix), ("bos_token_id", 2),
                        ("eos_token_id", 1), ("unk_token_id", 3), ("pad_token_id", 0),
                        ("add_bos_token", True), ("add_eos_token", False),
                        ("chat_template", data.chat_template)):
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.oracle
def test_matches_llama_cpp(small: TokenizerData, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from ane_spec.model.gguf_file import tokenizer_data_from_metadata
    from ane_spec.model.gguf_format import read_gguf

    path = tmp_path / "gemma3-vocab.gguf"
    _write_vocab_gguf(small, path)
    # ane-spec's reader gets the same vocabulary back from the file llama.cpp reads.
    meta = read_gguf(str(path), path.name).metadata
    assert tokenizer_data_from_metadata(meta, path.name) == small
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    tok = Tokenizer.from_data(small)
    theirs_eog = {i for i in range(len(small.tokens)) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    assert theirs_eog == set(tok.eog_ids) == {1, 106, 212}
    rng = random.Random(3)
    extras = ["<start_of_turn>user\n", "<end_of_turn>", "  \n\n", "<b>x</b>", RARE, "</s>"]
    for k in range(200):
        start = rng.randrange(len(CORPUS))
        text = CORPUS[start:start + rng.randint(0, 160)] + rng.choice(extras) * (k % 2)
        for special in (False, True):
            theirs = llm.tokenize(text.encode(), add_bos=True, special=special)
            assert tok.encode(text, special=special, add_special=True) == theirs, text
