r"""llama.cpp's pre-tokenizers for BPE vocabularies: which `tokenizer.ggml.pre` names exist, what
each sets, and the split each runs (`llama_cpp_split`), all mirrored from llama-vocab.cpp and
unicode.cpp as data (tests/test_llama_cpp_vocabs.py checks the table against llama.cpp's source).

PRE_TOKENIZERS: name -> pre type and flags (ignore_merges, default add_bos, clean_spaces,
escape_whitespaces). PRE_TYPE_EXPRS: pre type -> its split expressions, verbatim. Phi-4-mini is
`gpt-4o`, Llama 3 `llama-bpe`, Qwen 2.5 `qwen2`, SmolLM2 `smollm` (digits one by one, then
GPT-2's split), DeepSeek, StarCoder, Falcon, Mistral's `tekken`, ...

llama.cpp does not run the o200k pattern as written: it runs an "adapted" ASCII-only rewrite
(`((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+` for the cased-letter classes) with std::regex
over a "collapsed" copy of the text in which every non-ASCII code point is replaced by one byte
standing for its general category (letter, number, punctuation, mark, symbol, whitespace,
other). Two consequences differ from HF/tiktoken: combining marks (\p{M}: Indic vowel signs and
viramas, Thai vowels, Arabic harakat, NFD accents) are not word characters, so `नमस्ते` splits
into `नमस`, `्त`, `े`; and every non-ASCII letter counts as both upper and lower case, so word
boundaries move wherever one meets an ASCII case change: `ПриветМир` and `aÉb` stay one word,
while `ÉCOLE` splits into `É`, `COLE`. `llama_cpp_split` reproduces this byte for byte; the
tokenizer.json patterns (PRE_TOKENIZER_PATTERNS) are what `split="hf"` runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ane_spec.errors import TokenizerError, untrusted

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
#: Pre types whose tokens are raw UTF-8 with spaces as U+2581, not GPT-2 byte-level strings.
RAW_UTF8_PRE_TYPES = frozenset({"GEMMA4", "SARVAM_MOE"})


def default_add_bos(pre: str, model: str = "gpt2") -> bool:
    """llama.cpp's add_bos when the GGUF has no tokenizer.ggml.add_bos_token key: true for SPM
    (`llama`) vocabularies, else what the pre-tokenizer's branch sets."""
    if model == "llama":
        return True
    known = PRE_TOKENIZERS.get(pre)
    return known is not None and known.add_bos


def forced_add_bos(pre: str, model: str = "gpt2") -> bool:
    """Whether llama.cpp adds BOS whatever the file says (its Gemma 4 workaround, PR 21500)."""
    known = PRE_TOKENIZERS.get(pre)
    return model != "llama" and known is not None and known.pre_type == "GEMMA4"


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
