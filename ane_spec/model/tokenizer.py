r"""The `Tokenizer`: encode and decode for a GGUF vocabulary exactly as llama.cpp does.

Three `tokenizer.ggml.model` values are read (`TokenizerData`, tokenizer_data.py):

* `llama`: SentencePiece vocabularies (Llama 2, Mistral 7B, TinyLlama, Phi-3, Gemma 3). llama.cpp
  runs its own score-driven merge over the characters (`llm_tokenizer_spm`, ported in spm.py)
  with `<0xXX>` byte fallback; spaces are escaped to U+2581 and, with add_space_prefix (the
  default), text that starts the input or follows a special token gets one first. BOS is added
  by default; the default BOS/EOS/UNK ids are 1/2/0.
* `gemma4`, and the `gemma4`/`sarvam-moe` pre-tokenizers of a `gpt2` file: BPE by merge rank,
  over raw UTF-8 with spaces escaped to U+2581 (not GPT-2 bytes), split only at newlines, with
  `<0xXX>` byte fallback; llama.cpp always adds BOS for Gemma 4.
* `gpt2`: byte-level BPE (byte_bpe.py) after the pre-tokenizer `tokenizer.ggml.pre` names
  (pre_tokenizers.py: llama.cpp's table and its split, byte for byte; `split="hf"` runs the
  tokenizer.json pattern as HF tokenizers does instead). An unknown name is refused by name.

What the BPE and the split leave to this module:

* Special tokens come from token types, not from a list of known ids. CONTROL (and UNKNOWN)
  tokens written in the text are recognised only with `special=True` (llama.cpp's
  `parse_special`); USER_DEFINED tokens are recognised always. Recognition follows llama.cpp's
  `tokenizer_st_partition`: longest token text first, each splitting every remaining text
  fragment at all its occurrences.
* Special tokens llama.cpp marks LSTRIP/RSTRIP by model name (Phi-3: every special token but
  <unk>, <s>, <|endoftext|> swallows the whitespace after it) strip it as they are parsed.
* End of generation is derived as llama.cpp derives it (end_of_generation.py), retyping the
  tokens it finds by their text.
* Pieces follow llama.cpp's `token_to_piece`: NORMAL tokens are byte-decoded, CONTROL/UNKNOWN
  render as their text unless skipped, USER_DEFINED always render as text, BYTE tokens
  (`<0x0A>`) as their byte, and UNUSED (the `[PAD...]` fillers) and UNDEFINED as nothing.

`decode` is llama.cpp's `llama_detokenize` without its clean_spaces pass (which SentencePiece
never uses): each token's piece (`token_to_piece`), the first token's leading space dropped where
add_space_prefix is set. `detokenize` adds clean_spaces and remove_special, exactly; a streaming
`detokenizer` emits the pieces as llama-server streams them.

The names callers use from the split modules are imported here too, so
`from ane_spec.model.tokenizer import TOKEN_CONTROL, TokenizerData, ...` keeps working.
"""

from __future__ import annotations

import codecs
from typing import Iterable

from ane_spec.errors import TokenizerError
from ane_spec.model.byte_bpe import ByteLevelBPE, byte_decode_token, bytes_to_unicode
from ane_spec.model.end_of_generation import FIM_KIND_TEXTS, end_of_generation
from ane_spec.model.pre_tokenizers import (
    _LLAMA_WHITESPACE,
    _UNICODE_15_LETTERS,
    _UNICODE_15_NUMBERS,
    GPT4O_PATTERN,
    PRE_TOKENIZERS,
    PRE_TYPE_EXPRS,
    RAW_UTF8_PRE_TYPES,
    llama_cpp_split,
)
from ane_spec.model.spm import SentencePieceMerger, escape_whitespace
from ane_spec.model.token_types import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
)
from ane_spec.model.tokenizer_data import TokenizerData, jina_mask_rule, token_texts

__all__ = [
    "FIM_KIND_TEXTS", "GPT4O_PATTERN", "PRE_TOKENIZERS", "PRE_TYPE_EXPRS", "RAW_UTF8_PRE_TYPES",
    "SPLIT_MODES", "TOKEN_BYTE", "TOKEN_CONTROL", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_UNUSED",
    "TOKEN_USER_DEFINED", "IncrementalDetokenizer", "Tokenizer", "TokenizerData",
    "bytes_to_unicode", "end_of_generation", "llama_cpp_split",
    # tests/test_tokenizer.py checks these tables of the split against unicodedata here
    "_LLAMA_WHITESPACE", "_UNICODE_15_LETTERS", "_UNICODE_15_NUMBERS",
]

SPLIT_MODES = ("llama.cpp", "hf")
# C isspace(): what LSTRIP/RSTRIP special tokens strip beside them (tokenizer_st_partition).
_C_SPACE = " \t\n\v\f\r"


def _clean(text: str) -> str:
    """`text` as valid Unicode: lone surrogates (not UTF-8-encodable) become U+FFFD, which is
    what llama.cpp makes of the invalid bytes they would have to be."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


class IncrementalDetokenizer:
    """Turns a stream of token ids into text, emitting only complete UTF-8 characters.

    A character whose bytes are spread over several tokens (an emoji is often four byte
    tokens) is held back until its last byte arrives; `flush` ends the stream, turning a
    dangling partial sequence into U+FFFD. Concatenating every `push` and the `flush` gives
    `Tokenizer.decode_bytes` of the same ids as text: each token's piece, as llama-server
    streams generated text (a continuation keeps its first token's leading space). With
    `starts_text=True` the ids are a whole text, and the concatenation is exactly
    `Tokenizer.decode` (where `add_space_prefix` is set, the first token's leading space is
    dropped).
    """

    def __init__(self, tokenizer: "Tokenizer", *, skip_special: bool = False,
                 starts_text: bool = False) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special
        self._strip = starts_text and tokenizer.data.add_space_prefix
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        piece = self._tok._piece(token_id, self._skip_special)
        if self._strip:
            self._strip = False
            piece = piece[1:] if piece.startswith(b" ") else piece
        return self._decoder.decode(piece)

    def flush(self) -> str:
        text = self._decoder.decode(b"", final=True)
        self._decoder.reset()
        return text


class Tokenizer:
    """Encode/decode exactly as llama.cpp does for a GGUF vocabulary: `gpt2` (byte-level BPE
    with one of the pre-tokenizers in PRE_TOKENIZERS), `llama` (SentencePiece, spm.py) or
    `gemma4` (BPE over raw UTF-8 with spaces as U+2581)."""

    def __init__(self, data: TokenizerData, *, split: str = "llama.cpp") -> None:
        if split not in SPLIT_MODES:
            raise TokenizerError(f"split must be one of {SPLIT_MODES}, not {split!r}")
        self.data = data
        self.split = split
        n = len(data.tokens)
        # TokenizerData has ruled out duplicates and merges naming unknown tokens.
        self._texts = token_texts(data.tokens)
        self._token_to_id: dict[str, int] = {t: i for i, t in enumerate(self._texts)}
        self._types = list(data.token_types)
        self.is_spm = data.model == "llama"
        pre = None if self.is_spm else PRE_TOKENIZERS[data.pre]
        # Tokens are raw UTF-8 with "▁" for spaces (SPM, Gemma 4), not GPT-2 byte strings.
        self._escaped = self.is_spm or (pre is not None and pre.escape_whitespaces)
        if split == "hf" and (pre is None or not pre.byte_encode):
            raise TokenizerError("split='hf' is for byte-level BPE vocabularies only")

        # llama.cpp retypes tokens found by their text and derives end of generation from them.
        self.eog_ids: frozenset[int] = frozenset(
            end_of_generation(data, self._token_to_id, self._types))

        # Special tokens that text can spell, longest first (llama.cpp cache_special_tokens).
        special = [i for i, t in enumerate(self._types)
                   if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN)]
        special.sort(key=lambda i: (-len(self._texts[i].encode("utf-8")), i))
        self._special_ids = special
        self._special_set = frozenset(special)
        self._lstrip, self._rstrip = self._strip_attributes(special)
        self.markup_ids: frozenset[int] = frozenset(i for i in special if self._is_markup(i))
        # What each kind of text may spell: everything (special=True), USER_DEFINED tokens
        # (llama.cpp's parse_special=false), or nothing that is markup (a chat message's text).
        self._user_defined_ids = [i for i in special if self._types[i] == TOKEN_USER_DEFINED]
        self._plain_text_ids = [i for i in self._user_defined_ids if i not in self.markup_ids]
        self._bytes_cache: list[bytes | None] = [None] * n

        if self.is_spm:
            scores = data.scores if data.scores is not None else [0.0] * n
            self._spm = SentencePieceMerger(self._token_to_id, scores)
            return
        self._bpe = ByteLevelBPE(self._token_to_id, data.merges, data.pre,
                                 pre, split)  # type: ignore[arg-type]
        self._hf = self._bpe.hf  # the tokenizer.json pipeline (its decoder is compared in tests)

    def _strip_attributes(self, special: list[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The LSTRIP and RSTRIP token ids llama.cpp sets by the model's name and pre-tokenizer
        (llama_vocab::impl::load, "Handle per token attributes"): a special token so marked
        swallows the whitespace before (LSTRIP) or after (RSTRIP) it when text spells it."""
        rule = self.data.strip_rule
        ids = self._token_to_id
        lstrip: set[int] = set()
        rstrip: set[int] = set()
        if jina_mask_rule(self.data.pre):
            if "<mask>" in ids:
                lstrip.add(ids["<mask>"])
        elif rule == "phi3":  # TokenizerData has checked that these four tokens exist
            rstrip.update(special)
            rstrip.add(ids["</s>"])
            rstrip.difference_update(ids[t] for t in ("<unk>", "<s>", "<|endoftext|>"))
        elif rule == "modern-bert" and "[MASK]" in ids:
            lstrip.add(ids["[MASK]"])
        return frozenset(lstrip), frozenset(rstrip)

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
        """The raw bytes the token stands for: llama.cpp's `token_to_piece(special=true)`.

        NORMAL tokens give their byte-decoded string (byte-level BPE) or their text with `▁` as
        a space (SPM, Gemma 4); BYTE tokens (`<0x0A>`) their byte; CONTROL/USER_DEFINED/UNKNOWN
        tokens the UTF-8 of their text; UNUSED fillers (and UNDEFINED) nothing.
        """
        self._check_id(token_id)
        cached = self._bytes_cache[token_id]
        if cached is None:
            t = self._types[token_id]
            text = self._texts[token_id]
            if t == TOKEN_NORMAL:
                cached = (text.replace("\u2581", " ").encode("utf-8") if self._escaped
                          else byte_decode_token(text))
            elif t in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
                cached = text.encode("utf-8")
            elif t == TOKEN_BYTE:
                cached = _token_to_byte(text)
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
        """The words the pre-tokenizer cuts plain `text` into (no special-token handling).
        SentencePiece does not pre-split: the whole text, spaces escaped, is one piece."""
        if self.is_spm:
            return [escape_whitespace(_clean(text))] if text else []
        return self._bpe.words(self._escape(_clean(text)))

    def _escape(self, text: str) -> str:
        return escape_whitespace(text) if self._escaped else text

    def _partition(self, text: str, candidates: list[int]) -> list[int | str]:
        """Split `text` into the ids of `candidates` (special tokens, longest first) written in
        it and plain-text fragments (llama.cpp's tokenizer_st_partition): each token splits
        every remaining text fragment at all its occurrences, an LSTRIP token dropping the
        whitespace before each, an RSTRIP token the whitespace after."""
        fragments: list[int | str] = [text]
        lstrip, rstrip = self._lstrip, self._rstrip
        for tid in candidates:
            needle = self._texts[tid]
            if not any(isinstance(f, str) and needle in f for f in fragments):
                continue
            out: list[int | str] = []
            strip_left, strip_right = tid in lstrip, tid in rstrip
            for f in fragments:
                if isinstance(f, int) or needle not in f:
                    out.append(f)
                    continue
                if not (strip_left or strip_right):
                    for k, part in enumerate(f.split(needle)):
                        if k:
                            out.append(tid)
                        if part:
                            out.append(part)
                    continue
                pos, end = 0, len(f)
                while pos < end:
                    match = f.find(needle, pos)
                    if match < 0:
                        break
                    left = match
                    while strip_left and left > pos and f[left - 1] in _C_SPACE:
                        left -= 1
                    if left > pos:
                        out.append(f[pos:left])
                    out.append(tid)
                    pos = match + len(needle)
                    while strip_right and pos < end and f[pos] in _C_SPACE:
                        pos += 1
                if pos < end:
                    out.append(f[pos:])
            fragments = out
        return fragments

    def encode(self, text: str, *, special: bool = False, add_special: bool = False) -> list[int]:
        """Token ids for `text`, as llama.cpp's `llama_tokenize(text, add_special, special)`.

        `special=True` recognises CONTROL tokens written in the text (`<|user|>`); otherwise they
        are tokenized as ordinary text. USER_DEFINED tokens are always recognised.
        `add_special` adds BOS/EOS as the GGUF's add_bos_token/add_eos_token ask (Phi-4-mini:
        neither; SentencePiece vocabularies: BOS by default).
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
        boundaries as usual, and an LSTRIP/RSTRIP token strips whitespace across them too."""
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
        if self._lstrip or self._rstrip:
            fragments = self._strip_across(fragments)
        return self._encode_fragments(fragments, add_special)

    def _strip_across(self, fragments: list[int | str]) -> list[int | str]:
        """The whitespace an LSTRIP/RSTRIP token swallows where it came from another piece."""
        out = list(fragments)
        for k, f in enumerate(out):
            if not isinstance(f, int):
                continue
            if f in self._lstrip and k > 0 and isinstance(out[k - 1], str):
                out[k - 1] = out[k - 1].rstrip(_C_SPACE)  # type: ignore[union-attr]
            if f in self._rstrip and k + 1 < len(out) and isinstance(out[k + 1], str):
                out[k + 1] = out[k + 1].lstrip(_C_SPACE)  # type: ignore[union-attr]
        return [f for f in out if f != ""]

    def _encode_fragments(self, fragments: list[int | str], add_special: bool) -> list[int]:
        ids: list[int] = []
        if add_special and self.data.add_bos_token:
            ids.append(self.data.bos_token_id)  # type: ignore[arg-type]
        if self.is_spm:
            self._encode_spm(fragments, ids)
        else:
            self._encode_bpe(fragments, ids)
        if add_special and self.data.add_eos_token:
            ids.append(self.data.eos_token_id)  # type: ignore[arg-type]
        return ids

    def _encode_spm(self, fragments: list[int | str], ids: list[int]) -> None:
        """llama_vocab::impl::tokenize, LLAMA_VOCAB_TYPE_SPM: text that starts the input or
        follows a special token gets a space first when add_space_prefix is set."""
        prefix = self.data.add_space_prefix
        prev_special = True
        for f in fragments:
            if isinstance(f, int):
                ids.append(f)
                prev_special = True
            else:
                text = " " + f if prefix and prev_special else f
                ids.extend(self._spm.encode(escape_whitespace(text)))
                prev_special = False

    def _encode_bpe(self, fragments: list[int | str], ids: list[int]) -> None:
        encoded = self._bpe.encode([self._escape(f) for f in fragments if isinstance(f, str)])
        for f in fragments:
            if isinstance(f, int):
                ids.append(f)
            else:
                ids.extend(next(encoded))

    # -- decoding ---------------------------------------------------------------------------

    def decode_bytes(self, ids: Iterable[int], *, skip_special: bool = False) -> bytes:
        """Each token's piece, concatenated (llama-server's tokens_to_str)."""
        return b"".join(self._piece(int(i), skip_special) for i in ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text for `ids`, as llama.cpp's `llama_detokenize` (remove_special=false); invalid
        UTF-8 (a cut multi-byte character) becomes U+FFFD.

        `skip_special` drops CONTROL tokens (`unparse_special=false`); USER_DEFINED tokens
        always render. Where add_space_prefix is set (SentencePiece), the first token's leading
        space is dropped, so that decode(encode(text)) == text. (llama.cpp's clean_spaces pass,
        which no SentencePiece vocabulary turns on, is not applied.)
        """
        return self._detokenize(list(ids), skip_special, False, False).decode(
            "utf-8", errors="replace")

    def detokenize(self, ids: Iterable[int], *, skip_special: bool = False,
                   remove_special: bool = False) -> str:
        """llama.cpp's `llama_detokenize(remove_special, unparse_special=not skip_special)`
        exactly: `decode`, plus the vocabulary's clean_spaces pass (" ," -> ",", " 's" ->
        "'s", ...; on for most byte-level BPE pre-tokenizers and Gemma 4, off for SPM), and
        with `remove_special` a leading BOS / trailing EOS dropped where the vocabulary adds
        them."""
        return self._detokenize(list(ids), skip_special, remove_special, True).decode(
            "utf-8", errors="replace")

    @property
    def clean_spaces(self) -> bool:
        """llama.cpp's clean_spaces for this vocabulary (never for SentencePiece)."""
        return not self.is_spm and PRE_TOKENIZERS[self.data.pre].clean_spaces

    def _detokenize(self, ids: list[int], skip_special: bool, remove_special: bool,
                    clean: bool) -> bytes:
        data = self.data
        remove_space = data.add_space_prefix
        if remove_special and data.add_bos_token and ids and ids[0] == data.bos_token_id:
            remove_space = False
            ids = ids[1:]
        if remove_special and data.add_eos_token and ids and ids[-1] == data.eos_token_id:
            ids = ids[:-1]
        pieces = [self._piece(int(i), skip_special) for i in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return _clean_spaces(text) if clean and self.clean_spaces else text

    def detokenizer(self, skip_special: bool = False, *,
                    starts_text: bool = False) -> IncrementalDetokenizer:
        """A streaming decoder; `starts_text=True` for ids that begin a text (see
        IncrementalDetokenizer), False for generated tokens that continue a prompt."""
        return IncrementalDetokenizer(self, skip_special=skip_special, starts_text=starts_text)


def _token_to_byte(text: str) -> bytes:
    """llama.cpp `token_to_byte` for a BYTE token: strtol(text.substr(3, 2), 16), as one byte."""
    if len(text) < 3:
        return b""  # llama.cpp's substr throws here
    digits = ""
    for c in text[3:5]:
        if c not in "0123456789abcdefABCDEF":
            break
        digits += c
    return bytes([int(digits, 16) if digits else 0])


def _clean_spaces(text: bytes) -> bytes:
    """llama_detokenize's clean_spaces passes, ported as written (in place, over bytes)."""
    buf = bytearray(text)
    # First pass: " ?", " !", " .", " ," lose the space.
    total1 = len(buf)
    total = 1 if total1 else 0
    for i in range(1, total1):
        x = buf[i]
        if buf[i - 1] == 0x20 and x in b"?!.,":
            total -= 1
        buf[total] = x
        total += 1
    # Second pass: an apostrophe between two spaces loses both.
    total2 = total
    total = 1 if total2 else 0
    i = 1
    while i < total2:
        x = buf[i]
        if x == 0x27 and i + 1 < total2 and buf[i - 1] == 0x20 and buf[i + 1] == 0x20:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        total += 1
        i += 1
    # Third pass: " 's", " 'm", " 're", " 've" lose the space.
    total3 = total
    total = 1 if total3 else 0
    for i in range(1, total3):
        x = buf[i]
        if buf[i - 1] == 0x20 and x == 0x27 and i + 1 < total3:
            x1 = buf[i + 1]
            if x1 in b"sm":
                total -= 1
            elif x1 not in b"td" and i + 2 < total3:
                x2 = buf[i + 2]
                if (x1, x2) in ((0x72, 0x65), (0x76, 0x65)):
                    total -= 1
        buf[total] = x
        total += 1
    return bytes(buf[:total])
