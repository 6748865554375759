"""What compiling client grammars in a child process first costs per request.

    python scripts/bench_grammar_compiler.py [--vocab 200064] [--runs 5]

For three kinds of grammar a server sees (a response_format JSON schema, the tool-call grammar
of two tools, a small GBNF), each made unique per run so that no cache helps, it times:

- in_process: `Grammar(tokenizer, spec)` on the calling thread, what the server did before;
- isolated_new: `GrammarCompiler.compile` of a grammar it has not seen (limits, the warm child's
  conversion and compile, the copy back, then the same compile here on a big-stack thread);
- isolated_cached: the same request again (an agent resending its tools every turn);

and, once, the child's start (a new Python process building its tokenizer), paid on the first
constrained request and after a crash or a timeout. The vocabulary is Phi-4-mini's size, from
the synthetic builder (mostly fillers: token-table costs are real, mask costs flattered).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from ane_spec.daemon.protocol import Tool
from ane_spec.daemon.tools import tool_call_grammar
from ane_spec.decode.grammar import Grammar, grammar_tokenizer
from ane_spec.decode.grammar_compiler import GrammarCompiler, grammar_spec
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab


def schema(k: int) -> dict:
    return {"type": "object", "properties": {
        f"name{k}": {"type": "string", "maxLength": 40}, "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}},
                    "required": ["city"]}}, "required": [f"name{k}", "age"]}


def tools(k: int) -> str:
    specs = [Tool.model_validate({"type": "function", "function": {
        "name": f"get_weather{k}", "parameters": schema(k)}}),
        Tool.model_validate({"type": "function", "function": {"name": "now"}})]
    return tool_call_grammar(specs, "auto", None)


def gbnf(k: int) -> str:
    return (f'root ::= "answer{k}: " item ("," item)*\nitem ::= [a-z]+ | number\n'
            'number ::= [0-9]+ ("." [0-9]+)?')


KINDS = {"json_schema": schema, "lark": tools, "gbnf": gbnf}


def ms(samples: list[float]) -> dict[str, float]:
    return {"median_ms": round(1000 * statistics.median(samples), 2),
            "max_ms": round(1000 * max(samples), 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=200064)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    tok = Tokenizer(build_synthetic_vocab(args.vocab))
    grammar_tokenizer(tok)
    report: dict = {"vocab": args.vocab, "tokenizer_setup_s": round(time.perf_counter() - t0, 2)}
    compiler = GrammarCompiler(tok)
    try:
        t0 = time.perf_counter()
        compiler.start()
        report["child_start_s"] = round(time.perf_counter() - t0, 2)
        for kind, make in KINDS.items():
            before, new, cached = [], [], []
            for k in range(args.runs):
                source = make(k)
                t0 = time.perf_counter()
                Grammar(tok, grammar_spec(kind, source))
                before.append(time.perf_counter() - t0)
                source = make(1000 + k)  # one the compiler has not seen
                t0 = time.perf_counter()
                compiler.compile(kind, source, kind)
                new.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                compiler.compile(kind, source, kind)
                cached.append(time.perf_counter() - t0)
            report[kind] = {"in_process": ms(before), "isolated_new": ms(new),
                            "isolated_cached": ms(cached),
                            "added_per_new_grammar_ms": round(
                                1000 * (statistics.median(new) - statistics.median(before)), 2)}
        report["compiler_stats"] = compiler.stats
    finally:
        compiler.close()
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
