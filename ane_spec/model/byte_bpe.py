"""Byte-level BPE (`tokenizer.ggml.model = "gpt2"`, and Gemma 4's BPE over raw UTF-8), as
llama.cpp runs it.

Every NORMAL token is a string over GPT-2's 256-symbol byte-to-unicode alphabet (Gemma 4: raw
UTF-8 with spaces as U+2581, `<0xXX>` byte fallback), merges are ranked by their index (a
duplicated merge keeps its first rank, llama.cpp `bpe_ranks.emplace`), and the pre-tokenizer
named by `tokenizer.ggml.pre` (pre_tokenizers.py) cuts text into words before BPE runs on each
word separately. The BPE itself runs in HF `tokenizers` (models.BPE + a Split/ByteLevel
pre-tokenizer, the same pipeline as Phi-4-mini's tokenizer.json), fed llama.cpp's words.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Iterator

from ane_spec.errors import TokenizerError, untrusted
from ane_spec.model.pre_tokenizers import PRE_TOKENIZER_PATTERNS, PreTokenizer, llama_cpp_split


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode-char map (llama.cpp `unicode_byte_to_utf8`).

    Printable Latin-1 bytes map to themselves; the other 68 map to U+0100.. in byte order. The
    dict's insertion order (printable bytes first) is the order GPT-2-family vocabularies give
    the single-byte tokens.
    """
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def byte_decode_token(text: str) -> bytes:
    """The bytes a byte-level token string stands for.

    A character outside the GPT-2 alphabet cannot come from byte-level BPE; llama.cpp's
    `llama_decode_text` then emits `[UNK_BYTE_0x<hex of its UTF-8>]` followed by the character,
    and so does this.
    """
    table = unicode_to_bytes()
    out = bytearray()
    for ch in text:
        b = table.get(ch)
        if b is not None:
            out.append(b)
        else:
            utf8 = ch.encode("utf-8")
            out += b"[UNK_BYTE_0x" + "".join(f"{x:02x}" for x in utf8).encode() + utf8 + b"]"
    return bytes(out)


def split_merge(index: int, merge: str) -> tuple[str, str]:
    # llama.cpp: `pos = word.find(' ', 1)`; the parts never contain a raw space (it is 'Ġ').
    pos = merge.find(" ", 1)
    if pos < 0 or pos == len(merge) - 1:
        raise TokenizerError(f"merge #{index} {untrusted(merge)} is not of the form 'A B'")
    return merge[:pos], merge[pos + 1:]


def check_merges(merges: list[str], vocab: frozenset[str]) -> None:
    """Every merge 'A B' names two tokens whose concatenation is a token: what HF tokenizers'
    BPE requires, checked here so that `build` refuses what `tokenize` could not load."""
    for k, merge in enumerate(merges):
        a, b = split_merge(k, merge)
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerError(
                    f"merge #{k} {untrusted(merge)} is inconsistent with the vocabulary: "
                    f"{untrusted(part)} is not a token")


class ByteLevelBPE:
    """A `gpt2` (or `gemma4`) vocabulary's BPE in HF tokenizers, behind one of two front ends:
    llama.cpp's split (`llama_cpp_split`, in Python) feeding whole words, or the tokenizer.json
    pattern run by HF itself (`split="hf"`, byte-level vocabularies only)."""

    def __init__(self, token_to_id: dict[str, int], merges: list[str], pre_name: str,
                 pre: PreTokenizer, split: str) -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        self.pre_name = pre_name
        self.split = split
        self._token_to_id = token_to_id
        pairs: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for k, m in enumerate(merges):
            pair = split_merge(k, m)
            if pair not in seen:  # llama.cpp keeps a duplicated merge's first rank
                seen.add(pair)
                pairs.append(pair)

        pattern = PRE_TOKENIZER_PATTERNS.get(pre_name)
        if split == "hf" and pattern is None:
            raise TokenizerError(f"split='hf' needs a tokenizer.json pattern; pre-tokenizer "
                                 f"{untrusted(pre_name)} has none here")
        try:
            # The Python constructor beats serialising a tokenizer.json for from_str (0.2 s vs
            # 0.7 s at 200k merges). Without byte encoding, a character that is no token
            # becomes its `<0xXX>` tokens, as llama.cpp's BPE session does for Gemma 4.
            bpe = models.BPE(vocab=token_to_id, merges=pairs, dropout=None,
                             unk_token=None, fuse_unk=False, byte_fallback=not pre.byte_encode,
                             ignore_merges=pre.ignore_merges)
        except Exception as exc:  # tokenizers raises a bare Exception naming the bad merge
            raise TokenizerError("the BPE vocabulary/merges are inconsistent: "
                                 f"{untrusted(str(exc), 200)}") from None
        # Two front ends over the one BPE model: the HF split (tokenizer.json's pipeline), and
        # whole pre-split words (llama.cpp's split is done in Python, see llama_cpp_split).
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]) if pattern is not None else None
        hf.decoder = decoders.ByteLevel()
        words = HFTokenizer(bpe)
        if pre.byte_encode:
            words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                           use_regex=False)
            words.decoder = decoders.ByteLevel()
        self.hf = hf
        self._words = words
        # Gemma 4: a word of newlines only that is itself a token is that token (PR 21343).
        self._whole_newlines = pre.pre_type == "GEMMA4"

    def words(self, text: str) -> list[str]:
        """The words the front end cuts `text` into (escaped already where the vocabulary
        escapes spaces)."""
        if self.split == "llama.cpp":
            return llama_cpp_split(text, self.pre_name)
        table = unicode_to_bytes()
        return [bytes(table[c] for c in piece).decode("utf-8")
                for piece, _ in self.hf.pre_tokenizer.pre_tokenize_str(text)]

    def encode(self, texts: list[str]) -> Iterator[list[int]]:
        """Each text's ids, in one batch (texts escaped as for `words`)."""
        if not texts:
            return iter([])
        if self.split != "llama.cpp":
            return iter(e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False))
        words = [llama_cpp_split(t, self.pre_name) for t in texts]
        batch = self._words.encode_batch(words, is_pretokenized=True, add_special_tokens=False)
        return iter(self._whole_newline_words(w, e.ids, e.word_ids) if self._whole_newlines
                    else e.ids for w, e in zip(words, batch))

    def _whole_newline_words(self, words: list[str], ids: list[int],
                             word_ids: list[int | None]) -> list[int]:
        """Gemma 4 (llm_tokenizer_bpe_session): a word of newlines only that is a token is
        emitted whole, not merged."""
        whole = {k: self._token_to_id[w] for k, w in enumerate(words)
                 if w.strip("\n") == "" and w in self._token_to_id}
        if not whole:
            return ids
        out: list[int] = []
        last: int | None = None
        for tid, k in zip(ids, word_ids):
            if k not in whole:
                out.append(tid)
            elif k != last:
                out.append(whole[k])
            last = k
        return out
