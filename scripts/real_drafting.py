"""Drafter replay on a real model's own chat output: the honest speed-up figure for a Mac.

    python scripts/real_drafting.py [MODEL] [--out streams.jsonl] [--new-tokens 160]
    python scripts/real_drafting.py qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct --out local-artifacts/real-drafting-1.5b.jsonl
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
With `--streams FILE` the streams are read from a previous run's --out instead.

With `--draft-model M` the draft model (reference forward pass too) drafts for the same streams
(ane_spec.bench.model_drafting): the model alone, both drafters chosen per step, llama.cpp's
n-gram-first precedence, each filling all three slots (the draft's passes free, as when they
are hidden) and as a serial draft at the cost ratio `--ratio` (p_min from it), with tokens per
unit of time at the ratios of `--at`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

from ane_spec.bench.drafter_bench import format_side_by_side, run_drafter_bench
from ane_spec.bench.model_drafting import (
    InlineLookahead, ReferenceDraftModel, TeacherForcedDraftModel, format_table,
    run_model_bench, teacher_forced_table,
)
from ane_spec.bench.streams import Stream, load_streams, save_streams
from ane_spec.decode.draft_policy import BothDrafters, DraftCosts
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.model_drafter import ModelDrafter, Proposal
from ane_spec.model.vocab_compat import check_draft_vocab
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


class LlamaCppModel:
    """A `DraftModel`, and a greedy generator, on llama.cpp in a child process
    (scripts/llama_cpp_worker.py under `python`, an interpreter with llama-cpp-python). One
    context: use it with one draft state."""

    def __init__(self, gguf: Path, python: str, n_ctx: int = 2048):
        self.proc = subprocess.Popen([python, str(Path(__file__).with_name("llama_cpp_worker.py")),
                                      str(gguf), "--n-ctx", str(n_ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.vocab_size = open_gguf(gguf).config.vocab_size
        self.max_seq = n_ctx
        self._passes = 0

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the llama.cpp worker died")
        return json.loads(line)

    def new_state(self) -> None:
        return None

    def can_resume(self, state: None, n: int) -> bool:
        return True

    def run(self, tokens: list[int], position: int, state: None) -> np.ndarray:
        head = self._ask(op="run", tokens=[int(t) for t in tokens], position=position)
        self._passes += 1
        return np.frombuffer(self.proc.stdout.read(4 * head["vocab"]), dtype=np.float32)

    def passes(self) -> int:
        return self._passes

    def generate(self, prompt: list[int], n: int, stop: frozenset[int]) -> list[int]:
        return self._ask(op="generate", prompt=prompt, max_tokens=n, stop=sorted(stop))["tokens"]

    def close(self) -> None:
        try:
            self.proc.stdin.write(b'{"op": "quit"}\n')
            self.proc.stdin.close()
        except OSError:
            pass
        self.proc.wait(30)


def make_streams(gguf: Path, new_tokens: int, llama_python: str | None = None) -> list[Stream]:
    m = open_gguf(gguf)
    tok = Tokenizer.from_data(m.tokenizer_data)
    template = tok.data.chat_template
    if llama_python:
        engine = LlamaCppModel(gguf, llama_python)
        generate = engine.generate
    else:
        # Dequantized once (a 1.5B model: ~7 GB of float32) rather than at every token.
        ref = ReferenceModel(m, context_window=2048, materialize=True)
        generate = ref.generate

    def reply(messages: list[dict]) -> tuple[list[int], list[int]]:
        text = render_chat(messages, template=template)
        prompt = tok.encode(text, special=True)
        return prompt, generate(prompt, new_tokens, tok.eog_ids)

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
    if llama_python:
        engine.close()
    return streams


class NgramFirst(BothDrafters):
    """llama.cpp's fixed precedence: the n-gram's draft whenever it has one, else the model's."""

    def propose(self, k: int, *, fill: bool = False) -> Proposal:
        ng = self.ngram.draft(k)
        if ng:
            return Proposal(list(ng), "ngram")
        return self.model.propose(k, p_min=self.current_p_min())


def model_drafters(draft_gguf: Path, ratios: list[float], limit_vocab: int,
                   llama_python: str | None = None, table: dict | None = None) -> dict:
    """The rows of the model table: each source alone and both, filling every slot (draft
    passes free) and serial at each cost ratio (p_min from it), and the look-ahead at the
    first ratio."""
    if table is not None:
        model = ModelDrafter(TeacherForcedDraftModel(table, open_gguf(draft_gguf).config.vocab_size),
                             limit_vocab=limit_vocab)
    elif llama_python:
        model = ModelDrafter(LlamaCppModel(draft_gguf, llama_python), limit_vocab=limit_vocab)
    else:
        ref = ReferenceModel(open_gguf(draft_gguf), context_window=2048)
        model = ModelDrafter(ReferenceDraftModel(ref), states=4, limit_vocab=limit_vocab)

    def both(mode: str, ratio: float | None = None, overlap: bool = False,
             kind: type = BothDrafters):
        drafter = InlineLookahead(model) if overlap else model
        costs = None if ratio is None else DraftCosts(1.0, ratio)
        return lambda: kind(NgramDrafter(), drafter, mode=mode, costs=costs, overlap=overlap)

    rows = {
        "n-gram": both("ngram"),
        "model, fill": both("model"),
        "both, fill": both("both"),
        "n-gram first (llama.cpp), fill": both("both", kind=NgramFirst),
        f"model, serial c={ratios[0]:g}": both("model", ratios[0]),
    }
    for r in ratios:
        rows[f"both, serial c={r:g}"] = both("both", r)
    rows[f"both, overlap c={ratios[0]:g}"] = both("both", ratios[0], overlap=True)
    return rows


def teacher_forced(cache: Path, draft_gguf: Path, streams: list[Stream]) -> dict:
    """The draft's teacher-forced greedy table for the streams, from `cache` when it holds
    every stream, else computed (reference forward pass) and saved there."""
    keys = [(*s.prompt, *s.output) for s in streams]
    if cache.is_file():
        saved = {tuple(e["seq"]): [tuple(r) for r in e["rows"]]
                 for e in json.loads(cache.read_text())}
        if all(k in saved for k in keys):
            return {k: saved[k] for k in keys}
    ref = ReferenceModel(open_gguf(draft_gguf), context_window=4096, materialize=True)
    table = teacher_forced_table(ref, streams, say=lambda m: print(m, file=sys.stderr,
                                                                   flush=True))
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps([{"seq": list(k), "rows": [list(r) for r in v]}
                                 for k, v in table.items()]))
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--out", default="local-artifacts/real-drafting.jsonl")
    p.add_argument("--streams", help="read the streams from this JSONL instead of generating")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--draft-model", help="replay this draft model too (path, catalog name)")
    p.add_argument("--ratios", default="0.43,0.32,0.13,0.07",
                   help="draft/target pass costs of the serial rows (the first: the issue's "
                        "CPU figure for 0.5B -> 1.5B; then the weight-byte ratios of 0.5B to "
                        "1.5B, 3.8B and 7B targets on a Mac: scripts/draft_cost_model.py)")
    p.add_argument("--json-out", help="write the model table's figures here")
    p.add_argument("--rows", help="only the model table's rows starting with one of these "
                                  "';'-separated prefixes (e.g. 'model;both, fill')")
    p.add_argument("--llama-python", metavar="PYTHON",
                   help="run both models on llama.cpp (the GGUFs as they are) through "
                        "scripts/llama_cpp_worker.py under this interpreter, which has "
                        "llama-cpp-python: far faster than the reference on a loaded CPU; "
                        "greedy tokens differ from the reference's at near ties")
    p.add_argument("--teacher-forced", metavar="CACHE",
                   help="greedy drafts read from one teacher-forced reference pass of the draft "
                        "per stream (bench/model_drafting.TeacherForcedDraftModel: exact tokens "
                        "per pass and draft passes), cached in this JSON file")
    args = p.parse_args(argv)
    target = resolve_model(args.model)
    if args.streams:
        streams = load_streams(args.streams)
    else:
        streams = make_streams(target, args.new_tokens, args.llama_python)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        save_streams(streams, args.out)
    result = run_drafter_bench(streams, {"ane-spec": NgramDrafter}, k=3)
    print(format_side_by_side(result))
    print(json.dumps({f: round(m["tokens_per_pass"], 3) for f, m in
                      result["drafters"]["ane-spec"]["families"].items()}))
    if args.draft_model:
        check_draft_vocab(open_gguf(target).tokenizer_data,
                          open_gguf(resolve_model(args.draft_model)).tokenizer_data,
                          target_name=args.model, draft_name=args.draft_model)
        vocab = open_gguf(target).config.vocab_size
        ratios = [float(r) for r in args.ratios.split(",") if r]
        table = None
        if args.teacher_forced:
            table = teacher_forced(Path(args.teacher_forced), resolve_model(args.draft_model),
                                   streams)
        rows = model_drafters(resolve_model(args.draft_model), ratios, vocab, args.llama_python,
                              table)
        if args.rows:
            wanted = [w.strip() for w in args.rows.split(";") if w.strip()]
            rows = {k: v for k, v in rows.items() if any(k.startswith(w) for w in wanted)}
        models = run_model_bench(streams, rows)
        print(format_table(models, ratios))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(models | {"ngram": result}, indent=1))
        print(json.dumps({name: {"tokens_per_pass": round(r["overall"]["tokens_per_pass"], 3),
                                 "families": {f: round(m["tokens_per_pass"], 3)
                                              for f, m in r["families"].items()},
                                 "sources": r["overall"]["sources"]}
                          for name, r in models["drafters"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
