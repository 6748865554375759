"""Drafter replay on a real model's own chat output: the honest speed-up figure for a Mac.

    python scripts/real_drafting.py [MODEL] [--out streams.jsonl] [--new-tokens 160]
    ane-spec bench-drafter --streams streams.jsonl      # (the script prints the same table)

MODEL is a path, a catalog name or `ollama:NAME` (default: qwen2.5-coder-0.5b-instruct). Four
task kinds, each a handful of chat prompts rendered with the model's own template:

- fresh-code: write a small function from a description;
- edit-code: a given stdlib function, to be changed (type hints, a rename, a docstring);
- answer-text: a given stdlib module docstring, and a question about it;
- multi-turn: a conversation whose later turns build on the model's own earlier answer.

Each reply is the model's plain greedy continuation, computed by the reference forward pass
(equal to llama.cpp's and the shards' greedy tokens up to near ties); the replay then counts how
many tokens the n-gram drafter + T=4 verification would emit per pass on exactly those tokens.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from pathlib import Path

from ane_spec.bench.drafter_bench import format_side_by_side, run_drafter_bench
from ane_spec.bench.streams import Stream, save_streams
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.model.chat import render_chat
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.resolve import resolve_model
from ane_spec.model.tokenizer import Tokenizer


def _source(obj: object) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def tasks() -> dict[str, list[list[dict]]]:
    import json as json_mod
    import shlex
    import textwrap as textwrap_mod

    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    fresh = [user(t) for t in (
        "Write a Python function that merges two sorted lists into one sorted list.",
        "Write a Python class for a fixed-size ring buffer with push and pop.",
        "Write a Python function that parses a duration like '1h30m' into seconds.",
        "Write a Python function that returns the longest common prefix of a list of strings.",
    )]
    edit = [user(f"{ask}\n\n```python\n{_source(fn)}```") for ask, fn in (
        ("Add type hints to this function and return the whole function.", shlex.quote),
        ("Rename the variable `lines` to `rows` and return the whole function.",
         textwrap_mod.indent),
        ("Add a docstring example to this function and return the whole function.",
         json_mod.dumps),
        ("Rewrite this function to use f-strings where it formats text; return all of it.",
         textwrap_mod.shorten),
    )]
    answer = [user(f"{doc}\n\n{question}") for doc, question in (
        (json_mod.__doc__, "Summarize what this module offers, naming its main functions."),
        (shlex.__doc__, "What is this module for? Answer in two sentences."),
        (textwrap_mod.__doc__, "Which functions does this module provide?"),
        (inspect.__doc__, "List the kinds of things this module can tell about an object."),
    )]
    multi = [
        [{"role": "user", "content": "Write a Python function `word_counts(text)` that counts "
                                     "words in a text."},
         {"role": "assistant", "content": None},
         {"role": "user", "content": "Now make it ignore case and punctuation."}],
        [{"role": "user", "content": "Write a Python dataclass for a 2D point with a distance "
                                     "method."},
         {"role": "assistant", "content": None},
         {"role": "user", "content": "Add a method that returns the midpoint with another point."}],
        [{"role": "user", "content": "Write a function that reads a CSV file into a list of "
                                     "dicts."},
         {"role": "assistant", "content": None},
         {"role": "user", "content": "Change it to skip rows whose 'id' column is empty."}],
    ]
    return {"fresh-code": fresh, "edit-code": edit, "answer-text": answer, "multi-turn": multi}


def make_streams(gguf: Path, new_tokens: int) -> list[Stream]:
    m = open_gguf(gguf)
    tok = Tokenizer.from_data(m.tokenizer_data)
    template = tok.data.chat_template
    ref = ReferenceModel(m, context_window=2048)

    def reply(messages: list[dict]) -> tuple[list[int], list[int]]:
        text = render_chat(messages, template=template)
        prompt = tok.encode(text, special=True)
        return prompt, ref.generate(prompt, new_tokens, tok.eog_ids)

    streams = []
    for family, chats in tasks().items():
        for chat in chats:
            if any(t["content"] is None for t in chat):  # multi-turn: the model's own answer
                first = chat[:1]
                _, out = reply(first)
                answer = tok.decode([t for t in out if t not in tok.eog_ids])
                chat = first + [{"role": "assistant", "content": answer}] + chat[2:]
            prompt, out = reply(chat)
            streams.append(Stream(family, tuple(prompt), tuple(out)))
            print(f"{family}: {len(prompt)} prompt + {len(out)} reply tokens", file=sys.stderr,
                  flush=True)
    return streams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--out", default="local-artifacts/real-drafting.jsonl")
    p.add_argument("--new-tokens", type=int, default=160)
    args = p.parse_args(argv)
    streams = make_streams(resolve_model(args.model), args.new_tokens)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_streams(streams, args.out)
    result = run_drafter_bench(streams, {"ane-spec": NgramDrafter}, k=3)
    print(format_side_by_side(result))
    print(json.dumps({f: round(m["tokens_per_pass"], 3) for f, m in
                      result["drafters"]["ane-spec"]["families"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
