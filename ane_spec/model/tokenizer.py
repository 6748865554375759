r"""Tokenizers read from GGUF metadata, tokenizing the way llama.cpp does.

Three `tokenizer.ggml.model` values are read:

* `llama`: SentencePiece vocabularies (Llama 2, Mistral 7B, TinyLlama, Phi-3, Gemma 3). llama.cpp
  runs its own score-driven merge over the characters (`llm_tokenizer_spm`, ported in spm.py)
  with `<0xXX>` byte fallback; spaces are escaped to U+2581 and, with add_space_prefix (the
  default), text that starts the input or follows a special token gets one first. BOS is added
  by default; the default BOS/EOS/UNK ids are 1/2/0.
* `gemma4`, and the `gemma4`/`sarvam-moe` pre-tokenizers of a `gpt2` file: BPE by merge rank,
  over raw UTF-8 with spaces escaped to U+2581 (not GPT-2 bytes), split only at newlines, with
  `<0xXX>` byte fallback; llama.cpp always adds BOS for Gemma 4.
* `gpt2`: byte-level BPE, below.

`decode` is llama.cpp's `llama_detokenize` without its clean_spaces pass (which SentencePiece
never uses): each token's piece (`token_to_piece`), the first token's leading space dropped where
add_space_prefix is set. `detokenize` adds clean_spaces and remove_special, exactly; a streaming
`detokenizer` emits the pieces as llama-server streams them.

The byte-level BPE (`tokenizer.ggml.model = "gpt2"`): every token of
type NORMAL is a string over the 256-symbol GPT-2 byte-to-unicode alphabet, merges are ranked by
their index, and the pre-tokenizer named by `tokenizer.ggml.pre` cuts text into words before BPE
runs on each word separately. Which names exist, and what each one does, is llama.cpp's table,
mirrored as data here: PRE_TOKENIZERS (name -> pre type, ignore_merges, default add_bos) and
PRE_TYPE_EXPRS (pre type -> its split expressions, verbatim). Phi-4-mini is `gpt-4o`, Llama 3
`llama-bpe`, Qwen 2.5 `qwen2`, SmolLM2 `smollm` (digits one by one, then GPT-2's split),
DeepSeek, StarCoder, Falcon, Mistral's `tekken`, ... An unknown name is refused by name.

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
* Pieces follow llama.cpp's `token_to_piece`: NORMAL tokens are byte-decoded, CONTROL/UNKNOWN
  render as their text unless skipped, USER_DEFINED always render as text, BYTE tokens
  (`<0x0A>`) as their byte, and UNUSED (the `[PAD...]` fillers) and UNDEFINED as nothing.
* Special tokens llama.cpp marks LSTRIP/RSTRIP by model name (Phi-3: every special token but
  <unk>, <s>, <|endoftext|> swallows the whitespace after it) strip it as they are parsed.
* End of generation is derived as llama.cpp derives it (`end_of_generation`): EOS, EOT, EOM,
  the FIM pad/repo/separator tokens, and tokens named like end-of-generation markers
  (`<|end|>`, `<|im_end|>`, `<|endoftext|>`, ...), which become CONTROL whatever the file says
  (SmolLM2: `<|endoftext|>`, `<|im_end|>` and `<reponame>`); a duplicated merge keeps
  its first rank (llama.cpp `bpe_ranks.emplace`); a vocabulary with a duplicated token string is
  refused (llama.cpp aborts on one).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable

from pydantic import BaseModel, ConfigDict, model_validator

from ane_spec.errors import TokenizerError, untrusted
from ane_spec.model.spm import escape_whitespace

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
# LLAMA_VOCAB_PRE_TYPE_GPT4O, but runs its "adapted" form, PRE_TYPE_EXPRS["GPT4O"]).
GPT4O_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's and Qwen 2's tokenizer.json patterns (Qwen: single digits).
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


@dataclass(frozen=True)
class PreTokenizer:
    """What llama.cpp's `llama_vocab::impl::load` sets for one `tokenizer.ggml.pre` name: the
    pre type (whose split expressions are PRE_TYPE_EXPRS[pre_type]) and the flags its branch
    sets. ignore_merges: a word that is itself a token is emitted whole. add_bos: the default of
    tokenizer.ggml.add_bos_token. clean_spaces: llama.cpp's detokenizer option (recorded; this
    module's decode is token_to_piece's, which does not use it)."""

    pre_type: str
    ignore_merges: bool = False
    add_bos: bool = False
    clean_spaces: bool = True
    escape_whitespaces: bool = False

    @property
    def exprs(self) -> tuple[str, ...]:
        return PRE_TYPE_EXPRS[self.pre_type]

    @property
    def byte_encode(self) -> bool:
        """GPT-2 byte-level tokens; False for SPM-style BPE over raw UTF-8 (Gemma 4)."""
        return self.pre_type not in RAW_UTF8_PRE_TYPES


# -- llama.cpp's pre-tokenizer table (llama-vocab.cpp), as data ----------------------------------
#
# LLAMA_VOCAB_PRE_TYPE_* -> the regex_exprs `llm_tokenizer_bpe` runs, verbatim (C string literals
# copied as Python ones: "\\p{L}" is the regex \p{L}, "[\r\n]" holds a real CR and LF). Each
# expression splits every piece the previous one left (unicode_regex_split); how one is run is in
# `llama_cpp_split`. tests/test_llama_cpp_vocabs.py checks this table against llama.cpp's source.
# GEMMA4 and SARVAM_MOE are SPM-style BPE: spaces escaped to U+2581, merges over raw UTF-8 (no
# GPT-2 byte encoding, RAW_UTF8_PRE_TYPES), unknown characters as `<0xXX>` byte tokens.
# Left out, as their splits are not regexes this module runs: TINY_AYA, AFMOE (custom digit
# grouping), KIMI_K2 (custom \p{Han} scanner), SUPERBPE (empty lookahead matches), and
# WHITESPACE (its own tokenizer session).
PRE_TYPE_EXPRS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(('LLAMA3', 'DBRX', 'SMAUG', 'CHATGLM4'), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('JAIS2',), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s{512}(?!\\S)|\\s{256}(?!\\S)|\\s{128}(?!\\S)|\\s{64}(?!\\S)|\\s{32}(?!\\S)|\\s{16}(?!\\S)|\\s{8}(?!\\S)|\\s{4}(?!\\S)|\\s{1,2}(?!\\S)|\\s{1}",
    )),
    **dict.fromkeys(('DEEPSEEK_LLM',), (
        '[\r\n]',
        '\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+',
        '\\s?[!-/:-~！-／：-～‘-‟\u3000-。]+',
        '\\s+$',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}+',
    )),
    **dict.fromkeys(('DEEPSEEK3_LLM', 'HUNYUAN_DENSE', 'JOYAI_LLM', 'HY_V4'), (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+',
    )),
    **dict.fromkeys(('SPARK2_5',), (
        '\\p{N}{1,3}',
        '[一-龥\u3040-ゟ゠-ヿ]+',
        '[!"#$%&\'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+|[\r\n]|\\s+(?!\\S)|\\s+',
        '\\p{N}',
    )),
    **dict.fromkeys(('YOUTU',), (
        '[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+',
        "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('DEEPSEEK_CODER',), (
        '[\r\n]',
        '\\s?\\p{L}+',
        '\\s?\\p{P}+',
        '[一-龥ࠀ-一가-\ud7ff]+',
        '\\p{N}',
    )),
    **dict.fromkeys(('FALCON',), (
        '[\\p{P}\\$\\+<=>\\^~\\|`]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '[0-9][0-9][0-9]',
    )),
    **dict.fromkeys(('STARCODER', 'REFACT', 'COMMAND_R', 'SMOLLM', 'CODESHELL', 'EXAONE', 'MINERVA', 'MELLUM2'), (
        '\\p{N}',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    )),
    **dict.fromkeys(('GPT2', 'MPT', 'OLMO', 'JAIS', 'TRILLION', 'GRANITE_DOCLING'), (
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    )),
    **dict.fromkeys(('STABLELM2', 'QWEN2', 'HUNYUAN', 'SOLAR_OPEN', 'GROK_2'), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('QWEN35',), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('PORO', 'BLOOM', 'GPT3_FINNISH'), (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
    )),
    **dict.fromkeys(('VIKING',), (
        ' ?[^(\\s|.,!?…。，、।۔،)]+',
        '\\p{N}',
    )),
    **dict.fromkeys(('TEKKEN',), (
        '[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    )),
    **dict.fromkeys(('CHAMELEON',), (
        '<sentinel:[0-9]+>',
        '(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z',
        '([\\t\\n]|    |  )',
        '\\p{N}',
        '[\\p{P}!-/:-@\\[-`{-~]',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
    )),
    **dict.fromkeys(('GPT4O', 'MINIMAX_M2'), (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))*((?=[\\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}])([^a-z]))+((?=[\\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('GRANITE_EMB_MULTI',), (
        "[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))*((?=[\\p{L}\\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\\r\\n\\p{L}\\p{N}]?((?=[\\p{L}\\p{M}])([^a-z]))+((?=[\\p{L}\\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('BAILINGMOE',), (
        "'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('SEED_CODER',), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1}| ?[^\\s\\p{L}\\p{N}\\r\\n]+|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('UFAKZEKA',), (
        '[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+',
    )),
    **dict.fromkeys(('LAGUNA',), (
        '[^\\n]+|[\\n]+',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('EXAONE_MOE',), (
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?(?:\\p{L}\\p{M}*(?: \\p{L}\\p{M}*)*)+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]?|\\s*[\\r\\n]|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('MINICPM5',), (
        '\\p{N}{1,3}',
        "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}+| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
    )),
    **dict.fromkeys(('GEMMA4', 'SARVAM_MOE'), (
        '[^\\n]+|[\\n]+',
    )),
    **dict.fromkeys(('DEFAULT',), (
        '[\\p{P}\\$\\+<=>\\^~\\|]+',
        "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)",
        '\\p{N}+',
        '[0-9][0-9][0-9]',
    )),
}

# `tokenizer.ggml.pre` name -> its pre type and flags, one line per name as llama.cpp's if/else
# chain has them (names that also set add_sep, jina-v1-en, jina-v2-code and roberta-bpe, are
# left out: BERT-style separators are not supported).
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    'default': PreTokenizer('DEFAULT'),
    'minicpm5': PreTokenizer('MINICPM5', ignore_merges=True),
    'llama3': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'llama-v3': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'llama-bpe': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'falcon3': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'falcon-h1': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'pixtral': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'midm-2.0': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'lfm2': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'jina-v5-nano': PreTokenizer('LLAMA3', ignore_merges=True, add_bos=True),
    'deepseek-llm': PreTokenizer('DEEPSEEK_LLM', clean_spaces=False),
    'deepseek-coder': PreTokenizer('DEEPSEEK_CODER', clean_spaces=False),
    'deepseek-v3': PreTokenizer('DEEPSEEK3_LLM', clean_spaces=False),
    'spark2_5': PreTokenizer('SPARK2_5', clean_spaces=False),
    'youtu': PreTokenizer('YOUTU', ignore_merges=True, clean_spaces=False),
    'falcon': PreTokenizer('FALCON'),
    'mpt': PreTokenizer('MPT'),
    'starcoder': PreTokenizer('STARCODER'),
    'gpt-2': PreTokenizer('GPT2'),
    'phi-2': PreTokenizer('GPT2'),
    'jina-es': PreTokenizer('GPT2'),
    'jina-de': PreTokenizer('GPT2'),
    'gigachat': PreTokenizer('GPT2'),
    'jina-v2-es': PreTokenizer('GPT2'),
    'jina-v2-de': PreTokenizer('GPT2'),
    'a.x-4.0': PreTokenizer('GPT2'),
    'mellum': PreTokenizer('GPT2'),
    'modern-bert': PreTokenizer('GPT2'),
    'jais-2': PreTokenizer('JAIS2'),
    'gemma4': PreTokenizer('GEMMA4', escape_whitespaces=True),
    'granite-embed-multi-311m': PreTokenizer('GEMMA4', escape_whitespaces=True),
    'sarvam-moe': PreTokenizer('SARVAM_MOE', clean_spaces=False, escape_whitespaces=True),
    'refact': PreTokenizer('REFACT'),
    'command-r': PreTokenizer('COMMAND_R', clean_spaces=False),
    'qwen2': PreTokenizer('QWEN2', clean_spaces=False),
    'deepseek-r1-qwen': PreTokenizer('QWEN2', clean_spaces=False),
    'kormo': PreTokenizer('QWEN2', clean_spaces=False),
    'f2llmv2': PreTokenizer('QWEN2', clean_spaces=False),
    'qwen35': PreTokenizer('QWEN35', clean_spaces=False),
    'stablelm2': PreTokenizer('STABLELM2'),
    'olmo': PreTokenizer('OLMO'),
    'dbrx': PreTokenizer('DBRX'),
    'smaug-bpe': PreTokenizer('SMAUG'),
    'poro-chat': PreTokenizer('PORO', clean_spaces=False),
    'chatglm-bpe': PreTokenizer('CHATGLM4'),
    'glm4': PreTokenizer('CHATGLM4', ignore_merges=True),
    'glm5': PreTokenizer('CHATGLM4', ignore_merges=True),
    'viking': PreTokenizer('VIKING', clean_spaces=False),
    'jais': PreTokenizer('JAIS'),
    'tekken': PreTokenizer('TEKKEN', ignore_merges=True, add_bos=True, clean_spaces=False),
    'smollm': PreTokenizer('SMOLLM', clean_spaces=False),
    'codeshell': PreTokenizer('CODESHELL'),
    'bloom': PreTokenizer('BLOOM'),
    'gpt3-finnish': PreTokenizer('GPT3_FINNISH'),
    'exaone': PreTokenizer('EXAONE'),
    'exaone4': PreTokenizer('GPT2'),
    'exaone-moe': PreTokenizer('EXAONE_MOE'),
    'chameleon': PreTokenizer('CHAMELEON', add_bos=True, clean_spaces=False),
    'minerva-7b': PreTokenizer('MINERVA'),
    'megrez': PreTokenizer('QWEN2'),
    'gpt-4o': PreTokenizer('GPT4O', clean_spaces=False),
    'llama4': PreTokenizer('GPT4O', clean_spaces=False),
    'kanana2': PreTokenizer('GPT4O', clean_spaces=False),
    'talkie': PreTokenizer('GPT4O', clean_spaces=False),
    'granite-embed-multi-97m': PreTokenizer('GRANITE_EMB_MULTI', ignore_merges=True, clean_spaces=False),
    'trillion': PreTokenizer('TRILLION', clean_spaces=False),
    'granite-docling': PreTokenizer('GRANITE_DOCLING', clean_spaces=False),
    'bailingmoe': PreTokenizer('BAILINGMOE', clean_spaces=False),
    'bailingmoe2': PreTokenizer('BAILINGMOE', clean_spaces=False),
    'llada-moe': PreTokenizer('BAILINGMOE', clean_spaces=False),
    'seed-coder': PreTokenizer('SEED_CODER', clean_spaces=False),
    'hunyuan': PreTokenizer('HUNYUAN', clean_spaces=False),
    'hunyuan-dense': PreTokenizer('HUNYUAN_DENSE', clean_spaces=False),
    'hy_v4': PreTokenizer('HY_V4', clean_spaces=False),
    'joyai-llm': PreTokenizer('JOYAI_LLM', clean_spaces=False),
    'ufakzeka': PreTokenizer('UFAKZEKA', clean_spaces=False),
    'grok-2': PreTokenizer('GROK_2', clean_spaces=False),
    'laguna': PreTokenizer('LAGUNA', clean_spaces=False),
    'minimax-m2': PreTokenizer('MINIMAX_M2', clean_spaces=False),
    'solar-open': PreTokenizer('SOLAR_OPEN', clean_spaces=False),
    'mellum2': PreTokenizer('MELLUM2'),
}

#: tokenizer.json patterns for the names `split="hf"` can run (as HF tokenizers would).
PRE_TOKENIZER_PATTERNS: dict[str, str] = {
    "gpt-4o": GPT4O_PATTERN, "qwen2": QWEN2_PATTERN,
    **{name: LLAMA3_PATTERN for name in ("llama3", "llama-v3", "llama-bpe")}}
# Compatibility names: llama.cpp's adapted gpt-4o/llama3/qwen2 expressions.
GPT4O_PATTERN_LLAMA_CPP = PRE_TYPE_EXPRS["GPT4O"][0]
LLAMA3_PATTERN_LLAMA_CPP = PRE_TYPE_EXPRS["LLAMA3"][0]
QWEN2_PATTERN_LLAMA_CPP = PRE_TYPE_EXPRS["QWEN2"][0]
LLAMA3_PRE_NAMES = tuple(n for n, p in PRE_TOKENIZERS.items() if p.pre_type == "LLAMA3")


def default_add_bos(pre: str, model: str = "gpt2") -> bool:
    """llama.cpp's add_bos when the GGUF has no tokenizer.ggml.add_bos_token key: true for SPM
    (`llama`) vocabularies, else what the pre-tokenizer's branch sets."""
    if model == "llama":
        return True
    known = PRE_TOKENIZERS.get(pre)
    return known is not None and known.add_bos


#: llama.cpp's per-model special-token attributes (llama_vocab::impl::load, "Handle per token
#: attributes"), chosen by general.name: "phi3" (every special token RSTRIP but <unk>, <s>,
#: <|endoftext|>; </s> too) or "modern-bert" ([MASK] LSTRIP). The jina-v2 pre-tokenizers'
#: <mask> LSTRIP goes by tokenizer.ggml.pre and comes first.
STRIP_RULES = (None, "phi3", "modern-bert")
PHI3_ATTR_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")


def strip_rule_for_name(name: str | None) -> str | None:
    """The STRIP_RULES entry llama.cpp applies for a model's general.name."""
    lowered = (name or "").lower()
    if "phi-3" in lowered or "phi3" in lowered:
        return "phi3"
    if "modern-bert" in lowered:
        return "modern-bert"
    return None


def _jina_mask_rule(pre: str) -> bool:
    return any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))


def forced_add_bos(pre: str, model: str = "gpt2") -> bool:
    """Whether llama.cpp adds BOS whatever the file says (its Gemma 4 workaround, PR 21500)."""
    known = PRE_TOKENIZERS.get(pre)
    return model != "llama" and known is not None and known.pre_type == "GEMMA4"


#: `tokenizer.ggml.model` values: byte-level BPE, SentencePiece, and Gemma 4's BPE (always read
#: with the `gemma4` pre-tokenizer).
TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")


SPLIT_MODES = ("llama.cpp", "hf")
#: Pre types whose tokens are raw UTF-8 with spaces as U+2581, not GPT-2 byte-level strings.
RAW_UTF8_PRE_TYPES = frozenset({"GEMMA4", "SARVAM_MOE"})
# C isspace(): what LSTRIP/RSTRIP special tokens strip beside them (tokenizer_st_partition).
_C_SPACE = " \t\n\v\f\r"

# llama-vocab.cpp's token-text scans (its "auto-detect special tokens by text"), in its order.
# Tokens with these texts become end of generation and CONTROL whatever the file says.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>",
             "<|calls|>", "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>",
             "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>", "<eos>",
             "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[")
# special_eot_id / special_eom_id when the file names none (all of them are EOG_TEXTS too).
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
             "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
# Fill-in-the-middle tokens, by kind: each kind's token (from its tokenizer.ggml.fim_*_token_id
# key, else the first token found with one of these texts) is forced to CONTROL; the pad, repo
# and file-separator ones also end generation.
FIM_KIND_TEXTS: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
            "▁<PRE>", "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
            "▁<SUF>", "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
            "▁<MID>", "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
FIM_EOG_KINDS = ("pad", "rep", "sep")
FIM_TEXTS = tuple(t for k in ("pre", "suf", "mid") for t in FIM_KIND_TEXTS[k])
FIM_EOG_TEXTS = tuple(t for k in FIM_EOG_KINDS for t in FIM_KIND_TEXTS[k])


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
    "S": "\xd5\\$\\+<->\\^`\\|\\~",
}
# The \p{..} names llama.cpp collapses (k_ucat_enum); an expression naming none of them runs on
# the text itself.
_COLLAPSED_NAMES = {"N": "N", "L": "L", "P": "P", "M": "M", "S": "S",
                    "Lu": "L", "Ll": "L", "Lt": "L", "Lm": "L", "Lo": "L"}


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
            name = _COLLAPSED_NAMES.get(expr[i + 3:close]) if close > 0 else None
            if name is not None:
                cls = _COLLAPSED_CLASS[name]
                out.append(cls if inside else f"[{cls}]")
                i = close + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


def _uses_collapse(expr: str) -> bool:
    """Whether llama.cpp runs `expr` over collapsed text (it names a \\p{..} category)."""
    return any(f"\\p{{{name}}}" in expr for name in _COLLAPSED_NAMES)


def _ecmascript_to_python(expr: str) -> str:
    """The few places where std::regex (ECMAScript) and Python's `re` read one expression
    differently: `$` outside a class is the end of the input only (Python's also matches before
    a final newline), so it becomes `\\Z`."""
    out: list[str] = []
    inside = False
    i = 0
    while i < len(expr):
        c = expr[i]
        if c == "\\":
            out.append(expr[i:i + 2])
            i += 2
            continue
        if c == "[" and not inside:
            inside = True
        elif c == "]" and inside:
            inside = False
        out.append("\\Z" if c == "$" and not inside else c)
        i += 1
    return "".join(out)


@lru_cache(maxsize=1)
def _whitespace_table() -> dict[int, int]:
    """`str.translate` table for expressions run without collapsing: llama.cpp replaces
    non-ASCII White_Space by 0x0B there too (std::wregex's \\s knows only ASCII)."""
    return {cp: 0x0B for cp in _LLAMA_WHITESPACE if cp >= 0x80}


@lru_cache(maxsize=None)
def _compiled_exprs(pre_type: str) -> tuple[tuple[bool, object], ...]:
    """(collapsed?, compiled regex) for each of the pre type's expressions."""
    import re

    # re.ASCII: std::regex's \s is C isspace ([ \t\n\v\f\r]), \d is [0-9]; non-ASCII
    # whitespace has become 0x0B by then.
    out = []
    for expr in PRE_TYPE_EXPRS[pre_type]:
        collapsed = _uses_collapse(expr)
        source = _ecmascript_to_python(collapse_regex(expr) if collapsed else expr)
        out.append((collapsed, re.compile(source, re.ASCII)))
    return tuple(out)


def llama_cpp_split(text: str, pre: str = "gpt-4o") -> list[str]:
    """The words llama.cpp's pre-tokenizer `pre` cuts `text` into (unicode_regex_split).

    Each of the pre type's expressions runs over every piece the previous ones left (the
    pieces are regex_iterator ranges: a match never crosses a piece's end, and lookaheads stop
    there); text between matches becomes a piece too. An expression naming a \\p{..} category
    runs over the collapsed text, the others over the text with non-ASCII whitespace as 0x0B.
    """
    known = PRE_TOKENIZERS.get(pre)
    if known is None:
        raise TokenizerError(f"pre-tokenizer {untrusted(pre)} is not supported")
    compiled = _compiled_exprs(known.pre_type)
    views: dict[bool, str] = {}
    spans = [(0, len(text))] if text else []
    for collapsed, rx in compiled:
        view = views.get(collapsed)
        if view is None:
            view = views[collapsed] = text.translate(
                _collapse_table() if collapsed else _whitespace_table())
        out: list[tuple[int, int]] = []
        for lo, hi in spans:
            pos = 0
            piece = view[lo:hi]
            for m in rx.finditer(piece):  # type: ignore[attr-defined]
                start, end = m.span()
                if start > pos:  # unmatched stretches become pieces too
                    out.append((lo + pos, lo + start))
                if end > start:
                    out.append((lo + start, lo + end))
                pos = end
            if pos < hi - lo:
                out.append((lo + pos, hi))
        spans = out
    return [text[lo:hi] for lo, hi in spans]


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
    # tokenizer.ggml.eot_token_id, eom_token_id and fim_{pre,suf,mid,pad,rep,sep}_token_id,
    # when the file has them (llama.cpp otherwise finds these tokens by their text).
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    fim_token_ids: dict[str, int] = {}
    # tokenizer.ggml.scores (SentencePiece merges go by them; llama.cpp reads 0 without them),
    # tokenizer.ggml.add_space_prefix (SPM: a space before text that starts the prompt or
    # follows a special token; any model: decoding drops the first token's leading space; the
    # GGUF reader defaults it to true for SPM), and the rule by which llama.cpp gives some
    # models' special tokens LSTRIP/RSTRIP, found from general.name (strip_rule_for_name).
    scores: list[float] | None = None
    add_space_prefix: bool = False
    strip_rule: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "TokenizerData":
        if self.model not in TOKENIZER_MODELS:
            raise TokenizerError(
                f"tokenizer model {untrusted(self.model)} is not supported; supported: 'gpt2' "
                "(byte-level BPE: Phi-4-mini, Llama 3, Qwen), 'llama' (SentencePiece: Llama 2, "
                "Mistral, Phi-3, Gemma 3) and 'gemma4'")
        if self.model != "llama" and self.pre not in PRE_TOKENIZERS:
            raise TokenizerError(
                f"pre-tokenizer {untrusted(self.pre)} is not supported; supported: "
                f"{', '.join(sorted(PRE_TOKENIZERS))}")
        if self.model == "gemma4" and self.pre != "gemma4":
            raise TokenizerError(f"tokenizer model 'gemma4' goes with pre-tokenizer 'gemma4' "
                                 f"(llama.cpp sets it), not {untrusted(self.pre)}")
        n = len(self.tokens)
        if n == 0:
            raise TokenizerError("the vocabulary is empty")
        if self.scores is not None and len(self.scores) < n:
            raise TokenizerError(f"{n} tokens but only {len(self.scores)} scores")
        if self.strip_rule not in STRIP_RULES:
            raise TokenizerError(f"strip_rule must be one of {STRIP_RULES}, not "
                                 f"{untrusted(str(self.strip_rule))}")
        if len(self.token_types) != n:
            raise TokenizerError(f"{n} tokens but {len(self.token_types)} token types")
        bad = sorted(set(self.token_types) - _KNOWN_TYPES)
        if bad:
            shown = ", ".join(str(t) for t in bad[:5]) + (" ..." if len(bad) > 5 else "")
            raise TokenizerError(f"unknown token type(s) {shown} (valid: 0-6)")
        bad_kinds = sorted(set(self.fim_token_ids) - set(FIM_KIND_TEXTS))
        if bad_kinds:
            raise TokenizerError(f"unknown fill-in-the-middle token kind(s) {bad_kinds}")
        ids = [(name, getattr(self, name)) for name in (
            "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id",
            "eot_token_id", "eom_token_id")]
        ids += [(f"fim_{k}_token_id", v) for k, v in self.fim_token_ids.items()]
        for name, v in ids:
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
        if self.model != "llama":  # SentencePiece merges go by score; llama.cpp ignores these
            _check_merges(self.merges, frozenset(texts))
        if self.strip_rule == "phi3" and not _jina_mask_rule(self.pre):
            missing = [t for t in PHI3_ATTR_TOKENS if t not in texts]
            if missing:
                raise TokenizerError(
                    f"general.name names Phi-3, for which llama.cpp sets attributes of "
                    f"{', '.join(PHI3_ATTR_TOKENS)}; this vocabulary lacks {', '.join(missing)}, "
                    "and llama.cpp refuses to load it")
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


def end_of_generation(data: TokenizerData, token_to_id: dict[str, int],
                      types: list[int]) -> set[int]:
    """The end-of-generation ids llama.cpp derives for a vocabulary (llama_vocab::impl::load),
    retyping `types` in place as it does.

    * EOT, EOM and each fill-in-the-middle kind: the id its tokenizer.ggml.*_token_id key names,
      else the token with one of its texts (EOT_TEXTS, EOM_TEXTS, FIM_KIND_TEXTS), made CONTROL.
      Where a vocabulary has several texts of one kind, llama.cpp takes whichever its hash map
      yields first; this takes the lowest id.
    * End of generation: the FIM pad, repo and separator tokens; every token whose text is in
      EOG_TEXTS (made CONTROL); EOS, EOT and EOM.
    * gpt-oss's `<|channel|>` `<|message|>` `<|start|>` `<|constrain|>` become USER_DEFINED.
    * With `<|return|>` and `<|call|>` (or `<|calls|>` and `<|flush|>`), `<|end|>` is no end of
      generation but USER_DEFINED; with `<|tool_response>` or `<|plamo:eos|>`, `</s>` is NORMAL.
    """
    def by_text(texts: tuple[str, ...]) -> int | None:
        found = [token_to_id[t] for t in texts if t in token_to_id]
        if not found:
            return None
        types[min(found)] = TOKEN_CONTROL
        return min(found)

    eot = data.eot_token_id if data.eot_token_id is not None else by_text(EOT_TEXTS)
    eom = data.eom_token_id if data.eom_token_id is not None else by_text(EOM_TEXTS)
    fim = {kind: data.fim_token_ids[kind] if kind in data.fim_token_ids else by_text(texts)
           for kind, texts in FIM_KIND_TEXTS.items()}
    eog = {fim[k] for k in FIM_EOG_KINDS if fim[k] is not None}
    for text in EOG_TEXTS:
        i = token_to_id.get(text)
        if i is not None:
            eog.add(i)
            types[i] = TOKEN_CONTROL
    for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
        i = token_to_id.get(text)
        if i is not None:
            types[i] = TOKEN_USER_DEFINED
    eog |= {i for i in (data.eos_token_id, eot, eom) if i is not None}

    def eog_id(text: str) -> int | None:
        i = token_to_id.get(text)
        return i if i in eog else None

    end = eog_id("<|end|>")
    calls = eog_id("<|call|>") is not None or eog_id("<|calls|>") is not None
    if end is not None and calls and (eog_id("<|return|>") is not None
                                      or eog_id("<|flush|>") is not None):
        eog.discard(end)
        types[end] = TOKEN_USER_DEFINED
    s = eog_id("</s>")
    if s is not None and (eog_id("<|tool_response>") is not None
                          or eog_id("<|plamo:eos|>") is not None):
        eog.discard(s)
        types[s] = TOKEN_NORMAL
    return eog


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
            from ane_spec.model.spm import SentencePieceMerger

            scores = data.scores if data.scores is not None else [0.0] * n
            self._spm = SentencePieceMerger(self._token_to_id, scores)
            return
        self._init_bpe(data, pre, split)  # type: ignore[arg-type]

    def _init_bpe(self, data: TokenizerData, pre: PreTokenizer, split: str) -> None:
        from tokenizers import Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        merges: list[tuple[str, str]] = []
        seen: set[tuple[str, str]] = set()
        for k, m in enumerate(data.merges):
            pair = _split_merge(k, m)
            if pair not in seen:  # llama.cpp keeps a duplicated merge's first rank
                seen.add(pair)
                merges.append(pair)

        pattern = PRE_TOKENIZER_PATTERNS.get(data.pre)
        if split == "hf" and pattern is None:
            raise TokenizerError(f"split='hf' needs a tokenizer.json pattern; pre-tokenizer "
                                 f"{untrusted(data.pre)} has none here")
        try:
            # The Python constructor beats serialising a tokenizer.json for from_str (0.2 s vs
            # 0.7 s at 200k merges). Without byte encoding, a character that is no token
            # becomes its `<0xXX>` tokens, as llama.cpp's BPE session does for Gemma 4.
            bpe = models.BPE(vocab=self._token_to_id, merges=merges, dropout=None,
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
        self._hf = hf
        self._hf_words = words
        # Gemma 4: a word of newlines only that is itself a token is that token (PR 21343).
        self._whole_newlines = pre.pre_type == "GEMMA4"

    def _strip_attributes(self, special: list[int]) -> tuple[frozenset[int], frozenset[int]]:
        """The LSTRIP and RSTRIP token ids llama.cpp sets by the model's name and pre-tokenizer
        (llama_vocab::impl::load, "Handle per token attributes"): a special token so marked
        swallows the whitespace before (LSTRIP) or after (RSTRIP) it when text spells it."""
        rule = self.data.strip_rule
        ids = self._token_to_id
        lstrip: set[int] = set()
        rstrip: set[int] = set()
        if _jina_mask_rule(self.data.pre):
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
        if self.split == "llama.cpp":
            return llama_cpp_split(self._escape(_clean(text)), self.data.pre)
        table = unicode_to_bytes()
        return [bytes(table[c] for c in piece).decode("utf-8")
                for piece, _ in self._hf.pre_tokenizer.pre_tokenize_str(_clean(text))]

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
        plain = [self._escape(f) for f in fragments if isinstance(f, str)]
        if not plain:
            encoded = iter([])
        elif self.split == "llama.cpp":
            pre = self.data.pre
            words = [llama_cpp_split(f, pre) for f in plain]
            batch = self._hf_words.encode_batch(words, is_pretokenized=True,
                                                add_special_tokens=False)
            encoded = iter(self._whole_newline_words(w, e.ids, e.word_ids)
                           if self._whole_newlines else e.ids for w, e in zip(words, batch))
        else:
            encoded = iter(e.ids for e in self._hf.encode_batch(plain, add_special_tokens=False))
        for f in fragments:
            if isinstance(f, int):
                ids.append(f)
            else:
                ids.extend(next(encoded))

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
