"""Gemma 3-layout SentencePiece vocabularies: real score-driven pieces, real layout, any size.

`gemma3_layout(corpus, n)` lays a SentencePiece-BPE vocabulary learned from `corpus` out the way
llama.cpp sees Gemma 3's 262144-entry vocabulary after convert_hf_to_gguf (Gemma3Model.set_vocab:
`_set_vocab_sentencepiece`, then add_space_prefix false; `tokenizer.ggml.model = "llama"`):

    0 <pad>  1 <eos>  2 <bos>  3 <unk>  4 <mask>        CONTROL
    5 [multimodal]                                      USER_DEFINED
    6..104 <unused0>..<unused98>                        CONTROL (convert: "looks special")
    105 <start_of_turn>  106 <end_of_turn>              CONTROL (special in tokenizer_config)
    107..137 "\\n" x 1..31                               USER_DEFINED
    138..167 " " x 2..31                                USER_DEFINED (convert turns their ▁ into
                                                        spaces: "pre-normalize user-defined spaces")
    168..237 HTML tags <table> .. </footer>             USER_DEFINED
    238..493 <0x00>..<0xFF>                             BYTE (byte fallback)
    494..                                               NORMAL pieces: merge results in rank
                                                        order, then the single characters
    ...                                                 [PAD<id>] fillers, UNUSED
    n - tail: <start_of_image> <end_of_image>           CONTROL (255999 and 256000 in the real
    then <unused99>.. to the end                        one; tail = 6145 ids at n = 262144,
                                                        scaled with n)

Ids 0..493 match llama.cpp's ggml-vocab-gemma-4.gguf (same SentencePiece lineage; Gemma 4 renames
the turn tokens to `<|turn>` `<turn|>` and puts tool tokens among the unused ones). Gemma 3's own
tokenizer has `<start_of_turn>` = 105 and `<end_of_turn>` = 106.

Scores: llama.cpp's SPM tokenizer merges the adjacent pair whose concatenation is a token with
the highest `tokenizer.ggml.scores`; SentencePiece BPE gives a piece the score -(its merge rank),
so merge results score -rank here, single characters below every merge, added tokens -1000
(what convert_hf_to_gguf writes for them), BYTE 0 and fillers -10000 (convert's defaults).

Pieces are learned as SentencePiece does for Gemma: words are `▁`-prefixed (split at spaces,
never across them), digits are single pieces (split_digits), newlines are left to the
USER_DEFINED tokens. Only characters seen at least twice in the corpus get a piece (as
SentencePiece's character_coverage drops rare ones); every other character goes through byte
fallback, as CJK and emoji often do in small SentencePiece vocabularies. Deterministic for its
input.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from ane_spec.errors import TokenizerError
from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE
from ane_spec.model.spm import ESCAPED_SPACE
from ane_spec.model.token_types import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
)
from ane_spec.model.tokenizer_data import TokenizerData

HEAD_CONTROL = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")
START_OF_TURN_ID, END_OF_TURN_ID = 105, 106
HTML_TAGS = (
    "<table>", "<caption>", "<thead>", "<tbody>", "<tfoot>", "<tr>", "<th>", "<td>",
    "</table>", "</caption>", "</thead>", "</tbody>", "</tfoot>", "</tr>", "</th>", "</td>",
    "<h1>", "<h2>", "<h3>", "<h4>", "<h5>", "<h6>", "<blockquote>",
    "</h1>", "</h2>", "</h3>", "</h4>", "</h5>", "</h6>", "</blockquote>",
    "<strong>", "<em>", "<b>", "<i>", "<u>", "<s>", "<sub>", "<sup>", "<code>",
    "</strong>", "</em>", "</b>", "</i>", "</u>", "</s>", "</sub>", "</sup>", "</code>",
    "<a>", "<html>", "<body>", "<img>", "<span>", "<bbox>", "<ul>", "<li>", "<div>", "<iframe>",
    "<footer>", "</a>", "</html>", "</body>", "</img>", "</span>", "</bbox>", "</ul>", "</li>",
    "</div>", "</iframe>", "</footer>",
)
FIRST_BYTE_ID = 238
FIRST_PIECE_ID = FIRST_BYTE_ID + 256  # 494
REAL_VOCAB_SIZE, REAL_TAIL = 262144, 262144 - 255999  # <start_of_image> at 255999
MIN_CHAR_COUNT = 2
GEMMA3_MIN_VOCAB_SIZE = 1024

ADDED_SCORE, BYTE_SCORE, FILLER_SCORE = -1000.0, 0.0, -10000.0
_FILLER = re.compile(r"\[PAD\d+\]")
# Cut a word before every ▁ and around every digit; newlines (and rare characters, replaced by
# one) end a word and belong to no piece.
_WORD = re.compile(rf"\d|{ESCAPED_SPACE}?[^{ESCAPED_SPACE}\d\n]+|{ESCAPED_SPACE}")


def head_tokens() -> list[tuple[str, int]]:
    """Ids 0..493: (text, type)."""
    head = [(t, TOKEN_CONTROL) for t in HEAD_CONTROL] + [("[multimodal]", TOKEN_USER_DEFINED)]
    head += [(f"<unused{k}>", TOKEN_CONTROL) for k in range(START_OF_TURN_ID - len(head))]
    head += [("<start_of_turn>", TOKEN_CONTROL), ("<end_of_turn>", TOKEN_CONTROL)]
    head += [("\n" * k, TOKEN_USER_DEFINED) for k in range(1, 32)]
    head += [(" " * k, TOKEN_USER_DEFINED) for k in range(2, 32)]
    head += [(t, TOKEN_USER_DEFINED) for t in HTML_TAGS]
    assert len(head) == FIRST_BYTE_ID, len(head)
    head += [(f"<0x{b:02X}>", TOKEN_BYTE) for b in range(256)]
    return head


def tail_size(vocab_size: int) -> int:
    """How many ids the `<start_of_image>`.. tail takes: Gemma 3's 6145 at its real size."""
    return max(2, round(vocab_size * REAL_TAIL / REAL_VOCAB_SIZE))


def corpus_alphabet(corpus: str) -> list[str]:
    """The characters that get a piece of their own: seen MIN_CHAR_COUNT times (spaces as ▁,
    newlines never), most frequent first, ties by code point."""
    counts = Counter(corpus.replace(" ", ESCAPED_SPACE).replace("\n", ""))
    kept = [c for c, k in counts.items() if k >= MIN_CHAR_COUNT]
    return sorted(kept, key=lambda c: (-counts[c], c))


def train_spm_pieces(corpus: str, alphabet: list[str]) -> list[str]:
    """SentencePiece-BPE merge results in rank order (HF `tokenizers` BpeTrainer over the
    corpus's ▁-prefixed words; a character outside `alphabet` breaks a word)."""
    from tokenizers import Tokenizer, models, trainers

    keep = set(alphabet)
    text = "".join(c if c in keep else "\n" for c in corpus.replace(" ", ESCAPED_SPACE))
    words = _WORD.findall(text)
    tok = Tokenizer(models.BPE())  # no pre-tokenizer: each iterator item is one word
    trainer = trainers.BpeTrainer(vocab_size=1_000_000, min_frequency=0, show_progress=False,
                                  special_tokens=[], initial_alphabet=alphabet)
    tok.train_from_iterator(words, trainer=trainer)
    merges = json.loads(tok.to_str())["model"]["merges"]
    # tokenizers >= 0.20 serialises merges as pairs, older versions as "a b" strings.
    pairs = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in merges]
    return [a + b for a, b in pairs]


def gemma3_layout(corpus: str, vocab_size: int) -> TokenizerData:
    """A Gemma 3-layout vocabulary of `vocab_size` entries learned from `corpus` (see the
    module docstring)."""
    if vocab_size < GEMMA3_MIN_VOCAB_SIZE:
        raise TokenizerError(f"a gemma3 vocabulary needs vocab_size >= {GEMMA3_MIN_VOCAB_SIZE} "
                             f"(494 fixed ids, the corpus's characters and the image tail), "
                             f"got {vocab_size}")
    head = head_tokens()
    tail_start = vocab_size - tail_size(vocab_size)
    alphabet = corpus_alphabet(corpus)
    room = tail_start - FIRST_PIECE_ID - len(alphabet)
    if room < 0:
        raise TokenizerError(f"vocab_size {vocab_size} leaves no room for the corpus's "
                             f"{len(alphabet)} characters")
    tail = ["<start_of_image>", "<end_of_image>"]
    tail += [f"<unused{99 + k}>" for k in range(vocab_size - tail_start - 2)]
    taken = {t for t, _ in head} | set(alphabet) | set(tail)
    merged: list[str] = []
    for piece in train_spm_pieces(corpus, alphabet):
        # The trainer can reach one string by two merges, and a piece could spell a fixed
        # token (an HTML tag) or a filler's name; each text is one token.
        if piece not in taken and not _FILLER.fullmatch(piece) and len(merged) < room:
            taken.add(piece)
            merged.append(piece)
    pieces = merged + alphabet
    tokens = [t for t, _ in head] + pieces
    types = [k for _, k in head] + [TOKEN_NORMAL] * len(pieces)
    scores = [BYTE_SCORE if k == TOKEN_BYTE else ADDED_SCORE for _, k in head]
    scores += [-float(r) for r in range(len(pieces))]  # merges by rank, then characters
    n_fill = tail_start - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), tail_start)]
    types += [TOKEN_UNUSED] * n_fill
    scores += [FILLER_SCORE] * n_fill
    tokens += tail
    types += [TOKEN_CONTROL] * len(tail)
    scores += [ADDED_SCORE] * len(tail)
    return TokenizerData(
        model="llama", pre="default", tokens=tokens, token_types=types, merges=[],
        scores=scores, bos_token_id=2, eos_token_id=1, unknown_token_id=3, padding_token_id=0,
        add_bos_token=True, add_eos_token=False, add_space_prefix=False,
        chat_template=GEMMA3_CHAT_TEMPLATE)
