"""SentencePiece (`tokenizer.ggml.model = "llama"`) tokenization on small synthetic vocabularies:
llama.cpp's score-driven merges, byte fallback, add_space_prefix, BOS/EOS, LSTRIP/RSTRIP
specials, decoding; and, with llama-cpp-python installed, random vocabularies and texts
against llama.cpp itself (tests/test_llama_cpp_vocabs.py runs llama.cpp's own SPM vectors)."""

from __future__ import annotations

import random

import pytest

from ane_spec.errors import TokenizerError
from ane_spec.model.gguf_file import tokenizer_data_from_metadata
from ane_spec.model.spm import SentencePieceMerger, escape_whitespace
from ane_spec.model.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_USER_DEFINED,
    Tokenizer,
)

HEAD = [("<unk>", TOKEN_UNKNOWN), ("<s>", TOKEN_CONTROL), ("</s>", TOKEN_CONTROL)]
BYTES = [(f"<0x{b:02X}>", TOKEN_BYTE) for b in range(256)]


def _spm(pieces: list[tuple[str, float]], *, extra: list[tuple[str, int]] = (),
         byte_tokens: bool = True, **fields) -> Tokenizer:
    """<unk> <s> </s>, the 256 byte tokens, then `pieces` (text, score) as NORMAL tokens and
    `extra` (text, type) tokens, as a GGUF would give them."""
    head = HEAD + (BYTES if byte_tokens else [])
    tokens = [t for t, _ in head] + [t for t, _ in pieces] + [t for t, _ in extra]
    types = [k for _, k in head] + [TOKEN_NORMAL] * len(pieces) + [k for _, k in extra]
    scores = [0.0] * len(head) + [s for _, s in pieces] + [0.0] * len(extra)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
            **{f"tokenizer.ggml.{k}": v for k, v in fields.items() if k != "name"}}
    if "name" in fields:
        meta["general.name"] = fields["name"]
    return Tokenizer.from_data(tokenizer_data_from_metadata(meta, "test.gguf"))


def _texts(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_spm_defaults_are_llama_cpps() -> None:
    tok = _spm([("▁", -1.0)])
    d = tok.data
    assert (d.bos_token_id, d.eos_token_id, d.unknown_token_id) == (1, 2, 0)
    assert d.add_bos_token and not d.add_eos_token and d.add_space_prefix
    assert tok.is_spm and tok.eog_ids == {2}
    assert tok.encode("", add_special=True) == [1]  # OG tokenizer: encode('') -> [BOS]
    assert tok.encode("") == []


def test_merges_go_by_score_then_leftmost() -> None:
    # "▁abc": bc (score -1) beats ab (-2), which is then stale; ▁a (-5) merges next, and
    # ▁a + bc form ▁abc (-8), a token: scores order the merges, not any merge list.
    tok = _spm([("▁", -9.0), ("a", -9.0), ("b", -9.0), ("c", -9.0), ("▁a", -5.0), ("bc", -1.0),
                ("▁abc", -8.0), ("ab", -2.0)])
    assert _texts(tok, tok.encode("abc")) == ["▁abc"]
    tok = _spm([("▁", -9.0), ("a", -9.0), ("b", -9.0), ("c", -9.0), ("▁a", -5.0), ("bc", -1.0),
                ("ab", -2.0)])
    assert _texts(tok, tok.encode("abc")) == ["▁a", "bc"]
    # A tie goes to the leftmost pair: "aaa" with only "aa" -> aa, a.
    tok = _spm([("▁", -9.0), ("a", -9.0), ("aa", -1.0)], add_space_prefix=False)
    assert _texts(tok, tok.encode("aaa")) == ["aa", "a"]
    assert _texts(tok, tok.encode("aaaaa")) == ["aa", "aa", "a"]


def test_byte_fallback() -> None:
    tok = _spm([("▁", -1.0), ("h", -1.0), ("i", -1.0), ("▁h", -0.5)])
    assert _texts(tok, tok.encode("hi é")) == ["▁h", "i", "▁", "<0xC3>", "<0xA9>"]
    assert tok.decode(tok.encode("hi é")) == "hi é"
    # No <0xXX> tokens: llama.cpp takes the one-byte token text, and fails without one.
    tok = _spm([("▁", -1.0), ("h", -1.0)], byte_tokens=False, extra=[("i", TOKEN_USER_DEFINED)])
    assert _texts(tok, tok.encode("hi")) == ["▁", "h", "i"]
    with pytest.raises(TokenizerError, match="no token for byte 0x7A"):
        tok.encode("z")


def test_add_space_prefix_after_every_special_token() -> None:
    tok = _spm([("▁", -1.0), ("a", -1.0), ("▁a", -0.1)], extra=[("<t>", TOKEN_USER_DEFINED)])
    t = tok.id_of("<t>")
    assert _texts(tok, tok.encode("a<t>a a")) == ["▁a", "<t>", "▁a", "▁a"]
    assert tok.encode("a", add_special=True) == [1, tok.id_of("▁a")]
    # CONTROL tokens are text unless special=True; then they too are followed by a space.
    assert _texts(tok, tok.encode("<s>a", special=True)) == ["<s>", "▁a"]
    assert "<s>" not in _texts(tok, tok.encode("<s>a"))
    off = _spm([("▁", -1.0), ("a", -1.0), ("▁a", -0.1)], extra=[("<t>", TOKEN_USER_DEFINED)],
               add_space_prefix=False)
    assert _texts(off, off.encode("a<t> a")) == ["a", "<t>", "▁a"]
    assert t == off.id_of("<t>")


def test_bos_eos_follow_the_file() -> None:
    tok = _spm([("▁", -1.0), ("a", -1.0)], add_bos_token=False, add_eos_token=True)
    assert tok.encode("a", add_special=True) == tok.encode("a") + [2]
    tok = _spm([("▁", -1.0), ("a", -1.0)], bos_token_id=5, eos_token_id=6)
    assert tok.encode("a", add_special=True)[0] == 5 and tok.eos_token_id == 6


def test_phi3_special_tokens_strip_the_whitespace_after_them() -> None:
    extra = [("<|endoftext|>", TOKEN_CONTROL), ("<|user|>", TOKEN_CONTROL),
             ("<|end|>", TOKEN_CONTROL)]
    pieces = [("▁", -1.0), ("H", -1.0), ("i", -1.0), ("▁H", -0.5)]
    phi3 = _spm(pieces, extra=extra, name="Phi3")
    plain = _spm(pieces, extra=extra, name="llama")
    text = "<|user|>\n Hi <|end|>\n<s> Hi"
    assert _texts(phi3, phi3.encode(text, special=True)) == [
        "<|user|>", "▁H", "i", "▁", "<|end|>", "<s>", "▁", "▁H", "i"]
    assert _texts(plain, plain.encode(text, special=True)) == [
        "<|user|>", "▁", "<0x0A>", "▁H", "i", "▁", "<|end|>", "▁", "<0x0A>", "<s>", "▁", "▁H", "i"]
    # llama.cpp refuses a Phi-3-named vocabulary without the four tokens it sets attributes of.
    with pytest.raises(TokenizerError, match="lacks <\\|endoftext\\|>"):
        _spm(pieces, extra=extra[1:], name="my phi-3 model")
    # Across the pieces of a chat prompt too: the message's leading space goes.
    assert phi3.encode_pieces([("<|user|>\n", True), (" Hi ", False), ("<|end|>", True)]) == \
        phi3.encode("<|user|>\n Hi <|end|>", special=True)


def test_token_bytes_and_decode() -> None:
    tok = _spm([("▁", -1.0), ("a", -1.0), ("▁a", -0.1), ("▁▁", -0.05)],
               extra=[("<t>", TOKEN_USER_DEFINED), ("<x>", 5)])
    assert tok.token_bytes(tok.id_of("▁a")) == b" a"
    assert tok.token_bytes(tok.id_of("<0x0A>")) == b"\n"
    assert tok.token_bytes(tok.id_of("<t>")) == b"<t>" and tok.token_bytes(1) == b"<s>"
    assert tok.token_bytes(tok.id_of("<x>")) == b""  # UNUSED
    ids = tok.encode("a  a\n", add_special=True)
    assert _texts(tok, ids) == ["<s>", "▁a", "▁▁", "a", "<0x0A>"]
    # decode = llama_detokenize: the first token's leading space goes (add_space_prefix),
    # and only the first token's: after BOS, even a skipped one, the space stays.
    assert tok.decode(ids[1:]) == "a  a\n"
    assert tok.decode(ids) == "<s> a  a\n" and tok.decode(ids, skip_special=True) == " a  a\n"
    assert tok.detokenize(ids, remove_special=True) == " a  a\n"
    assert tok.decode_bytes(ids[1:]) == b" a  a\n"
    # Streaming: a continuation keeps its space (llama-server); a whole text is decode's.
    det = tok.detokenizer()
    assert "".join(det.push(i) for i in ids[1:]) + det.flush() == " a  a\n"
    det = tok.detokenizer(starts_text=True)
    assert "".join(det.push(i) for i in ids[1:]) + det.flush() == tok.decode(ids[1:])


def test_byte_tokens_stream_into_characters() -> None:
    tok = _spm([("▁", -1.0)])
    ids = tok.encode("😀")
    assert _texts(tok, ids) == ["▁", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    det = tok.detokenizer(starts_text=True)
    assert [det.push(i) for i in ids] == ["", "", "", "", "😀"] and det.flush() == ""
    det = tok.detokenizer()
    for i in ids[:-1]:
        det.push(i)
    assert det.flush() == "\ufffd" == tok.decode(ids[1:-1])


def test_hostile_text_does_not_break_it() -> None:
    tok = _spm([("▁", -1.0), ("a", -1.0), ("aa", -0.5), ("▁▁", -0.7)])
    for text in ("\x00\x01\x7f\u200b\ufeff", "a\ud800b", "\U0010ffff" * 10, "\r\n\t\v\f",
                 " " * 50_000, "a" * 50_000, "▁" * 100):
        ids = tok.encode(text, special=True, add_special=True)
        assert ids[0] == tok.bos_token_id
        back = tok.decode(ids[1:])
        assert back == text.replace("\ud800", "\ufffd").replace("▁", " ")
    with pytest.raises(TokenizerError, match="only tokenize str"):
        tok.encode(b"bytes")  # type: ignore[arg-type]


def _random_vocab(rng: random.Random, corpus: str, n: int) -> list[tuple[str, float]]:
    """Substrings of the escaped corpus, many across word boundaries ("a▁b"), with scores
    drawn from a few values so that ties happen."""
    escaped = corpus.replace(" ", "▁")
    pieces: dict[str, float] = {c: -20.0 for c in set(escaped)}
    while len(pieces) < n:
        k = rng.randint(0, len(escaped) - 2)
        piece = escaped[k:k + rng.randint(2, 6)]
        pieces.setdefault(piece, float(rng.choice([-1, -2, -3, -4, -5, -6])))
    return sorted(pieces.items())


CORPUS = ("the quick brown fox jumps over the lazy dog; a b ab ba aab  bba\n\tthe end. "
          "été über straße 中文 字 😀 ok")


def _rescan_merge(tok: Tokenizer, escaped: str) -> list[int]:
    """llama.cpp's SPM merge written the slow, obvious way, independently of spm.py: rescan
    every adjacent pair of the current symbols, merge the best (highest score, then leftmost)
    whose concatenation is a token, until none is; then each symbol's id, or its bytes'."""
    symbols = list(escaped)
    while True:
        best = None
        for k in range(len(symbols) - 1):
            tid = tok.id_of(symbols[k] + symbols[k + 1])
            if tid is not None and (best is None or tok.data.scores[tid] > best[0]):
                best = (tok.data.scores[tid], k)
        if best is None:
            break
        k = best[1]
        symbols[k:k + 2] = [symbols[k] + symbols[k + 1]]
    ids: list[int] = []
    for s in symbols:
        tid = tok.id_of(s)
        ids += [tid] if tid is not None else [tok.id_of(f"<0x{b:02X}>") for b in s.encode()]
    return ids


def test_merges_equal_a_rescan_of_every_pair() -> None:
    """The merge queue (spm.py), against `_rescan_merge` on random vocabularies with tied
    scores and pieces across word boundaries: a queue that misses a pair a merge creates, on
    either side, or orders ties otherwise, gives other tokens."""
    rng = random.Random(3)
    texts = 0
    for _ in range(6):
        tok = _spm(_random_vocab(rng, CORPUS, 300))
        for _ in range(150):
            text = "".join(rng.choice(CORPUS) for _ in range(rng.randint(1, 40)))
            escaped = escape_whitespace(" " + text)
            assert tok.encode(text) == _rescan_merge(tok, escaped), text
            texts += 1
    assert texts == 900


def test_cutting_the_text_into_segments_changes_no_merge() -> None:
    """spm.py merges segments cut where no token spans two adjacent characters, each on its
    own: that gives what one merge over the whole text gives. (Both sides are spm.py's merge:
    this checks the cutting, not the merge itself; test_merges_equal_a_rescan_of_every_pair and
    tests/test_spm_oracle.py check that.)"""
    rng = random.Random(5)
    for _ in range(5):
        vocab = _random_vocab(rng, CORPUS, 300)
        tok = _spm(vocab, extra=[("<t>", TOKEN_USER_DEFINED)])
        whole = SentencePieceMerger(tok._token_to_id, tok.data.scores)  # type: ignore[arg-type]
        for _ in range(200):
            text = "".join(rng.choice(CORPUS) for _ in range(rng.randint(1, 40)))
            escaped = ("▁" + text).replace(" ", "▁")
            assert list(whole._merge(escaped)) == tok.encode(text)


@pytest.mark.oracle
def test_random_vocabularies_match_llama_cpp(tmp_path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    import gguf

    rng = random.Random(11)
    alphabet = list(CORPUS) + ["<t>", "<s>", "</s>", "<unk>", "  ", "\n\n", "é"]
    for k in range(4):
        vocab = _random_vocab(rng, CORPUS, 400)
        extra = [("<t>", TOKEN_USER_DEFINED)]
        tok = _spm(vocab, extra=extra, add_space_prefix=k % 2 == 0)
        d = tok.data
        path = tmp_path / f"spm{k}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for name, value in (("context_length", 4096), ("embedding_length", 64),
                            ("feed_forward_length", 128), ("block_count", 1),
                            ("head_count", 2), ("head_count_kv", 2),
                            ("layer_norm_rms_eps", 1e-5), ("rope_dimension_count", 32),
                            ("tokenizer_model", "llama"), ("token_list", d.tokens),
                            ("token_types", d.token_types), ("token_scores", d.scores),
                            ("add_space_prefix", d.add_space_prefix)):
            getattr(w, f"add_{name}")(value)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        vocab_ptr = llama_cpp.llama_model_get_vocab(llm.model)
        buf = (llama_cpp.ctypes.c_char * 4096)()
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
            for special in (False, True):
                for add in (False, True):
                    theirs = llm.tokenize(text.encode(), add_bos=add, special=special)
                    assert tok.encode(text, special=special, add_special=add) == theirs, text
            ids = tok.encode(text, add_special=True)
            for unparse in (False, True):
                arr = (llama_cpp.llama_token * len(ids))(*ids)
                n = llama_cpp.llama_detokenize(vocab_ptr, arr, len(ids), buf, len(buf), False,
                                               unparse)
                assert tok.detokenize(ids, skip_special=not unparse).encode() == bytes(buf[:n])
