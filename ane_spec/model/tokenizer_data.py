"""The tokenizer as a GGUF stores it (`tokenizer.ggml.*`, `tokenizer.chat_template`), checked
as llama.cpp would load it: `TokenizerData`, what the GGUF reader gives, a build writes into
its folder and the `Tokenizer` (tokenizer.py) is made from."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from ane_spec.errors import TokenizerError, untrusted
from ane_spec.model.byte_bpe import check_merges
from ane_spec.model.end_of_generation import FIM_KIND_TEXTS
from ane_spec.model.pre_tokenizers import PRE_TOKENIZERS
from ane_spec.model.token_types import KNOWN_TYPES

#: `tokenizer.ggml.model` values: byte-level BPE, SentencePiece, and Gemma 4's BPE (always read
#: with the `gemma4` pre-tokenizer).
TOKENIZER_MODELS = ("gpt2", "llama", "gemma4")

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


def jina_mask_rule(pre: str) -> bool:
    """Whether llama.cpp's jina-v2 <mask> LSTRIP rule applies (it goes by the pre-tokenizer's
    name, before any rule by general.name)."""
    return any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code"))


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
        bad = sorted(set(self.token_types) - KNOWN_TYPES)
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
            check_merges(self.merges, frozenset(texts))
        if self.strip_rule == "phi3" and not jina_mask_rule(self.pre):
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
