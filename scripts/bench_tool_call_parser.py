"""The tool-call parsers' time on long whitespace runs, every family's forms (issue 36).

    python scripts/bench_tool_call_parser.py [--kib 64] [--piece 4] [--timeout 20] [--json]

A model's indentation (or a `logit_bias` pushing for spaces) with tools in the request puts
long whitespace runs through the parser, on the server's event loop. For each family's parser
(Hermes/Qwen and Llama 3: `call_forms.FormParser`; Phi-4-mini: `tools.ToolCallParser`) and
each place a run can sit (plain text, right after each kind of opening, inside a call's header,
after a whole call), it feeds `--kib` KiB of whitespace then `x`, whole and in `--piece`-char
pieces, and prints the seconds (parse and `finish`). Each case runs in its own process with a
`--timeout`; a case past it prints `> TIMEOUT` (with `--json`, one object per case a line,
null for a case past it: tests/test_tool_call_forms.py reads those).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time

WS = " \n\t  \n    "  # indentation-like: spaces, newlines and a tab


def cases() -> dict[str, dict[str, str]]:
    """family -> case name -> the text before the whitespace run."""
    return {
        "hermes": {
            "text": "",
            "<tool_call>": "<tool_call>",
            "```json fence": "```json\n",
            "{ (bare object)": "{",
            "header after {\"name\"": '<tool_call>{"name"',
            "name string": '{"name": "',
            "<function=": "<function=",
            "<function name=\"": '<function name="',
            "inside the arguments": '<tool_call>{"name": "f", "arguments": {',
            "after a whole call": '<tool_call>{"name": "f", "arguments": {}}',
        },
        "llama3": {
            "text": "",
            "{": "{",
            "{\"type\": \"function\",": '{"type": "function",',
            "header after {\"name\"": '{"name"',
            "name string": '{"name": "',
            "inside the arguments": '{"name": "f", "parameters": {',
        },
        "phi4": {
            "text": "",
            "<|tool_call|>": "<|tool_call|>",
            "<|tool_call|>[": "<|tool_call|>[",
            "header after {\"name\"": '<|tool_call|>[{"name"',
            "inside the arguments": '<|tool_call|>[{"name": "f", "arguments": {',
            "before the call's }": '<|tool_call|>[{"name": "f", "arguments": {}',
        },
    }


def parser(family: str):  # noqa: ANN201
    from ane_spec.daemon.call_forms import HERMES_FORMS, LLAMA3_FORMS, FormParser
    from ane_spec.daemon.tools import PHI4_SYNTAX, ToolCallParser

    if family == "phi4":
        return ToolCallParser(PHI4_SYNTAX)
    return FormParser(HERMES_FORMS if family == "hermes" else LLAMA3_FORMS)


def run(family: str, text: str, piece: int, out: mp.Queue) -> None:
    p = parser(family)
    t0 = time.perf_counter()
    if piece:
        for i in range(0, len(text), piece):
            p.feed(text[i:i + piece])
    else:
        p.feed(text)
    p.finish()
    out.put(time.perf_counter() - t0)


def timed(family: str, text: str, piece: int, timeout: float) -> float | None:
    """Seconds, or None past `timeout` (the parse runs in a child process killed then)."""
    out: mp.Queue = mp.Queue()
    proc = mp.Process(target=run, args=(family, text, piece, out))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return None
    return out.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=64, help="KiB of whitespace (default 64)")
    ap.add_argument("--piece", type=int, default=4, help="characters per streamed piece")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per case")
    ap.add_argument("--json", action="store_true", help="a JSON object per case a line")
    args = ap.parse_args()
    run_ = (WS * (args.kib * 1024 // len(WS) + 1))[:args.kib * 1024]
    if not args.json:
        print(f"{args.kib} KiB of whitespace then 'x'; whole, and in {args.piece}-char pieces")
        print(f"| family | before the run | whole | {args.piece}-char pieces |")
        print("|---|---|---|---|")

    def cell(seconds: float | None) -> str:
        return f"> {args.timeout:g} s" if seconds is None else f"{seconds:.4f} s"

    for family, openings in cases().items():
        for name, opening in openings.items():
            text = opening + run_ + "x"
            whole = timed(family, text, 0, args.timeout)
            pieces = timed(family, text, args.piece, args.timeout)
            if args.json:
                print(json.dumps({"family": family, "case": name, "whole": whole,
                                  "pieces": pieces}), flush=True)
            else:
                print(f"| {family} | {name} | {cell(whole)} | {cell(pieces)} |", flush=True)


if __name__ == "__main__":
    main()
