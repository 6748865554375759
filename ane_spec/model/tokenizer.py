r"""Byte-level BPE tokenizers read from GGUF metadata, tokenizing the way llama.cpp does:
Phi-4-mini's (`gpt-4o`), Llama 3's (`llama-bpe`) and Qwen 2.5 / 3's (`qwen2`).

The GGUF carries a GPT-2 style byte-level BPE (`tokenizer.ggml.model = "gpt2"`): every token of
type NORMAL is a string over the 256-symbol GPT-2 byte-to-unicode alphabet, merges are ranked by
their index, and the pre-tokenizer named by `tokenizer.ggml.pre` ("gpt-4o", tiktoken's o200k_base
split pattern; "llama-bpe"; "qwen2") cuts text into words before BPE runs on each word
separately. The families differ only in the split, in llama3's ignore_merges (a word that is a
token is not merged up) and default BOS, and in their special tokens.

The BPE itself runs in HF `tokenizers` (models.BPE + a Split/ByteLevel pre-tokenizer, the same
pipeline as Phi-4-mini's tokenizer.json). What `tokenizers` would get wrong relative to llama.cpp
is handled here instead:

* The split. llama.cpp does not run the o200k pattern as written: it runs an "adapted" ASCII-only
  rewrite (`((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+` for the cased-letter classes) with
  std::regex over a "collapsed" copy of the text in which every non-ASCII code point is replaced
  by one byte standing for its general category (letter, number, punctuation, mark, symbol,
  whitespace, other). Two consequences differ from HF/tiktoken: combining marks (\p{M}: Indic
  vowel signs and viramas, Thai vowels, Arabic harakat, NFD accents) are not word characters, so
  `नमस्ते` splits into `नमस`, `्त`, `े`; and every non-ASCII letter counts as both upper and lower
  case, so word boundaries move wherever one meets an ASCII case change: `ПриветМир` and `aÉb`
  stay one word, while `ÉCOLE` splits into `É`, `COLE`. `split="llama.cpp"` (the default)
  reproduces this byte for byte; `split="hf"` runs the pattern as HF tokenizers does (Phi-4-mini's
  reference tokenizer.json).

* Special tokens come from token types, not from a list of known ids. CONTROL (and UNKNOWN)
  tokens written in the text are recognised only with `special=True` (llama.cpp's
  `parse_special`); USER_DEFINED tokens are recognised always. Recognition follows llama.cpp's
  `tokenizer_st_partition`: longest token text first, each splitting every remaining text
  fragment at all its occurrences.
* Decoding follows llama.cpp's `token_to_piece`: NORMAL tokens are byte-decoded, CONTROL/UNKNOWN
  render as their text unless skipped, USER_DEFINED always render as text, and UNUSED (the
  `[PAD...]` fillers) and other types render as nothing.
* Tokens named like end-of-generation markers (`<|end|>`, `<|endoftext|>`, ...) are end of
  generation and CONTROL whatever the file says, as llama.cpp forces them; a duplicated merge keeps
  its first rank (llama.cpp `bpe_ranks.emplace`); a vocabulary with a duplicated token string is
  refused (llama.cpp aborts on one).
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from typing import Iterable

from pydantic import BaseModel, ConfigDict, model_validator

from ane_spec.errors import TokenizerError, untrusted

# llama.cpp's llama_token_type values, as stored in `tokenizer.ggml.token_type`.
TOKEN_UNDEFINED = 0
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6
_KNOWN_TYPES = frozenset(range(0, 7))

# tiktoken o200k_base, verbatim from Phi-4-mini's tokenizer.json (llama.cpp names it
# LLAMA_VOCAB_PRE_TYPE_GPT4O, but runs GPT4O_PATTERN_LLAMA_CPP below).
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# What llama.cpp actually runs for "gpt-4o" (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GPT4O), verbatim.
GPT4O_PATTERN_LLAMA_CPP = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3 (LLAMA_VOCAB_PRE_TYPE_LLAMA3) and Qwen 2 (LLAMA_VOCAB_PRE_TYPE_QWEN2): the pattern of
# the model's tokenizer.json, and llama-vocab.cpp's "adapted" form without the (?i:) group, which
# is what llama.cpp runs (its custom llama3/qwen2 scanners implement exactly these). Qwen's only
# difference is single digits (\p{N}) instead of runs of up to three.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_PATTERN_LLAMA_CPP = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
                            r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
QWEN2_PATTERN_LLAMA_CPP = LLAMA3_PATTERN_LLAMA_CPP.replace(r"\p{N}{1,3}", r"\p{N}")

# The `tokenizer.ggml.pre` names llama.cpp maps to LLAMA3; they also turn on ignore_merges (a
# word that is itself a token is not merged up) and make add_bos default to true.
LLAMA3_PRE_NAMES = ("llama3", "llama-v3", "llama-bpe")

#: `tokenizer.ggml.pre` values this module can tokenize, with their split pattern.
PRE_TOKENIZER_PATTERNS: dict[str, str] = {
    "gpt-4o": GPT4O_PATTERN, "qwen2": QWEN2_PATTERN,
    **{name: LLAMA3_PATTERN for name in LLAMA3_PRE_NAMES}}
#: ... and the form llama.cpp runs over collapsed text.
LLAMA_CPP_PATTERNS: dict[str, str] = {
    "gpt-4o": GPT4O_PATTERN_LLAMA_CPP, "qwen2": QWEN2_PATTERN_LLAMA_CPP,
    **{name: LLAMA3_PATTERN_LLAMA_CPP for name in LLAMA3_PRE_NAMES}}


def default_add_bos(pre: str) -> bool:
    """llama.cpp's add_bos when the GGUF has no tokenizer.ggml.add_bos_token key."""
    return pre in LLAMA3_PRE_NAMES

SPLIT_MODES = ("llama.cpp", "hf")

# Token texts llama.cpp treats as end-of-generation whatever their id or type (its
# `special_eog_ids` scan, which also forces them to CONTROL). Phi-4-mini has two of them:
# <|endoftext|> and <|end|>.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<｜end▁of▁sentence｜>")
# Fill-in-the-middle tokens llama.cpp finds by name and forces to CONTROL; the pad, repo and
# file-separator ones also end generation (llama-vocab.cpp, special_fim_*_id).
FIM_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<PRE>", "<|fim_suffix|>", "<fim-suffix>",
             "<SUF>", "<|fim_middle|>", "<fim-middle>", "<MID>")
FIM_EOG_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<PAD>", "<|fim_repo|>", "<|repo_name|>",
                 "<fim-repo>", "<REPO>", "<|file_sep|>")


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


# -- llama.cpp's collapsed-text regex split (unicode.cpp `unicode_regex_split`) ----------------

# llama.cpp's `unicode_set_whitespace` (the Unicode White_Space property).
_LLAMA_WHITESPACE = frozenset([*range(0x09, 0x0E), 0x20, 0x85, 0xA0, 0x1680,
                               *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F, 0x205F, 0x3000])
# Category -> the byte standing for it in the collapsed text; anything else becomes 0xD0.
_COLLAPSED_CATEGORY = {"N": 0xD1, "L": 0xD2, "P": 0xD3, "M": 0xD4, "S": 0xD5}
# Letters and numbers new in Unicode 15.0/15.1, which llama.cpp's tables (unicode-data.cpp,
# Unicode 15.1) have and Python 3.11's unicodedata (14.0) lacks: Khojki, Kawi, Egyptian
# hieroglyphs, kana, Latin Extended-G, Cyrillic Extended-D, Nag Mundari, CJK extensions B/H/I;
# Kawi, Kaktovik and Nag Mundari digits. Found by asking llama.cpp about every code point.
_UNICODE_15_LETTERS = ((0x1123F, 0x11240), (0x11F02, 0x11F02), (0x11F04, 0x11F10),
                       (0x11F12, 0x11F33), (0x1342F, 0x1342F), (0x13441, 0x13446),
                       (0x1B132, 0x1B132), (0x1B155, 0x1B155), (0x1DF25, 0x1DF2A),
                       (0x1E030, 0x1E06D), (0x1E4D0, 0x1E4EB), (0x2B739, 0x2B739),
                       (0x2EBF0, 0x2EE5D), (0x31350, 0x323AF))
_UNICODE_15_NUMBERS = ((0x11F50, 0x11F59), (0x1D2C0, 0x1D2D3), (0x1E4F0, 0x1E4F9))
# \p{X} in a collapsed regex: the category byte plus the ASCII members kept as themselves.
_COLLAPSED_CLASS = {
    "N": "\xd10-9",
    "L": "\xd2A-Za-z",
    "P": "\xd3!-#%-*,-/:-;?-@\\[-\\]_\\{\\}",
    "M": "\xd4",
    "S": "\xd5\\$\\+<->\\^`\\|",
}


@lru_cache(maxsize=1)
def _collapse_table() -> bytearray:
    """`str.translate` table: code point -> the stand-in llama.cpp's collapsed text uses.

    ASCII stays itself, White_Space becomes 0x0B ("<vertical tab> as whitespace fallback"),
    letters/numbers/punctuation/marks/symbols 0xD2/0xD1/0xD3/0xD4/0xD5, anything else 0xD0.
    Planes 4-13 and 15-16 hold only unassigned and private-use code points (0xD0); plane 14 has
    tags (Cf) and variation selectors (Mn). Built once, ~1 MB, ~0.1 s.

    Categories come from Python's unicodedata plus the Unicode 15.x letters and numbers, which
    makes letters, numbers and whitespace (all the gpt-4o split looks at) identical to
    llama.cpp's for every code point on Python 3.11-3.13. (Python >= 3.14 knows Unicode 16,
    whose new letters llama.cpp builds with 15.1 tables do not treat as letters.)
    """
    import unicodedata

    table = bytearray([0xD0]) * 0x110000
    table[:0x80] = bytes(range(0x80))
    for lo, hi in ((0x80, 0x40000), (0xE0000, 0xE1000)):
        for cp in range(lo, hi):
            v = _COLLAPSED_CATEGORY.get(unicodedata.category(chr(cp))[0])
            if v is not None:
                table[cp] = v
    for ranges, v in ((_UNICODE_15_LETTERS, 0xD2), (_UNICODE_15_NUMBERS, 0xD1)):
        for lo, hi in ranges:
            table[lo:hi + 1] = bytes([v]) * (hi + 1 - lo)
    for cp in _LLAMA_WHITESPACE:
        if cp >= 0x80:
            table[cp] = 0x0B
    return table


def collapse_regex(expr: str) -> str:
    """llama.cpp's rewrite of a `\\p{..}` regex for collapsed text (`regex_expr_collapsed`)."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "[" and (i == 0 or expr[i - 1] != "\\"):
            out.append("[")
            inside = True
            i += 1
            continue
        if inside and c == "]" and expr[i - 1] != "\\":
            out.append("]")
            inside = False
            i += 1
            continue
        if expr.startswith("\\p{", i):
            close = expr.find("}", i + 3)
            cls = _COLLAPSED_CLASS.get(expr[i + 3:close]) if close > 0 else None
            if cls is not None:
                out.append(cls if inside else f"[{cls}]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=None)
def _llama_cpp_regex(pre: str):  # -> re.Pattern[str]
    import re

    # ASCII: std::regex's \s is C isspace ([ \t\n\v\f\r]); non-ASCII is collapsed anyway.
    return re.compile(collapse_regex(LLAMA_CPP_PATTERNS[pre]), re.ASCII)


def llama_cpp_split(text: str, pre: str = "gpt-4o") -> list[str]:
    """The words llama.cpp's pre-tokenizer `pre` cuts `text` into (unicode_regex_split_stl)."""
    collapsed = text.translate(_collapse_table())
    words: list[str] = []
    pos = 0
    for m in _llama_cpp_regex(pre).finditer(collapsed):
        start, end = m.span()
        if start > pos:  # unmatched stretches become words too
            words.append(text[pos:start])
        words.append(text[start:end])
        pos = end
    if pos < len(text):
        words.append(text[pos:])
    return words


class TokenizerData(BaseModel):
    """The tokenizer as the GGUF stores it (`tokenizer.ggml.*` and `tokenizer.chat_template`)."""

    model_config = ConfigDict(frozen=True)

    model: str = "gpt2"
    pre: str = "gpt-4o"
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    unknown_token_id: int | None
    padding_token_id: int | None
    add_bos_token: bool = False
    add_eos_token: bool = False
    chat_template: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "TokenizerData":
        if self.model != "gpt2":
            raise TokenizerError(
                f"tokenizer model {untrusted(self.model)} is not supported; only 'gpt2' "
                "(byte-level BPE, as in Phi-4-mini) is")
        if self.pre not in PRE_TOKENIZER_PATTERNS:
            raise TokenizerError(
                f"pre-tokenizer {untrusted(self.pre)} is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZER_PATTERNS))}")
        n = len(self.tokens)
        if n == 0:
            raise TokenizerError("the vocabulary is empty")
        if len(self.token_types) != n:
            raise TokenizerError(f"{n} tokens but {len(self.token_types)} token types")
        bad = sorted(set(self.token_types) - _KNOWN_TYPES)
        if bad:
            shown = ", ".join(str(t) for t in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise TokenizerError(f"unknown token type(s) {shown} (valid: 0-6)")
        for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < n:
                raise TokenizerError(f"{name} {v} is outside the vocabulary (0..{n - 1})")
        _check_utf8("token", self.tokens)
        _check_utf8("merge", self.merges)
        if self.chat_template is not None:
            _check_utf8("chat template", [self.chat_template])
        texts = token_texts(self.tokens)
        if len(set(texts)) != n:
            seen: dict[str, int] = {}
            for i, t in enumerate(texts):
                if t in seen:
                    raise TokenizerError(
                        f"token {untrusted(t)} appears twice (ids {seen[t]} and {i}); llama.cpp "
                        "refuses such a vocabulary")
                seen[t] = i
        _check_merges(self.merges, frozenset(texts))
        if self.add_bos_token and self.bos_token_id is None:
            raise TokenizerError("add_bos_token is true but bos_token_id is not set")
        if self.add_eos_token and self.eos_token_id is None:
            raise TokenizerError("add_eos_token is true but eos_token_id is not set")
        return self


def token_texts(tokens: list[str]) -> list[str]:
    """The vocabulary as BPE sees it: llama.cpp names empty tokens "[EMPTY_<id>]"."""
    return [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]


def _check_utf8(what: str, texts: list[str]) -> None:
    """Strings from a GGUF may hold invalid UTF-8 (kept as lone surrogates); a tokenizer cannot
    be written to tokenizer.json with them, and llama.cpp would not tokenize with them either."""
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        for i, t in enumerate(texts):
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:
                raise TokenizerError(f"{what} #{i} {untrusted(t)} is not valid UTF-8") from None


def _check_merges(merges: list[str], vocab: frozenset[str]) -> None:
    """Every merge 'A B' names two tokens whose concatenation is a token: what HF tokenizers'
    BPE requires, checked here so that `build` refuses what `tokenize` could not load."""
    for k, merge in enumerate(merges):
        a, b = _split_merge(k, merge)
        for part in (a, b, a + b):
            if part not in vocab:
                raise TokenizerError(
                    f"merge #{k} {untrusted(merge)} is inconsistent with the vocabulary: "
                    f"{untrusted(part)} is not a token")


def _clean(text: str) -> str:
    """`text` as valid Unicode: lone surrogates (not UTF-8-encodable) become U+FFFD, which is
    what llama.cpp makes of the invalid bytes they would have to be."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _split_merge(index: int, merge: str) -> tuple[str, str]:
    # llama.cpp: `pos = word.find(' ', 1)`; the parts never contain a raw space (it is 'Ġ').
    pos = merge.find(" ", 1)
    if pos < 0 or pos == len(merge) - 1:
        raise TokenizerError(f"merge #{index} {untrusted(merge)} is not of the form 'A B'")
    return merge[:pos], merge[pos + 1:]


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    A character whose bytes are spread over several byte-level tokens (an emoji is often four
    single-byte tokens) is held back until its last byte arrives; `flush` ends the stream,
    turning a dangling partial sequence into U+FFFD. Concatenating every `push` and the `flush`
    gives exactly `Tokenizer.decode` of the same ids.
    """

    def __init__(self, tokenizer: "Tokenizer", *, skip_special: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._decoder.decode(self._tok._piece(token_id, self._skip_special))

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class Tokenizer:
    """Encode/decode exactly as llama.cpp does for a `gpt2` GGUF vocabulary with one of the
    pre-tokenizers in PRE_TOKENIZER_PATTERNS."""

    def __init__(self, data: TokenizerData, *, split: str = "llama.cpp") -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        if split not in SPLIT_MODES:
            raise TokenizerError(f"split must be one of {SPLIT_MODES}, not {split!r}")
        self.data = data
        self.split = split
        n = len(data.tokens)
        # TokenizerData has ruled out duplicates and merges naming unknown tokens.
        self._texts = token_texts(data.tokens)
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(self._texts)}
        self._types = list(data.token_types)

        # llama.cpp makes end-of-generation-looking and FIM tokens CONTROL ("its type will be
        # overridden").
        eog = set()
        for text in EOG_TEXTS + FIM_EOG_TEXTS + FIM_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None:
                self._types[i] = TOKEN_CONTROL
                if text not in FIM_TEXTS:
                    eog.add(i)
        if data.eos_token_id is not None:
            eog.add(data.eos_token_id)
        self.eog_ids: frozenset[int] = frozenset(eog)

        # Special tokens that text can spell, longest first (llama.cpp cache_special_tokens).
        special = [i for i, t in enumerate(self._types)
                   if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        special.sort(key=lambda i: (-len(self._texts[i].encode("utf-8")), i))
        self._special_ids = special
        self._special_set = frozenset(special)
        self.markup_ids: frozenset[int] = frozenset(i for i in special if self._is_markup(i))
        # What each kind of text may spell: everything (special=True), USER_DEFINED tokens
        # (llama.cpp's parse_special=false), or nothing that is markup (a chat message's text).
        self._user_defined_ids = [i for i in special if self._types[i] == TOKEN_USER_DEFINED]
        self._plain_text_ids = [i for i in self._user_defined_ids if i not in self.markup_ids]

        merges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for k, m in enumerate(data.merges):
            pair = _split_merge(k, m)
            if pair not in seen:  # llama.cpp keeps a duplicated merge's first rank
                seen.add(pair)
                merges.append(pair)

        pattern = PRE_TOKENIZER_PATTERNS[data.pre]
        try:
            # The Python constructor beats serialising a tokenizer.json for from_str (0.2 s vs
            # 0.7 s at 200k merges).
            bpe = models.BPE(vocab=self._token_to_id, merges=merges, dropout=None,
                             unk_token=None, fuse_unk=False, byte_fallback=False,
                             ignore_merges=data.pre in LLAMA3_PRE_NAMES)
        except Exception as exc:  # tokenizers raises a bare Exception naming the bad merge
            raise TokenizerError("the BPE vocabulary/merges are inconsistent: "
                                 f"{untrusted(str(exc), 200)}") from None
        # Two front ends over the one BPE model: the HF split (tokenizer.json's pipeline), and
        # whole pre-split words (llama.cpp's split is done in Python, see llama_cpp_split).
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        hf.decoder = decoders.ByteLevel()
        words = HFTokenizer(bpe)
        words.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        words.decoder = decoders.ByteLevel()
        self._hf = hf
        self._hf_words = words
        self._bytes_cache: list[bytes | None] = [None] * n

    @classmethod
    def from_data(cls, data: TokenizerData, *, split: str = "llama.cpp") -> "Tokenizer":
        """`split="llama.cpp"` (default) splits words exactly as llama.cpp; "hf" as HF/tiktoken."""
        return cls(data, split=split)

    # -- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return len(self._texts)

    @property
    def bos_token_id(self) -> int | None:
        return self.data.bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self.data.eos_token_id

    def id_of(self, text: str) -> int | None:
        """The id whose stored token string is exactly `text` (`"<|end|>"`, `"Ġthe"`), or None."""
        return self._token_to_id.get(text)

    def token_text(self, token_id: int) -> str:
        """The token's string as stored in the GGUF (byte-level alphabet for NORMAL tokens)."""
        self._check_id(token_id)
        return self._texts[token_id]

    def token_type(self, token_id: int) -> int:
        self._check_id(token_id)
        return self._types[token_id]

    def is_special(self, token_id: int) -> bool:
        """CONTROL, USER_DEFINED or UNKNOWN: a token text can spell rather than a BPE piece."""
        self._check_id(token_id)
        return token_id in self._special_set

    def _is_markup(self, token_id: int) -> bool:
        """CONTROL and UNKNOWN tokens, and USER_DEFINED ones written like `<|...|>`: the chat
        template's markup, which a message's own text must never produce."""
        if self._types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return True
        text = self._texts[token_id]
        return (self._types[token_id] == TOKEN_USER_DEFINED and text.startswith("<|")
                and text.endswith("|>"))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes the token stands for.

        NORMAL tokens give their byte-decoded string, CONTROL/USER_DEFINED/UNKNOWN tokens the
        UTF-8 of their text, and UNUSED fillers (and the other types) nothing: llama.cpp's
        `token_to_piece(special=true)`.
        """
        self._check_id(token_id)
        cached = self._bytes_cache[token_id]
        if cached is None:
            t = self._types[token_id]
            text = self._texts[token_id]
            if t == TOKEN_NORMAL:
                cached = byte_decode_token(text)
            elif t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
                cached = text.encode("utf-8")
            else:
                cached = b""
            self._bytes_cache[token_id] = cached
        return cached

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < len(self._texts):
            raise TokenizerError(
                f"token id {token_id} is outside the vocabulary (0..{len(self._texts) - 1})")

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        piece = self.token_bytes(token_id)
        if skip_special and self._types[token_id] in (TOKEN_CONTROL, TOKEN_UNKNOWN):
            return b""
        return piece

    # -- encoding ---------------------------------------------------------------------------

    def pre_tokenize(self, text: str) -> list[str]:
        """The words the pre-tokenizer cuts plain `text` into (no special-token handling)."""
        if self.split == "llama.cpp":
            return llama_cpp_split(_clean(text), self.data.pre)
        table = unicode_to_bytes()
        return [bytes(table[c] for c in piece).decode("utf-8")
                for piece, _ in self._hf.pre_tokenizer.pre_tokenize_str(_clean(text))]

    def _partition(self, text: str, candidates: list[int]) -> list[int | str]:
        """Split `text` into the ids of `candidates` (special tokens, longest first) written in
        it and plain-text fragments (llama.cpp's tokenizer_st_partition)."""
        fragments: list[int | str] = [text]
        for tid in candidates:
            needle = self._texts[tid]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            out: list[int | str] = []
            for f in fragments:
                if isinstance(f, int) or needle not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(needle)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            fragments = out
        return fragments

    def encode(self, text: str, *, special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids for `text`, as llama.cpp's `llama_tokenize(text, add_special, special)`.

        `special=True` recognises CONTROL tokens written in the text (`<|user|>`); otherwise they
        are tokenized as ordinary text. USER_DEFINED tokens are always recognised.
        `add_special` adds BOS/EOS as the GGUF's add_bos_token/add_eos_token ask (Phi-4-mini:
        neither).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"can only tokenize str, not {type(text).__name__}")
        fragments = (self._partition(_clean(text), self._special_ids if special
                                     else self._user_defined_ids) if text else [])
        return self._encode_fragments(fragments, add_special)

    def encode_pieces(self, pieces: Iterable[tuple[str, bool]], *, add_special: bool = False,
                      not_in_text: Iterable[int] = ()) -> list[int]:
        """Token ids for the concatenation of `pieces`, each (text, is_markup): special tokens
        are recognised only in markup pieces, never in the others (no `<|...|>` token at all,
        USER_DEFINED or not, nor the USER_DEFINED ones in `not_in_text`: a tool-call format's
        own tags). Text that spells no special token tokenizes exactly as the whole string
        would with `encode(..., special=True)`: words are split and merged across piece
        boundaries as usual."""
        excluded = frozenset(not_in_text)
        text_ids = [i for i in self._plain_text_ids if i not in excluded]
        fragments: list[int | str] = []
        for text, markup in pieces:
            if not text:
                continue
            ids = self._special_ids if markup else text_ids
            for f in self._partition(_clean(text), ids):
                if isinstance(f, str) and fragments and isinstance(fragments[-1], str):
                    fragments[-1] += f
                else:
                    fragments.append(f)
        return self._encode_fragments(fragments, add_special)

    def _encode_fragments(self, fragments: list[int | str], add_special: bool) -> list[int]:
        plain = [f for f in fragments if isinstance(f, str)]
        if not plain:
            encoded = iter([])
        elif self.split == "llama.cpp":
            pre = self.data.pre
            encoded = iter(self._hf_words.encode_batch(
                [llama_cpp_split(f, pre) for f in plain], is_pretokenized=True,
                add_special_tokens=False))
        else:
            encoded = iter(self._hf.encode_batch(plain, add_special_tokens=False))
        ids: list[int] = []
        if add_special and self.data.add_bos_token:
            ids.append(self.data.bos_token_id)  # type: ignore[arg-type]
        for f in fragments:
            if isinstance(f, int):
                ids.append(f)
            else:
                ids.extend(next(encoded).ids)
        if add_special and self.data.add_eos_token:
            ids.append(self.data.eos_token_id)  # type: ignore[arg-type]
        return ids

    # -- decoding ---------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        return b"".join(self._piece(int(i), skip_special) for i in ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text for `ids`; invalid UTF-8 (a cut multi-byte character) becomes U+FFFD.

        `skip_special` drops CONTROL tokens (llama.cpp `unparse_special=false`); USER_DEFINED
        tokens always render.
        """
        return self.decode_bytes(ids, skip_special=skip_special).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special: bool = False) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self, skip_special=skip_special)
