"""Constrained decoding: a grammar (JSON schema or Lark) as a token mask per verified row.

The engine is llguidance (what llama.cpp uses): one 3 MB wheel with no dependencies, an Earley
parser over a token trie that computes a 200k-token mask in tens of microseconds, and a matcher
that advances one committed token at a time. scripts/bench_grammar_engines.py compares it with
xgrammar on this tokenizer; docs of the choice are in the README.

The trie is built from `Tokenizer.token_bytes`, with CONTROL tokens (and `<|...|>`-looking
user-defined ones) marked special, so a grammar can name `<|tool_call|>` while plain text can
never spell it. When a grammar forces bytes (a JSON key, a closing `"}`), llguidance allows only
the first token of the *canonical* tokenization of those bytes, which it asks this project's
tokenizer for: forced text is therefore tokenized exactly as llama.cpp would tokenize it.

Exactness: a `GrammarState` follows the committed tokens only. Verification reads row i with
the state after the pending token and drafts 0..i-1, which are exactly the tokens plain decoding
would have committed before that row; a draft the grammar forbids has probability 0 under the
masked row and is rejected like any other.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import numpy as np

from ane_spec.decode.json_tightening import tighten
from ane_spec.decode.work_clock import timed
from ane_spec.errors import AneSpecError
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.runtime.row_keys import EXCLUDED

# Compact JSON with at most one space after ',' and ':' (the shape json.dumps writes, which is
# what Phi-4-mini saw in training), and none elsewhere: a weak model cannot wander into
# whitespace runs that eat the token budget.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ?",
                                "key_separator": ": ?"}


# Up to this many non-zero mask words (16,384 candidate tokens), a masked argmax gathers the
# allowed tokens' logits instead of masking the whole row.
SPARSE_MASK_WORDS = 512


class GrammarError(AneSpecError):
    """A response format, schema or grammar cannot be compiled into a token mask."""


def _llguidance():  # noqa: ANN202 - the module
    try:
        import llguidance
    except ImportError:  # a hard dependency; only a broken install gets here
        raise GrammarError("constrained decoding needs llguidance: pip install "
                           "'llguidance>=1.9'") from None
    return llguidance


class _TokenTable:
    """What llguidance's LLTokenizer reads from a tokenizer (its TokenizerWrapper protocol)."""

    is_tokenizer_wrapper = True

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
        self.special_token_ids = sorted(tok.markup_ids)
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text)


@lru_cache(maxsize=4)
def grammar_tokenizer(tok: Tokenizer):  # noqa: ANN201 - llguidance.LLTokenizer
    """llguidance's view of `tok` (built once per tokenizer: ~1 s at 200k tokens)."""
    llg = _llguidance()
    eog = sorted(tok.eog_ids)
    return llg.LLTokenizer(_TokenTable(tok), n_vocab=tok.vocab_size, eos_token=eog or None)


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """A grammar for JSON matching `schema`, or for any JSON object when it is None, as tight
    as llama.cpp's (json_tightening.py)."""
    llg = _llguidance()
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            tighten({"type": "object"} if schema is None else schema), overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"the JSON schema cannot be used: {exc}") from None


def lark_grammar(lark: str) -> str:
    return _llguidance().LLMatcher.grammar_from_lark(lark)


def gbnf_grammar(gbnf: str) -> str:
    """A llama.cpp GBNF grammar (llama-server's `grammar` parameter), via llguidance's
    converter."""
    try:
        return _llguidance().grammar_from("gbnf", gbnf)
    except Exception as exc:  # the converter raises its own error types and ValueError
        raise GrammarError(f"the GBNF grammar does not parse: {_first_line(str(exc))}") from None


class Grammar:
    """A checked grammar for one tokenizer; `start()` gives a fresh state per generation."""

    def __init__(self, tok: Tokenizer, grammar: str, *, what: str = "the grammar"):
        llg = _llguidance()
        self.tokenizer = tok
        self.lltok = grammar_tokenizer(tok)
        self.spec = grammar
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.lltok)
        if is_error:
            raise GrammarError(f"{what} cannot be compiled: {_first_line(messages[0])}")
        # Compiled once; every generation starts from a copy (much cheaper than a compile).
        self._initial = llg.LLMatcher(self.lltok, grammar, log_level=0)
        if self._initial.is_error():
            raise GrammarError(f"{what} cannot be compiled: "
                               f"{_first_line(self._initial.get_error())}")

    def start(self) -> "GrammarState":
        return GrammarState(self, self._initial.deep_copy())


class GrammarState:
    """The grammar after the tokens committed so far; `mask()` is cached until `advance`."""

    def __init__(self, grammar: Grammar, matcher: Any):
        self.vocab = grammar.tokenizer.vocab_size
        self._matcher = matcher
        self._bits = np.zeros((self.vocab + 31) // 32, dtype=np.int32)
        self._mask: np.ndarray | None = None
        self._fresh = False
        # This thread's CPU time in the matcher (masks, advances, forced tokens), less garbage
        # collections that ran meanwhile (work_clock.py): what the session's grammar cost guard
        # reads.
        self.cpu_seconds = 0.0

    def _compute(self) -> None:
        if not self._fresh:
            _, took = timed(self._matcher.unsafe_compute_mask_ptr, self._bits.ctypes.data,
                            self._bits.nbytes)
            self.cpu_seconds += took
            self._mask = None
            self._fresh = True

    def allows(self, token: int) -> bool:
        """One bit test: the common greedy case needs no [V] array at all."""
        self._compute()
        return bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def mask(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next."""
        self._compute()
        if self._mask is None:
            self._mask = np.unpackbits(self._bits.view(np.uint8), count=self.vocab,
                                       bitorder="little").view(bool)
        return self._mask

    def apply(self, logits: np.ndarray) -> np.ndarray:
        """Forbidden tokens' logits set to -inf, in place (the caller owns `logits`)."""
        np.copyto(logits[: self.vocab], -np.inf, where=~self.mask())
        logits[self.vocab:] = -np.inf
        return logits

    def allows_ids(self, ids: np.ndarray) -> np.ndarray:
        """bool per id: whether the grammar allows it next (ids past its vocabulary: never).
        Bit tests on the packed mask: no [V] array."""
        self._compute()
        inside = ids < self.vocab
        at = ids[inside]
        allowed = np.zeros(len(ids), dtype=bool)
        allowed[inside] = (self._bits[at >> 5] >> (at & 31)) & 1
        return allowed

    def allowed_ids(self, most_words: int | None = None) -> np.ndarray | None:
        """The allowed token ids in increasing order, when they sit in at most `most_words` of
        the mask's 32-bit words (else None): read from those words alone, without a [V] array.
        Structural JSON positions allow a few dozen tokens; inside a string nearly all are."""
        self._compute()
        words = np.flatnonzero(self._bits)
        if len(words) > (SPARSE_MASK_WORDS if most_words is None else most_words):
            return None
        bits = np.unpackbits(self._bits[words].view(np.uint8), bitorder="little").view(bool)
        ids = (words[:, None] * 32 + np.arange(32)).ravel()[bits]
        return ids[ids < self.vocab]

    def exclude(self, keys: np.ndarray) -> np.ndarray:
        """Forbidden tokens' `row_keys` keys set to EXCLUDED (0), in place: the key row's
        counterpart of `apply`, one integer multiply by the 0/1 mask."""
        allowed = self.mask().view(np.uint8)
        np.multiply(keys[: self.vocab], allowed, out=keys[: self.vocab])
        keys[self.vocab:] = EXCLUDED
        return keys

    def advance(self, token: int) -> None:
        accepted, took = timed(self._matcher.consume_token, int(token))
        self.cpu_seconds += took
        if not accepted:
            raise GrammarError(f"token {token} is not allowed here: "
                               f"{_first_line(self._matcher.get_error())}")
        self._fresh = False

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next (empty when it leaves a choice)."""
        forced, took = timed(self._matcher.compute_ff_tokens)
        self.cpu_seconds += took
        return list(forced)

    @property
    def accepting(self) -> bool:
        return self._matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        return self._matcher.is_stopped()


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"

