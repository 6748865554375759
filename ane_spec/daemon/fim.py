"""Fill-in-the-middle prompts, built in one place for every route that asks for one:
llama-server's `/infill`, OpenAI's `suffix` on `/v1/completions` and Ollama's `suffix` on
`/api/generate`.

The vocabulary's FIM tokens are found as llama.cpp finds them (llama-vocab.cpp): the GGUF's
`tokenizer.ggml.fim_*_token_id` keys, else the first of the known texts of each kind
(`<|fim_prefix|>` for Qwen, `<fim_prefix>` for StarCoder, `<PRE>` for CodeLlama, ...). The prompt
is llama-server's prefix-suffix-middle order (format_prompt_infill, `spm_infill` off), which is
also what Ollama's FIM templates render (`<|fim_prefix|>{{ .Prompt }}<|fim_suffix|>{{ .Suffix
}}<|fim_middle|>` for Qwen 2.5 Coder).
"""

from __future__ import annotations

from collections.abc import Sequence

from ane_spec.model.end_of_generation import FIM_KIND_TEXTS
from ane_spec.model.tokenizer import Tokenizer


def fim_token(tok: Tokenizer, kind: str) -> int | None:
    """The vocabulary's FIM token of `kind` ("pre", "suf", "mid", "pad", "rep", "sep")."""
    given = tok.data.fim_token_ids.get(kind)
    if given is not None:
        return given
    found = [i for i in (tok.id_of(t) for t in FIM_KIND_TEXTS[kind]) if i is not None]
    return min(found) if found else None


def fim_tokens(tok: Tokenizer) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) FIM tokens, or None when the vocabulary lacks any."""
    ids = tuple(fim_token(tok, kind) for kind in ("pre", "suf", "mid"))
    return None if None in ids else ids  # type: ignore[return-value]


def fim_prompt(tok: Tokenizer, fim: tuple[int, int, int], prefix: Sequence[int],
               suffix: Sequence[int], before: Sequence[int] = ()) -> list[int]:
    """`before` (llama-server's input_extra), [BOS], <PRE> prefix <SUF> suffix <MID>: the
    model writes what goes between prefix and suffix."""
    pre, suf, mid = fim
    bos = [tok.bos_token_id] if tok.data.add_bos_token and tok.bos_token_id is not None else []
    return [*before, *bos, pre, *prefix, suf, *suffix, mid]
