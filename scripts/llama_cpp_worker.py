"""A llama.cpp model behind a pipe, for scripts/real_drafting.py --engine llama-cpp.

    PYTHON_WITH_LLAMA_CPP scripts/llama_cpp_worker.py MODEL.gguf [--n-ctx 2048]

Needs only numpy and llama-cpp-python (so it runs under any interpreter that has them). Reads
one JSON command per line on stdin and answers on stdout:

- {"op": "run", "tokens": [...], "position": p}: forget positions >= p, evaluate the tokens at
  p.., answer a JSON line {"vocab": V} and then the last token's logits, V float32 (4V bytes);
- {"op": "generate", "prompt": [...], "max_tokens": n, "stop": [...]}: greedy continuation
  from position 0, answered as {"tokens": [...]} (the stop id included, as llama.cpp's own
  greedy loop and ReferenceModel.generate emit it);
- {"op": "quit"}.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_batch=512,
                logits_all=False, verbose=False)
    vocab = llm.n_vocab()
    out = sys.stdout.buffer

    def run(tokens: list[int], position: int) -> np.ndarray:
        llm.n_tokens = position  # eval() drops the K/V from n_tokens on
        llm.eval(tokens)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).astype(np.float32)

    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "run":
            logits = run(cmd["tokens"], cmd["position"])
            out.write((json.dumps({"vocab": vocab}) + "\n").encode())
            out.write(logits.tobytes())
        elif cmd["op"] == "generate":
            stop = set(cmd.get("stop", ()))
            prompt = cmd["prompt"]
            logits = run(prompt, 0)
            tokens: list[int] = []
            while len(tokens) < cmd["max_tokens"]:
                tok = int(logits.argmax())
                tokens.append(tok)
                if tok in stop or len(prompt) + len(tokens) >= args.n_ctx:
                    break
                logits = run([tok], len(prompt) + len(tokens) - 1)
            out.write((json.dumps({"tokens": tokens}) + "\n").encode())
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
