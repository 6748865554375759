"""Phi-4-mini-layout vocabularies: real byte-level BPE, real layout, any size.

`phi4_mini_layout(merges, n)` lays trained merges out like Phi-4-mini's 200064-entry vocabulary,
scaled to `n` entries:

    ids 0..255                      the 256 single bytes, as GPT-2 byte-to-unicode strings
    ids 256..                       merge results, in merge order (rank = index in `merges`)
    up to id n-67                   (the real vocab's BPE region ends at 199997)
    ...                             `[PAD<id>]` fillers, type UNUSED
    id n-65                         <|endoftext|>  (199999 in the real vocab; bos = eos = unk = pad)
    ids n-46 .. n-36                <|endofprompt|> <|assistant|> <|end|> <|user|> <|system|>
                                    <|tool|> <|/tool|> <|tool_call|> <|/tool_call|>
                                    <|tool_response|> <|tag|>   (200018..200028 in the real one)

Merges come from HF `tokenizers` (BpeTrainer, byte-level, gpt-4o split, `train_bpe_merges`).
Two vocabularies use the layout:

* `build_synthetic_vocab(n)`, for test fixtures: merges trained on the small multilingual corpus
  below, so it tokenizes real text the way a real vocabulary does, only with shorter pieces. The
  corpus supports a few thousand merges; a larger vocabulary gets the rest as fillers. Cached per
  process.
* `build_trained_vocab(texts, n)`, for a trained model: merges learned from the model's own
  training corpus until the BPE region is full.

Both are deterministic for their input. `build_synthetic_vocab(n, family=...)` also lays the
corpus out as Llama 3's or Qwen's vocabulary (family_layout), or as Gemma 3's SentencePiece one
(vocab_gemma3).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import lru_cache

from ane_spec.errors import TokenizerError
from ane_spec.model.byte_bpe import bytes_to_unicode
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE
from ane_spec.model.chat_templates import (
    LLAMA32_CHAT_TEMPLATE,
    QWEN3_CHAT_TEMPLATE,
    QWEN25_CHAT_TEMPLATE,
)
from ane_spec.model.pre_tokenizers import GPT4O_PATTERN
from ane_spec.model.token_types import (
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
)
from ane_spec.model.tokenizer_data import TokenizerData
from ane_spec.model.vocab_gemma3 import gemma3_layout

MIN_VOCAB_SIZE = 512
_FILLER = re.compile(r"\[PAD\d+\]")

#: (offset from the END of the vocabulary, text): `<|endoftext|>` is at vocab_size - 65, etc.
SPECIAL_TOKENS_FROM_END: tuple[tuple[int, str], ...] = (
    (65, "<|endoftext|>"),
    (46, "<|endofprompt|>"),
    (45, "<|assistant|>"),
    (44, "<|end|>"),
    (43, "<|user|>"),
    (42, "<|system|>"),
    (41, "<|tool|>"),
    (40, "<|/tool|>"),
    (39, "<|tool_call|>"),
    (38, "<|/tool_call|>"),
    (37, "<|tool_response|>"),
    (36, "<|tag|>"),
)

#: The BPE region (bytes + merge results) ends before vocab_size - 66, as in the real vocab.
BPE_REGION_END_FROM_END = 66

# Varied on purpose: every branch of the gpt-4o split pattern, multi-byte UTF-8 of every length,
# code indentation, digit runs, contractions in both cases, CRLF, tabs and whitespace runs.
CORPUS = """\
The quick brown fox jumps over the lazy dog. It's a sentence that uses every letter, and it's
been used for typing practice since the late 1800s. They'll say it's old; we'd say it's classic.
I'm sure you've heard it before. DON'T PANIC, IT'S ONLY A TEST. We're fine, aren't we? YOU'LL SEE.
She said: "Well, that's that." He replied -- rather too quickly -- 'No, it isn't!'

Once upon a time, in a small village by the sea, there lived an old fisherman and his daughter.
Every morning they rowed out past the lighthouse, cast their nets, and waited for the tide to turn.
The daughter kept a notebook of the weather: wind from the north-west, 12 knots; clouds at 3,000
feet; water temperature 14.5 degrees. Her father never wrote anything down. "The sea remembers,"
he would say, "so I don't have to." When the storms came in October, the notebook was right and
the sea was not, and after that the whole village asked her before they set sail.

Language models read text as tokens. A tokenizer splits a string into pieces, maps each piece to
an integer id, and the model predicts the next id. Byte-level BPE starts from the 256 possible
bytes and repeatedly merges the most frequent adjacent pair, so any input can be encoded and
nothing is ever unknown. Speculative decoding drafts several tokens with a small model and
verifies them with the large one in a single forward pass; accepted tokens are free.

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    if n <= 0:
        return []
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]


class Cache:
    def __init__(self, capacity: int = 128) -> None:
        self.capacity = capacity
        self._items: dict[str, bytes] = {}

    def get(self, key: str) -> bytes | None:
        return self._items.get(key)

    def put(self, key: str, value: bytes) -> None:
        if len(self._items) >= self.capacity:
            self._items.pop(next(iter(self._items)))
        self._items[key] = value


for i in range(10):
\tprint(f"{i:>3} -> {fibonacci(i)}")

if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))

{"id": 42, "name": "widget", "price": 19.99, "tags": ["a", "b"], "in_stock": true, "qty": null}
SELECT name, COUNT(*) AS n FROM users WHERE age >= 21 GROUP BY name ORDER BY n DESC LIMIT 10;
$ git commit -m "Fix off-by-one in range()" && git push origin main  # 2 files changed
https://example.com/path/to/page?query=value&lang=en#section-2 -- user@example.org

Numbers: 0 1 7 42 123 1234 12345 123456 1234567 3.14159 2.71828 -17 +8 1e-9 6.022e23 0x1F 0b1010
Dates: 2024-01-31, 31/12/1999, 07:45:00, 12:00 PM. Prices: $4.99, EUR 12,50, 1,000,000 units.
Phone: +1 (555) 010-9999. Version 3.11.7, build #20260117. 100% done; 50/50 chance; 3 > 2 < 5.

Français : « Où est la bibliothèque ? » demanda-t-elle. Ça m'étonnerait qu'il soit déjà là.
L'été dernier, nous avons visité Besançon, Nîmes et Saint-Étienne ; c'était génial, très reposant.
Deutsch: Über den Wolken muss die Freiheit wohl grenzenlos sein. Die Straße ist schön und grün.
Größere Häuser kosten mehr. Äpfel, Öl und Übung machen den Meister.
Español: ¿Dónde está el niño? ¡Qué día tan bonito! El señor Muñoz comió piña y jalapeños.
Português: A ação da canção não é fácil; São Paulo e Brasília são cidades. Você já viu o mapa?
Polski: Zażółć gęślą jaźń. Čeština: Příliš žluťoučký kůň úpěl ďábelské ódy.
Tiếng Việt: Tôi yêu tiếng Việt; người Việt Nam rất thân thiện và hiếu khách.
Ελληνικά: Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.
Русский: Съешь же ещё этих мягких французских булок, да выпей чаю. Привет, мир!
Українська: Чуєш їх, доцю, га? Кумедна ж ти, прощайся без ґольфів!
العربية: مرحبا بالعالم، هذه جملة للاختبار.
עברית: שלום עולם, זהו משפט לבדיקה.
हिन्दी: नमस्ते दुनिया, यह एक परीक्षण वाक्य है।
ไทย: สวัสดีชาวโลก นี่คือประโยคทดสอบ

中文：敏捷的棕色狐狸跳过了懒狗。今天天气很好，我们去公园散步吧。机器学习模型需要大量的数据。
日本語：素早い茶色の狐がのろまな犬を飛び越える。今日はいい天気ですね。東京タワーに行きましょう。
カタカナ：コンピューター、プログラム、データベース。ひらがな：あいうえお、かきくけこ。
한국어: 빠른 갈색 여우가 게으른 개를 뛰어넘습니다. 오늘 날씨가 정말 좋네요. 감사합니다!

Emoji: 😀 😃 😄 😁 😆 😅 😂 🤣 🥲 ☺️ 😊 🙂 🙃 😉 👍 👍🏽 👋🏿 🎉 🎂 🚀 ❤️ 🔥 ✨ 🌍 🍕 ☕
Families and flags: 👨‍👩‍👧‍👦 👩‍💻 🏳️‍🌈 🇫🇷 🇯🇵 🇺🇸 🇧🇷 — symbols:
© ® ™ ° ± × ÷ € £ ¥ § ¶ • … ← → ⇒ ∞ ≈ ≠ ≤ ≥ √ ∑ ∫ π Ω µ

Whitespace:    four spaces,\ttab,\t\ttwo tabs,  two  spaces,        eight spaces.
Windows line\r\nendings\r\nhere.
Trailing spaces   
Blank lines follow.



Indented:
        deeply
            nested
                code

Markdown: # Title\n## Subtitle\n- item one\n- item two\n1. first\n2. second\n
**bold** _italic_ `code`
> quoted text, with a [link](http://example.com) and an image ![alt](img.png).
| col A | col B |
|-------|-------|
|   1   |   2   |

Punctuation runs: ... !!! ??? --- *** ### @@@ &&& ((())) [[[]]] {{{}}} <<<>>> /// \\\\ ||| ;;; :::
Math: E = mc^2; a^2 + b^2 = c^2; f(x) = 3x^2 - 2x + 1; d/dx sin(x) = cos(x); sum_{i=1}^{n} i.
Mixed: camelCaseIdentifier snake_case_name SCREAMING_CASE kebab-case PascalCase iPhone eBay
McDonald's O'Neill rock'n'roll y'all ma'am 'tis o'clock DON'T can't WON'T shouldn't've I'd I'll
"""


def train_bpe_merges(texts: Iterable[str], max_tokens: int) -> tuple[tuple[str, str], ...]:
    """Byte-level BPE merges, in rank order, that HF `tokenizers` learns from `texts`.

    The pipeline is Phi-4-mini's: gpt-4o split, then GPT-2 byte-to-unicode. Training stops when
    bytes + merge results reach `max_tokens` or no pair is left. Deterministic for given texts.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(GPT4O_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=max_tokens, min_frequency=0, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    # tokenizers >= 0.20 serialises merges as pairs, older versions as "a b" strings.
    return tuple((m[0], m[1]) if isinstance(m, list) else tuple(m.split(" ", 1))  # type: ignore
                 for m in merges)


@lru_cache(maxsize=4)
def _trained(seed_text: str | None) -> tuple[tuple[str, str], ...]:
    """The merges the small built-in corpus (+ seed_text) supports: training runs until no pair
    is left."""
    text = CORPUS if seed_text is None else CORPUS + "\n" + seed_text
    return train_bpe_merges([text], max_tokens=1_000_000)


def build_synthetic_vocab(vocab_size: int, *, seed_text: str | None = None,
                          family: str = "phi4") -> TokenizerData:
    """A deterministic vocabulary with the layout of `family` at `vocab_size`: byte-level BPE
    for "phi4" (Phi-4-mini's), "llama3" or "qwen2"/"qwen3" (family_layout); SentencePiece for
    "gemma3" (vocab_gemma3, from the same corpus; vocab_size >= GEMMA3_MIN_VOCAB_SIZE)."""
    if family == "gemma3":
        return _gemma3(seed_text, vocab_size)
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"synthetic vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    if family == "phi4":
        return phi4_mini_layout(_trained(seed_text), vocab_size)
    return family_layout(family, _trained(seed_text), vocab_size)


@lru_cache(maxsize=4)
def _gemma3(seed_text: str | None, vocab_size: int) -> TokenizerData:
    return gemma3_layout(CORPUS if seed_text is None else CORPUS + "\n" + seed_text, vocab_size)


# Llama 3: byte-level BPE, then 256 CONTROL tokens; BOS <|begin_of_text|>, instruct EOS <|eot_id|>
# (llama.cpp adds <|end_of_text|>, <|eom_id|> and <|eot_id|> to end-of-generation by name).
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>",
                   "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
# Qwen 2.5 / 3: BPE, then its added tokens, then [PAD] fillers up to the padded embedding size.
# CONTROL are the added tokens marked special in tokenizer_config.json; the tool and think tags
# are not (USER_DEFINED: recognised in any text, as llama.cpp does).
QWEN_SPECIALS = (("<|endoftext|>", TOKEN_CONTROL), ("<|im_start|>", TOKEN_CONTROL),
                 ("<|im_end|>", TOKEN_CONTROL), ("<|object_ref_start|>", TOKEN_CONTROL),
                 ("<|object_ref_end|>", TOKEN_CONTROL), ("<|box_start|>", TOKEN_CONTROL),
                 ("<|box_end|>", TOKEN_CONTROL), ("<|quad_start|>", TOKEN_CONTROL),
                 ("<|quad_end|>", TOKEN_CONTROL), ("<|vision_start|>", TOKEN_CONTROL),
                 ("<|vision_end|>", TOKEN_CONTROL), ("<|vision_pad|>", TOKEN_CONTROL),
                 ("<|image_pad|>", TOKEN_CONTROL), ("<|video_pad|>", TOKEN_CONTROL),
                 ("<tool_call>", TOKEN_USER_DEFINED), ("</tool_call>", TOKEN_USER_DEFINED),
                 ("<|fim_prefix|>", TOKEN_USER_DEFINED), ("<|fim_middle|>", TOKEN_USER_DEFINED),
                 ("<|fim_suffix|>", TOKEN_USER_DEFINED), ("<|fim_pad|>", TOKEN_USER_DEFINED),
                 ("<|repo_name|>", TOKEN_USER_DEFINED), ("<|file_sep|>", TOKEN_USER_DEFINED))
QWEN3_EXTRA = (("<tool_response>", TOKEN_USER_DEFINED), ("</tool_response>", TOKEN_USER_DEFINED),
               ("<think>", TOKEN_USER_DEFINED), ("</think>", TOKEN_USER_DEFINED))

# The released models' own templates, tool sections included (chat_templates.py).
CHAT_TEMPLATES = {"qwen2": QWEN25_CHAT_TEMPLATE, "qwen3": QWEN3_CHAT_TEMPLATE}


def family_layout(family: str, trained_merges: Iterable[tuple[str, str]],
                  vocab_size: int) -> TokenizerData:
    """A Llama 3 ("llama3") or Qwen ("qwen2", "qwen3") vocabulary at `vocab_size`.

    llama3: bytes and merges, fillers, and the last `min(256, vocab_size // 8)` ids its special
    block (the 11 named tokens, then reserved ones), as ids 128000.. are in the real one.
    qwen: bytes and merges, the added tokens right after the BPE region, `[PAD<id>]` fillers
    (UNUSED) to the end, as Qwen's 151936-row files pad past their last added token.
    """
    if family == "llama3":
        block = min(256, vocab_size // 8)
        specials = [(t, TOKEN_CONTROL) for t in LLAMA3_SPECIALS]
        specials += [(f"<|reserved_special_token_{k}|>", TOKEN_CONTROL)
                     for k in range(3, 3 + block - len(specials))]
        first_special = vocab_size - block
    elif family in ("qwen2", "qwen3"):
        specials = list(QWEN_SPECIALS + (QWEN3_EXTRA if family == "qwen3" else ()))
        first_special = vocab_size - 64 - len(specials)
    else:
        raise TokenizerError(f"unknown vocabulary family {family!r}")
    tokens, merges = _bpe_region(trained_merges, first_special,
                                 reserved={t for t, _ in specials})
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TOKEN_UNUSED] * (vocab_size - len(types))
    for k, (text, kind) in enumerate(specials):
        tokens[first_special + k] = text
        types[first_special + k] = kind
    ids = {t: i for i, t in enumerate(tokens)}
    if family == "llama3":
        return TokenizerData(
            model="gpt2", pre="llama-bpe", tokens=tokens, token_types=types, merges=merges,
            bos_token_id=ids["<|begin_of_text|>"], eos_token_id=ids["<|eot_id|>"],
            unknown_token_id=None, padding_token_id=None, add_bos_token=True,
            chat_template=LLAMA32_CHAT_TEMPLATE)
    return TokenizerData(
        model="gpt2", pre="qwen2", tokens=tokens, token_types=types, merges=merges,
        bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"], unknown_token_id=None,
        padding_token_id=ids["<|endoftext|>"], add_bos_token=False, chat_template=CHAT_TEMPLATES[family])


def build_trained_vocab(texts: Iterable[str], vocab_size: int) -> TokenizerData:
    """A byte-level BPE trained on `texts`, filling Phi-4-mini's layout at `vocab_size`."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise TokenizerError(f"vocab_size must be >= {MIN_VOCAB_SIZE}, got {vocab_size}")
    return phi4_mini_layout(train_bpe_merges(texts, vocab_size - BPE_REGION_END_FROM_END),
                            vocab_size)


def phi4_mini_layout(trained_merges: Iterable[tuple[str, str]], vocab_size: int) -> TokenizerData:
    """Phi-4-mini's vocabulary layout at `vocab_size`, its BPE region filled from `trained_merges`.

    Bytes, then merge results in rank order up to the BPE region's end, then `[PAD<id>]` fillers,
    with the special tokens at their offsets from the end (see the module docstring).
    """
    tokens, merges = _bpe_region(trained_merges, vocab_size - BPE_REGION_END_FROM_END,
                                 reserved={text for _, text in SPECIAL_TOKENS_FROM_END})
    types = [TOKEN_NORMAL] * len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [TOKEN_UNUSED] * (vocab_size - len(types))
    for offset, text in SPECIAL_TOKENS_FROM_END:
        tokens[vocab_size - offset] = text
        types[vocab_size - offset] = TOKEN_CONTROL
    eot = vocab_size - 65
    return TokenizerData(
        model="gpt2", pre="gpt-4o", tokens=tokens, token_types=types, merges=merges,
        bos_token_id=eot, eos_token_id=eot, unknown_token_id=eot, padding_token_id=eot,
        add_bos_token=False, add_eos_token=False, chat_template=PHI4_MINI_CHAT_TEMPLATE)


def _bpe_region(trained_merges: Iterable[tuple[str, str]], bpe_cap: int,
                reserved: set[str]) -> tuple[list[str], list[str]]:
    """The 256 byte tokens then merge results in rank order, at most `bpe_cap` tokens, and the
    merges that made them."""
    tokens: list[str] = list(bytes_to_unicode().values())
    known = set(tokens)
    merges: list[str] = []
    for a, b in trained_merges:
        result = a + b
        # Skip a merge whose result would clash with a special or filler name (possible only with
        # a seed_text spelling one), and any later merge built on a skipped one.
        if a not in known or b not in known or result in reserved or _FILLER.fullmatch(result):
            continue
        # The trainer may reach one string by two different merges; the token appears once.
        if result not in known:
            if len(tokens) >= bpe_cap:
                break
            known.add(result)
            tokens.append(result)
        merges.append(f"{a} {b}")
    return tokens, merges
