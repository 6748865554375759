"""The real pair through the built shards: fp16 speculative == greedy with the model drafter, and
wall-clock tokens/s with the draft in its own process, overlapping the target's pass or not.

    python scripts/real_pair_decode.py --target local-artifacts/q15 --draft local-artifacts/q05 \\
        [--new-tokens 160] [--kernels batched] [--runs greedy,serial,overlap]

The target (e.g. Qwen2.5-Coder-1.5B-Instruct) runs in this process on the fp16 interpreter at the
fixed T=4 shape; the draft (Qwen2.5-Coder-0.5B-Instruct) in its own process (fp32 interpreter,
T=1 passes), each on one BLAS thread, so on a 2-core machine each has a core. Per prompt (a
chat answer and a piece of code): plain greedy (one token per pass), speculative with the draft
after each verify pass (serial), and speculative with the draft looking past each block while
the target verifies it (overlap). Each speculative run's tokens must equal greedy's.

`--kernels batched` runs the interpreter's BLAS kernels (one matrix product per pass instead of
one per row: ~4x faster at T=4 here); they pass `probe row-invariance` on this machine's BLAS, in
fp32 and fp16, which is what makes speculative == greedy hold bitwise. `row` is the default
backend's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the target gets one core, the draft one

from ane_spec.decode.draft_setup import close_drafter, open_drafter  # noqa: E402
from ane_spec.decode.generate import prompt_tokens  # noqa: E402
from ane_spec.decode.session import DecodeSession, GenerateOptions  # noqa: E402
from ane_spec.manifests.store import load_manifest  # noqa: E402
from ane_spec.runtime.mil_backend import MILBackend  # noqa: E402
from ane_spec.runtime.pipeline import ShardPipeline  # noqa: E402

PROMPTS = {
    "chat": [{"role": "user", "content": "Explain in a few paragraphs what a KV cache is in a "
                                          "transformer and why it makes generation faster."}],
    "code": [{"role": "user", "content": "Write a Python class for an LRU cache with get and put, "
                                          "using an OrderedDict, with docstrings."}],
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="the target's build folder")
    p.add_argument("--draft", required=True, help="the draft's build folder")
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--kernels", choices=["row", "batched"], default="batched")
    p.add_argument("--runs", default="greedy,serial,overlap")
    p.add_argument("--prompts", default="chat,code")
    p.add_argument("--out", default="local-artifacts/real-pair-decode.json")
    args = p.parse_args(argv)
    runs = args.runs.split(",")
    target = ShardPipeline(load_manifest(args.target), MILBackend("fp16", args.kernels), "fixed")
    print(f"target {args.target}: {target.backend.describe()}, fixed shape", file=sys.stderr)
    drafters = {}
    for name in ("serial", "overlap"):
        if name in runs:
            drafters[name] = open_drafter(target, args.draft, overlap=name == "overlap")
            print(f"draft ({name}): {drafters[name].costs.to_dict()}", file=sys.stderr,
                  flush=True)
    report: dict = {"target": args.target, "draft": args.draft, "kernels": args.kernels,
                    "new_tokens": args.new_tokens,
                    "costs": {n: d.costs.to_dict() for n, d in drafters.items()},
                    "prompts": {}}
    try:
        for pname in args.prompts.split(","):
            prompt = prompt_tokens(target, messages=PROMPTS[pname])
            rows = report["prompts"].setdefault(pname, {"prompt_tokens": len(prompt)})
            tokens = {}
            for run in runs:
                options = GenerateOptions(max_tokens=args.new_tokens,
                                          speculative=run != "greedy")
                session = DecodeSession(target, drafter=drafters.get(run)) if run != "greedy" \
                    else DecodeSession(target)
                t0 = time.perf_counter()
                out = session.generate(prompt, options)
                wall = time.perf_counter() - t0
                tokens[run] = out.tokens
                stats = out.stats.to_dict()
                rows[run] = {"wall_s": round(wall, 2), "tokens": len(out.tokens),
                             "decode_tok_s": stats["decode_tok_s"],
                             "tokens_per_pass": stats["tokens_per_pass"],
                             "passes": stats["passes"], "draft_sources": stats["draft_sources"],
                             "draft_model_passes": stats["draft_model_passes"],
                             "draft_seconds": stats["draft_seconds"],
                             "equal_to_greedy": (out.tokens == tokens["greedy"])
                             if "greedy" in tokens else None}
                print(f"{pname} {run}: {json.dumps(rows[run])}", file=sys.stderr, flush=True)
                if run == "greedy":
                    rows["text"] = out.text
            with open(args.out, "w") as fh:
                json.dump(report, fh, indent=1)
    finally:
        for d in drafters.values():
            close_drafter(d)
    print(json.dumps(report, indent=1))
    same = all(r.get(run, {}).get("equal_to_greedy") in (True, None)
               for r in report["prompts"].values() for run in ("serial", "overlap"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
