"""The byte-level BPE tokenizer: split, merges, special tokens, decoding, streaming, validation.

Oracles: the `regex` module running the o200k pattern (an implementation independent of the
onig engine inside `tokenizers`), hand-built vocabularies whose answer is known, and — when
llama-cpp-python is installed — llama.cpp itself on adversarial random text.
"""

from __future__ import annotations

import random
import time

import pytest
import regex

from ane_spec.errors import TokenizerError
from ane_spec.model.tokenizer import (
    GPT4O_PATTERN,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    Tokenizer,
    TokenizerData,
    bytes_to_unicode,
    llama_cpp_split,
)
from ane_spec.model.vocab import build_synthetic_vocab

ORACLE = regex.compile(GPT4O_PATTERN)
V = 200064
EOT, END, USER, ASSISTANT, SYSTEM = V - 65, V - 44, V - 43, V - 45, V - 42

# Text on which llama.cpp's split and the o200k pattern agree (no combining marks, no non-ASCII
# cased letter next to an ASCII letter of another case).
TEXTS = [
    "Hello, world! It's a test.",
    "",
    " ",
    "a",
    "   leading spaces and    runs of   whitespace\t\ttabs   ",
    "trailing spaces    ",
    "trailing newline\n",
    "\n\n\n",
    " \n \n  \n",
    "digits 1 12 123 1234 12345 123456 1234567 3.14159 -42 1e10 2026-11-21 0x1F",
    "They'll say I'M sure you've WE'D it's DON'T 'S 's O'Neill y'all ’s",
    "HELLO'S Hello's hello's HeLLo'Ll McDonald's iPhone eBay camelCase PascalCase ABCdef",
    "naïve café résumé façade Ærøskøbing São Paulo Straße Größe Ökonomie ÀÉÎÕÜ",
    "中文测试，日本語のテキスト、한국어 텍스트 カタカナ ひらがな",
    "emoji 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷 keycap 1️⃣ ❤️",
    "line one\nline two\r\nline three\r\n\r\nend\rcarriage",
    "\ttab\t\tseparated\tvalues\t",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "punctuation!!! ??? ... --- *** ### (((nested))) [[x]] {{y}} <<z>> /// \\\\ ||| ;;; :::",
    "path/to/file.py //comment /* block */ a/b/c http://x.y/z?q=1&r=2#s",
    "quotes \"double\" 'single' «guillemets» „German“ ‘curly’",
    "math ∑ ∫ √ ≈ ≠ ≤ ≥ π Ω µ ² ³ ½ Ⅻ ٣ ١٢٣",
    "nbsp\u00a0here, em\u2003space, ideographic\u3000space, line\u2028sep, nel\u0085x",
    "control \x1c\x1d chars \x00 nul \x7f del, zero\u200bwidth, bom\ufeff",
    "mixed <|endoftext|> special <|tag|> tokens <|end|>",
    "<|system|>You are helpful.<|end|><|user|>Hi<|end|><|assistant|>",
    "x" * 300 + " " + "9" * 50,
]

# Where llama.cpp's split differs from the o200k pattern (see tokenizer.py's docstring):
# (text, llama.cpp words, o200k words).
DIVERGENT = [
    ("नमस्ते", ["नमस", "्त", "े"], ["नमस्ते"]),
    ("ПриветМир", ["ПриветМир"], ["Привет", "Мир"]),
    ("aÉb", ["aÉb"], ["a", "Éb"]),
    (" ÉCOLE", [" É", "COLE"], [" ÉCOLE"]),
    ("e\u0301cole", ["e", "\u0301cole"], ["e\u0301cole"]),
    ("สวัสดี", ["สว", "ัสด", "ี"], ["สวัสดี"]),
    # (?i:'s) also matches 's with a long s (U+017F, case-folds to s); llama.cpp's '[sS] does not.
    ("it'ſ", ["it", "'ſ"], ["it'ſ"]),
]


@pytest.fixture(scope="module")
def data() -> TokenizerData:
    return build_synthetic_vocab(V)


@pytest.fixture(scope="module")
def tok(data: TokenizerData) -> Tokenizer:
    return Tokenizer.from_data(data)


@pytest.fixture(scope="module")
def tok_hf(data: TokenizerData) -> Tokenizer:
    return Tokenizer.from_data(data, split="hf")


# -- pre-tokenization ----------------------------------------------------------------------------


def test_pattern_is_o200k() -> None:
    o200k = (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
        r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
    assert GPT4O_PATTERN == o200k


def test_hf_split_equals_regex_oracle(tok_hf: Tokenizer) -> None:
    # onig (inside tokenizers) and `regex` must agree on \p{..} classes, (?i:...) and \s.
    for text in TEXTS + [t for t, _, _ in DIVERGENT]:
        assert tok_hf.pre_tokenize(text) == ORACLE.findall(text), repr(text)


def test_llama_cpp_split_equals_regex_oracle_on_ordinary_text(tok: Tokenizer) -> None:
    for text in TEXTS:
        words = tok.pre_tokenize(text)
        assert words == ORACLE.findall(text), repr(text)
        assert "".join(words) == text


def test_llama_cpp_split_divergences(tok: Tokenizer, tok_hf: Tokenizer) -> None:
    for text, llama_words, o200k_words in DIVERGENT:
        assert ORACLE.findall(text) == o200k_words
        assert tok.pre_tokenize(text) == llama_words
        assert tok_hf.pre_tokenize(text) == o200k_words
        assert tok.decode(tok.encode(text)) == text == tok_hf.decode(tok_hf.encode(text))


def test_llama_cpp_split_random_text() -> None:
    """Always a partition of the text; equal to the o200k pattern unless marks or non-ASCII cased
    letters are present (the two known divergences), whatever else the text holds."""
    common = ["a", "b", "Z", "Q", "s", "t", "re", "ll", "D", "VE", "'", "'", "0", "7", "123",
              " ", " ", "  ", "\t", "\r", "\n", "\r\n", "/", ".", "!", "(", "_", "-", "$", "中",
              "あ", "ʰ", "न", "٣", "²", "😀", "👍🏽", "\u00a0", "\u3000", "\u2028", "\x85", "\x1c",
              "\u200d", "\ufffd", "\x00", "ไ"]
    risky = ["é", "É", "ж", "Ж", "ǅ", "\u0301", "्", "ั"]
    rng = random.Random(1234)
    diverged = 0
    for _ in range(3000):
        text = "".join(rng.choice(common) for _ in range(rng.randint(1, 14)))
        assert llama_cpp_split(text) == ORACLE.findall(text), repr(text)
        text2 = "".join(rng.choice(common + risky) for _ in range(rng.randint(1, 14)))
        words = llama_cpp_split(text2)
        assert "".join(words) == text2 and all(words)
        diverged += words != ORACLE.findall(text2)
    assert diverged > 100  # the divergent classes really do diverge


# -- BPE -------------------------------------------------------------------------------------------


def _tiny(merges: list[str], extra: list[tuple[str, int]] = ()) -> TokenizerData:
    """256 byte tokens + the merge results (in merge order) + `extra` (text, type) tokens."""
    tokens = list(bytes_to_unicode().values())
    for m in merges:
        a, b = m.split(" ")
        if a + b not in tokens:
            tokens.append(a + b)
    types = [TOKEN_NORMAL] * len(tokens)
    for text, typ in [("<|endoftext|>", TOKEN_CONTROL), ("<|end|>", TOKEN_CONTROL),
                      ("<|user|>", TOKEN_CONTROL), *extra]:
        tokens.append(text)
        types.append(typ)
    eot = tokens.index("<|endoftext|>")
    return TokenizerData(tokens=tokens, token_types=types, merges=merges, bos_token_id=eot,
                         eos_token_id=eot, unknown_token_id=None, padding_token_id=None)


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.token_text(i) for i in tok.encode(text)]


@pytest.mark.parametrize("split", ["llama.cpp", "hf"])
def test_bpe_applies_merges_by_rank(split: str) -> None:
    first_ab = Tokenizer.from_data(_tiny(["a b", "b c"]), split=split)
    first_bc = Tokenizer.from_data(_tiny(["b c", "a b"]), split=split)
    assert _pieces(first_ab, "abc") == ["ab", "c"]
    assert _pieces(first_bc, "abc") == ["a", "bc"]
    chain = Tokenizer.from_data(_tiny(["a b", "ab c", "Ġ abc"]), split=split)
    assert _pieces(chain, "abc abc ab") == ["abc", "Ġabc", "Ġ", "ab"]
    # Equal rank everywhere: leftmost pair first.
    leftmost = Tokenizer.from_data(_tiny(["a a"]), split=split)
    assert _pieces(leftmost, "aaaaa") == ["aa", "aa", "a"]
    # A later, lower-priority merge only applies once the better ones are exhausted.
    ranked = Tokenizer.from_data(_tiny(["b c", "a b", "a bc", "ab c"]), split=split)
    assert _pieces(ranked, "abc") == ["abc"] and _pieces(ranked, "ab") == ["ab"]
    assert ranked.encode("abc") == [ranked.id_of("abc")]
    # Merges never cross a word boundary (space starts a new word).
    assert _pieces(first_ab, "a b") == ["a", "Ġ", "b"]


def test_bpe_duplicate_merge_keeps_first_rank() -> None:
    tok = Tokenizer.from_data(_tiny(["b c", "a b", "b c"]))
    assert _pieces(tok, "abc") == ["a", "bc"]


def test_words_are_tokenized_independently(tok: Tokenizer, tok_hf: Tokenizer) -> None:
    for t in (tok, tok_hf):
        for text in TEXTS:
            if "<|" in text:
                continue
            whole = t.encode(text)
            assert whole == [i for w in t.pre_tokenize(text) for i in t.encode(w)], repr(text)


@pytest.mark.parametrize("split", ["llama.cpp", "hf"])
def test_round_trip_is_byte_exact(data: TokenizerData, split: str) -> None:
    t = Tokenizer.from_data(data, split=split)
    for text in TEXTS + [x for x, _, _ in DIVERGENT]:
        for special in (False, True):
            ids = t.encode(text, special=special)
            assert t.decode(ids) == text, (text, special)
            assert t.decode_bytes(ids) == text.encode("utf-8")
    # The corpus compresses (merges are really used) and decodes exactly.
    big = "\n".join(TEXTS)
    ids = t.encode(big)
    assert len(ids) < 0.6 * len(big.encode()) and t.decode(ids) == big


def test_hf_decoder_agrees(tok: Tokenizer) -> None:
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok._hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_lone_surrogate_becomes_replacement_char(tok: Tokenizer) -> None:
    assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")


# -- special tokens ----------------------------------------------------------------------------


def test_special_parsing(tok: Tokenizer) -> None:
    text = "<|user|>Hi there<|end|><|assistant|>"
    parsed = tok.encode(text, special=True)
    assert parsed[0] == USER and parsed[-2:] == [END, ASSISTANT]
    assert parsed[1:-2] == tok.encode("Hi there")
    plain = tok.encode(text, special=False)
    assert not set(plain) & {USER, END, ASSISTANT, EOT}
    assert tok.decode(plain) == text == tok.decode(parsed)
    # Special tokens split the text: no word spans them.
    assert tok.encode("a<|end|>b", special=True) == tok.encode("a") + [END] + tok.encode("b")
    assert tok.encode("<|end|><|end|>", special=True) == [END, END]
    assert tok.encode("<|en", special=True) == tok.encode("<|en")
    assert tok.encode("<|endoftext|>", special=True) == [EOT]


def test_user_defined_tokens_are_always_parsed() -> None:
    data = _tiny(["a b"], extra=[("<tool>", TOKEN_USER_DEFINED), ("<|user|>x", TOKEN_USER_DEFINED)])
    tok = Tokenizer.from_data(data)
    tool, userx, user = tok.id_of("<tool>"), tok.id_of("<|user|>x"), tok.id_of("<|user|>")
    for special in (False, True):
        assert tok.encode("ab<tool>ab", special=special) == [tok.id_of("ab"), tool, tok.id_of("ab")]
    # Longest special text first (llama.cpp's order), whatever its type.
    assert tok.encode("<|user|>x<|user|>", special=True) == [userx, user]
    assert tok.encode("<|user|>x<|user|>", special=False)[0] == userx
    # USER_DEFINED tokens render even when specials are skipped; CONTROL ones do not.
    assert tok.decode([tool, user], skip_special=True) == "<tool>"


def test_end_of_generation_names_are_forced_to_control() -> None:
    # llama.cpp overrides the type of a token named like an end-of-generation marker.
    data = _tiny(["a b"], extra=[("</s>", TOKEN_NORMAL)])
    tok = Tokenizer.from_data(data)
    eos = tok.id_of("</s>")
    assert tok.token_type(eos) == TOKEN_CONTROL and eos in tok.eog_ids
    assert tok.encode("</s>", special=True) == [eos] and eos not in tok.encode("</s>")


def test_eog_ids(tok: Tokenizer) -> None:
    assert tok.eog_ids == frozenset({EOT, END})
    assert tok.id_of("<|end|>") == END and tok.id_of("<|endoftext|>") == EOT
    assert tok.id_of("<|nonexistent|>") is None
    no_end = _tiny([])
    tokens = [t if t != "<|end|>" else "<|fin|>" for t in no_end.tokens]
    t2 = Tokenizer.from_data(TokenizerData(**{**no_end.model_dump(), "tokens": tokens}))
    assert t2.eog_ids == frozenset({t2.id_of("<|endoftext|>")})


def test_token_bytes_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == V
    b2u = bytes_to_unicode()
    for i, (byte, ch) in enumerate(b2u.items()):
        assert tok.token_bytes(i) == bytes([byte]) and tok.token_text(i) == ch
    assert tok.token_bytes(END) == b"<|end|>" and tok.is_special(END)
    assert tok.token_bytes(V - 1) == b"" and tok.token_type(V - 1) == TOKEN_UNUSED
    assert tok.token_bytes(tok.id_of("Ġthe")) == b" the"
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.token_bytes(V)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([0, -1])


def test_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|user|>Hi<|end|>", special=True) + [V - 1]  # and an UNUSED filler
    assert tok.decode(ids) == "<|user|>Hi<|end|>"
    assert tok.decode(ids, skip_special=True) == "Hi"


# -- streaming detokenizer ---------------------------------------------------------------------


def test_incremental_detokenizer_never_splits_a_character(tok: Tokenizer) -> None:
    text = "Hi 👨‍👩‍👧 and 😀🇫🇷 ok 中文 ñ!"
    ids = tok.encode(text)
    partial = [i for i in ids if not tok.token_bytes(i).decode("utf-8", "ignore")
               == tok.token_bytes(i).decode("utf-8", "replace")]
    assert partial, "the test needs characters split over several tokens"
    det = tok.detokenizer()
    chunks = [det.push(i) for i in ids]
    chunks.append(det.flush())
    assert "" in chunks  # something was held back
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == text
    # A stream cut inside a character: flush turns the remainder into one U+FFFD.
    emoji = tok.encode("😀")
    assert len(emoji) > 1
    det = tok.detokenizer()
    assert [det.push(i) for i in emoji[:-1]] == [""] * (len(emoji) - 1)
    assert det.flush() == "\ufffd" == tok.decode(emoji[:-1])
    assert det.push(tok.encode("a")[0]) == "a"  # usable again after flush


def test_incremental_detokenizer_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|assistant|>Sure 😀<|end|>", special=True)
    for skip in (False, True):
        det = tok.detokenizer(skip_special=skip)
        out = "".join(det.push(i) for i in ids) + det.flush()
        assert out == tok.decode(ids, skip_special=skip)
    assert out == "Sure 😀"


# -- validation ----------------------------------------------------------------------------------


def test_tokenizer_data_validation(data: TokenizerData) -> None:
    base = data.model_dump()
    # kimi-k2 is a name llama.cpp knows, but its split is a custom scanner, not a regex.
    with pytest.raises(TokenizerError, match="'kimi-k2' is not supported"):
        TokenizerData(**{**base, "pre": "kimi-k2"})
    with pytest.raises(TokenizerError, match="'bert' is not supported"):
        TokenizerData(**{**base, "model": "bert"})
    with pytest.raises(TokenizerError, match="'gemma4' goes with pre-tokenizer 'gemma4'"):
        TokenizerData(**{**base, "model": "gemma4"})
    with pytest.raises(TokenizerError, match="only 3 scores"):
        TokenizerData(**{**base, "model": "llama", "scores": [0.0] * 3})
    with pytest.raises(TokenizerError, match="token types"):
        TokenizerData(**{**base, "token_types": base["token_types"][:-1]})
    with pytest.raises(TokenizerError, match="eos_token_id 200064 is outside"):
        TokenizerData(**{**base, "eos_token_id": V})
    with pytest.raises(TokenizerError, match="unknown token type"):
        TokenizerData(**{**base, "token_types": [9] + base["token_types"][1:]})
    with pytest.raises(TokenizerError, match="appears twice"):
        TokenizerData(**{**base, "tokens": ["!"] + base["tokens"][1:300] + ["!"]
                         + base["tokens"][301:]})
    with pytest.raises(TokenizerError, match="add_bos_token is true"):
        TokenizerData(**{**base, "add_bos_token": True, "bos_token_id": None})
    with pytest.raises(TokenizerError, match="not of the form"):
        Tokenizer.from_data(TokenizerData(**{**base, "merges": ["ab"] + base["merges"]}))
    with pytest.raises(TokenizerError, match="inconsistent"):
        Tokenizer.from_data(TokenizerData(**{**base, "merges": ["q 九"] + base["merges"]}))
    with pytest.raises(TokenizerError, match="split must be"):
        Tokenizer.from_data(data, split="tiktoken")


def test_add_special_follows_gguf_flags(data: TokenizerData, tok: Tokenizer) -> None:
    assert tok.encode("hi", add_special=True) == tok.encode("hi")  # Phi-4-mini adds nothing
    flagged = Tokenizer.from_data(TokenizerData(**{**data.model_dump(), "add_bos_token": True}))
    assert flagged.encode("hi", add_special=True) == [EOT] + tok.encode("hi")


def _big_vocab(n_vocab: int = V, seed: int = 0) -> TokenizerData:
    """Real-size vocabulary: 199742 valid merges over random token pairs, Phi-4-mini layout."""
    rng = random.Random(seed)
    tokens = list(bytes_to_unicode().values())
    known = set(tokens)
    merges = []
    while len(tokens) < n_vocab - 66:
        a = tokens[int(len(tokens) * rng.random() ** 2)]
        b = tokens[int(len(tokens) * rng.random() ** 2)]
        if a + b in known or len(a + b) > 16:
            continue
        known.add(a + b)
        tokens.append(a + b)
        merges.append(f"{a} {b}")
    small = build_synthetic_vocab(n_vocab)
    tokens += small.tokens[len(tokens):]
    types = [TOKEN_NORMAL] * (n_vocab - 66) + small.token_types[n_vocab - 66:]
    return TokenizerData(**{**small.model_dump(), "tokens": tokens, "token_types": types,
                            "merges": merges})


def test_construction_time_at_real_size() -> None:
    big = _big_vocab()
    assert len(big.merges) == V - 66 - 256
    t0 = time.perf_counter()
    tok = Tokenizer.from_data(big)
    elapsed = time.perf_counter() - t0
    print(f"Tokenizer construction at {V} tokens / {len(big.merges)} merges: {elapsed:.2f} s")
    assert elapsed < 5.0
    text = "\n".join(TEXTS)
    assert tok.decode(tok.encode(text, special=True)) == text


# -- llama.cpp itself ------------------------------------------------------------------------------


def _revealing_vocab(texts: list[str], n_vocab: int) -> TokenizerData:
    """Merges trained WITHOUT a word split, so BPE could merge across any word boundary: token
    ids then expose exactly where an implementation puts its word boundaries."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=n_vocab - 70, min_frequency=0, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    specials = ("<|end|>", "<|user|>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|tag|>")
    plain = []
    for t in texts:  # no merge may rebuild a special token's text
        for sp in specials:
            t = t.replace(sp, " ")
        plain.append(t)
    hf.train_from_iterator(plain, trainer=trainer)
    model = json.loads(hf.to_str())["model"]
    alphabet = list(bytes_to_unicode().values())
    new = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])
           if t not in set(alphabet)]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    shape = build_synthetic_vocab(n_vocab)
    tokens = alphabet + new
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += shape.tokens[len(tokens):]
    types += shape.token_types[len(types):]
    return TokenizerData(**{**shape.model_dump(), "tokens": tokens, "token_types": types,
                            "merges": merges})


def _llama_vocab_only(llama_cpp, path, data: TokenizerData):
    """llama.cpp loaded with just `data` as the vocabulary of a phi3 GGUF."""
    import gguf

    w = gguf.GGUFWriter(str(path), "phi3")
    for name, value in (("context_length", 4096), ("embedding_length", 64),
                        ("feed_forward_length", 128), ("block_count", 1), ("head_count", 2),
                        ("head_count_kv", 2), ("layer_norm_rms_eps", 1e-5),
                        ("rope_dimension_count", 32), ("tokenizer_model", data.model),
                        ("tokenizer_pre", data.pre), ("token_list", data.tokens),
                        ("token_types", data.token_types), ("token_merges", data.merges),
                        ("eos_token_id", data.eos_token_id), ("bos_token_id", data.bos_token_id),
                        ("add_bos_token", False), ("add_eos_token", False)):
        getattr(w, f"add_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


@pytest.mark.oracle
def test_code_point_classes_match_llama_cpp(tmp_path) -> None:
    """Letters, numbers and whitespace, the classes the split depends on, per code point.

    "x"+c is one word iff c is a letter, "1"+c iff c is a number, and "!"+c iff c is not
    whitespace; merges of x/1/! with every UTF-8 lead byte make that visible in the token ids.
    """
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from ane_spec.model.tokenizer import _LLAMA_WHITESPACE, _UNICODE_15_LETTERS, _UNICODE_15_NUMBERS

    b2u = bytes_to_unicode()
    leads = [b2u[b] for b in range(0xC2, 0xF5)]
    data = _tiny([f"{p} {lead}" for p in "x1!" for lead in leads])
    llm = _llama_vocab_only(llama_cpp, tmp_path / "classes.gguf", data)
    ours = Tokenizer.from_data(data)
    rng = random.Random(3)
    valid = [cp for cp in range(0x80, 0x110000) if not 0xD800 <= cp < 0xE000]
    sample = set(rng.sample(valid, 15000)) | _LLAMA_WHITESPACE | set(range(0x80, 0x800))
    for lo, hi in _UNICODE_15_LETTERS + _UNICODE_15_NUMBERS:
        sample |= {lo - 1, lo, (lo + hi) // 2, hi, hi + 1}
    sample = sorted(cp for cp in sample if cp >= 0x80)
    for k in range(0, len(sample), 3000):
        chunk = sample[k:k + 3000]
        for prefix in "x1!":
            text = "".join(f"\n{prefix}{chr(cp)}" for cp in chunk) + "\n"
            theirs = llm.tokenize(text.encode(), add_bos=False, special=False)
            mine = ours.encode(text)
            if mine != theirs:
                at = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
                cp = chunk[mine[:at].count(ours.id_of("Ċ")) - 1]
                raise AssertionError(f"{prefix!r} + U+{cp:04X}: llama.cpp splits it differently")


@pytest.mark.oracle
def test_matches_llama_cpp_on_adversarial_text(tmp_path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

    alphabet = ["a", "b", "z", "A", "Z", "s", "t", "re", "ve", "ll", "S", "T", "RE", "D", "'",
                "0", "7", "12345", " ", "  ", "\t", "\r", "\n", "\r\n", "/", ".", "!", "(", "é",
                "ß", "ж", "É", "Ж", "Ω", "ǅ", "ʰ", "中", "あ", "\u0301", "्", "न", "٣", "²", "Ⅻ",
                "😀", "👍🏽", "\u00a0", "\u2028", "\x85", "\x1c", "\u200d", "ไ", "ั", "\u3000",
                "<|end|>", "<|user|>", "<|endoftext|>"]
    rng = random.Random(7)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12))) for _ in range(300)]
    texts += [t for t, _, _ in DIVERGENT] + TEXTS
    data = _revealing_vocab(texts, 8192)
    llm = _llama_vocab_only(llama_cpp, tmp_path / "vocab.gguf", data)
    ours = Tokenizer.from_data(data)
    hf = Tokenizer.from_data(data, split="hf")
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    buf = (llama_cpp.ctypes.c_char * 1024)()

    def their_piece(i: int, special: bool) -> bytes:  # llama_token_to_piece, roomy buffer
        n = llama_cpp.llama_token_to_piece(vocab, i, buf, len(buf), 0, special)
        assert 0 <= n <= len(buf)
        return bytes(buf[:n])

    for i in range(data.eos_token_id - 2, len(data.tokens)):  # fillers and specials
        for special in (False, True):
            assert ours.decode_bytes([i], skip_special=not special) == their_piece(i, special)
    hf_differs = 0
    for text in texts:
        for special in (False, True):
            theirs = llm.tokenize(text.encode(), add_bos=False, special=special)
            assert ours.encode(text, special=special) == theirs, (text, special)
            hf_differs += hf.encode(text, special=special) != theirs
        for i in ours.encode(text, special=True):
            for special in (False, True):
                assert ours.decode_bytes([i], skip_special=not special) == their_piece(i, special)
    assert hf_differs > 0  # the revealing vocabulary does expose split differences


def test_eog_derived_as_llama_cpp(data: TokenizerData) -> None:
    """Keys first, then token texts; harmony's <|end|> is no EOG beside <|return|>/<|call|>."""
    from ane_spec.model.tokenizer import end_of_generation

    tokens = list(data.tokens)
    n = len(tokens)
    for k, text in enumerate(("<|return|>", "<|call|>", "<reponame>", "<fim_pad>", "<x>")):
        tokens[n - 70 + k] = text
    varied = data.model_copy(update={"tokens": tokens})
    ids = {t: i for i, t in enumerate(tokens)}
    types = list(varied.token_types)
    eog = end_of_generation(varied, ids, types)
    assert ids["<|end|>"] not in eog and types[ids["<|end|>"]] == TOKEN_USER_DEFINED
    assert {ids[t] for t in ("<|return|>", "<|call|>", "<reponame>", "<fim_pad>")} <= eog
    assert types[ids["<reponame>"]] == TOKEN_CONTROL
    # A key names the token of its kind: <x> is the FIM pad, <fim_pad> is then just a token.
    keyed = varied.model_copy(update={"fim_token_ids": {"pad": ids["<x>"]},
                                      "eot_token_id": ids["<|user|>"]})
    eog = end_of_generation(keyed, ids, list(varied.token_types))
    assert ids["<x>"] in eog and ids["<fim_pad>"] not in eog and ids["<|user|>"] in eog
