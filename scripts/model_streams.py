"""Drafter replay streams made of a model's own greedy output on held-out stdlib code.

    python scripts/model_streams.py OUT.jsonl [--gguf PATH] [--streams 24] [--prompt-tokens 256]
        [--new-tokens 128]
    ane-spec bench-drafter --streams OUT.jsonl

The built-in bench-drafter streams are constructed text, not model output. These are what the
model really emits: each prompt is a window of `--prompt-tokens` tokens from a held-out stdlib
file (never trained on; windows spread evenly over the held-out files), and the output is the
model's plain greedy continuation of `--new-tokens` tokens, computed by the reference forward
(which the oracle checks show equal to llama.cpp's and `ane-spec generate`'s greedy tokens).
Family "model-code". Deterministic for a given model and Python installation.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ane_spec.assets import tiny_code_model
from ane_spec.bench.streams import Stream, save_streams
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.reference import ReferenceModel
from ane_spec.model.stdlib_corpus import split, stdlib_corpus
from ane_spec.model.tokenizer import Tokenizer


def model_streams(gguf: Path, n: int, prompt_tokens: int, new_tokens: int) -> list[Stream]:
    m = open_gguf(gguf)
    tok = Tokenizer.from_data(m.tokenizer_data)
    ref = ReferenceModel(m, context_window=prompt_tokens + new_tokens + 1)
    _, held = split(stdlib_corpus())
    windows: list[list[int]] = []
    per_file = -(-n // len(held))
    for f in held:
        ids = tok.encode(f.text)
        room = len(ids) - prompt_tokens
        if room <= 0:
            continue
        for k in range(per_file):
            start = room * k // per_file
            windows.append(ids[start:start + prompt_tokens])
    streams = []
    for prompt in windows[:n]:
        output = ref.generate(prompt, new_tokens, tok.eog_ids)
        streams.append(Stream("model-code", tuple(prompt), tuple(output)))
        print(f"stream {len(streams)}/{min(n, len(windows))}: {len(set(output))} distinct of "
              f"{len(output)} tokens", file=sys.stderr)
    return streams


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--gguf", default=None, help="default: the embedded tiny-code model")
    p.add_argument("--streams", type=int, default=24, help="at most this many")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args(argv)
    gguf = Path(args.gguf) if args.gguf else tiny_code_model()
    save_streams(model_streams(gguf, args.streams, args.prompt_tokens, args.new_tokens), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
