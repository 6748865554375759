#!/usr/bin/env python
"""Prompt prefill by pass width: passes, prefill tok/s and time to first token for P in
{4, 16, 32, 64, 128}.

    python scripts/bench_prefill.py [--gguf tiny-code] [--prompt-tokens 600] [--widths 4,16,32,64,128]
    python scripts/bench_prefill.py --gguf qwen2.5-coder-0.5b-instruct --precision fp16,fp32 \
        --widths 4,64 --max-seq 1024
    python scripts/bench_prefill.py --backend coreml          # on a Mac: the Neural Engine's

For each width P it builds the model once with `--prefill-t P` (P=4: no prefill function, every
prompt chunk a T=4 decode pass with the LM head, as before issue 33) into a scratch folder, then
prefills one prompt with `--prefill on` (every chunk through the prefill function) and generates
its first token. The prompt is a chat turn asking about a real Python file (the standard
library's `textwrap.py`, cut to --prompt-tokens with the model's chat template), so its tokens
are a real code prompt's. Timings are the least of --reps runs on a fresh conversation each.

The MIL interpreter computes every row separately (row-invariant kernels), so its gain is the
passes it no longer runs: the LM head on every chunk, and per-pass overheads. On the Neural
Engine a pass is bound by reading the weights, and the gain is the passes themselves; only a Mac
measures that (`--backend coreml`; elsewhere it says it cannot run).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ane_spec.assets import tiny_code_model
from ane_spec.decode.generate import prompt_tokens
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.resolve import resolve_model
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build


def chat_prompt(pipeline, tokens: int) -> list[int]:  # noqa: ANN001
    """A user turn carrying a real Python file, cut so the whole prompt is about `tokens`."""
    source = Path(textwrap.__file__).read_text()
    lo, hi = 0, len(source)
    while lo < hi:  # the longest prefix of the file whose prompt fits
        mid = (lo + hi + 1) // 2
        ids = _turn(pipeline, source[:mid])
        lo, hi = (mid, hi) if len(ids) <= tokens else (lo, mid - 1)
    return _turn(pipeline, source[:lo])


def _turn(pipeline, code: str) -> list[int]:  # noqa: ANN001
    return prompt_tokens(pipeline, messages=[{"role": "user", "content": (
        "Here is a Python module. Explain what its main function does.\n\n```python\n"
        + code + "\n```")}])


def measure(manifest: Path, backend: str, precision: str, prompt_len: int, reps: int) -> dict:
    _, pipeline = open_pipeline(manifest, backend, precision, prefill="on")
    prompt = chat_prompt(pipeline, prompt_len)
    DecodeSession(pipeline).generate(prompt[:8], GenerateOptions(max_tokens=1))  # warm-up
    best = None
    for _ in range(reps):
        result = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=1))
        s = result.stats
        if best is None or s.ttft_seconds < best.ttft_seconds:
            best, first = s, result.tokens[:1]
    return {"prompt_tokens": len(prompt), "prefill_passes": best.prefill_passes,
            "prefill_t": best.prefill_t, "prefill_seconds": round(best.prefill_seconds, 3),
            "prefill_tok_s": round(best.prefill_tokens / best.prefill_seconds, 1),
            "ttft_seconds": round(best.ttft_seconds, 3), "first_token": first,
            "backend": pipeline.backend.describe()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default="tiny-code",
                    help="a GGUF path or catalog name (default: the embedded tiny-code)")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--widths", default="4,16,32,64,128",
                    help="prefill widths P (4: no prefill function, T=4 decode passes)")
    ap.add_argument("--backend", default="mil", choices=["mil", "coreml"])
    ap.add_argument("--precision", default="fp32",
                    help="interpreter precision(s), comma-separated: fp32, fp16")
    ap.add_argument("--max-seq", type=int, default=None,
                    help="the builds' context (default: 1024, or the model's where shorter)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.backend == "coreml" and sys.platform != "darwin":
        sys.exit("--backend coreml needs a Mac (Core ML runs only on macOS 15+): the interpreter "
                 "figures (--backend mil) are what this machine can measure")
    gguf = tiny_code_model() if args.gguf == "tiny-code" else resolve_model(args.gguf)
    widths = [int(w) for w in args.widths.split(",")]
    from ane_spec.model.gguf_file import open_gguf

    max_seq = args.max_seq or min(1024, open_gguf(gguf).config.context_length)
    prompt_len = min(args.prompt_tokens, max_seq - 1)
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    try:
        for width in widths:
            out = scratch / f"p{width}"
            t0, cpu0 = time.monotonic(), _cpu_seconds()
            build(gguf, out, BuildRequest(max_seq=max_seq,
                                          prefill_t=0 if width <= 4 else width))
            built, built_cpu = time.monotonic() - t0, _cpu_seconds() - cpu0
            shards = sum(s.file.bytes for s in load_manifest(out, verify=False).manifest.shards)
            for precision in args.precision.split(","):
                row = {"P": width, "precision": precision, "build_s": round(built, 1),
                       "build_cpu_s": round(built_cpu, 1),
                       "layer_packages_mib": round(shards / 2**20, 2)}
                row |= measure(out, args.backend, precision, prompt_len, args.reps)
                rows.append(row)
                print(f"P={width:>3} {precision}: built in {built:.1f}s ({built_cpu:.1f} CPU s), layer packages "
                      f"{row['layer_packages_mib']} MiB; {row['prefill_passes']} passes, prefill "
                      f"{row['prefill_seconds']}s ({row['prefill_tok_s']} tok/s), TTFT "
                      f"{row['ttft_seconds']}s, first token {row['first_token']}",
                      file=sys.stderr, flush=True)
            shutil.rmtree(out, ignore_errors=True)
    except AneSpecError as exc:
        sys.exit(f"bench_prefill: {exc}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{os.path.basename(str(gguf))}, {rows[0]['backend']}, prompt "
          f"{rows[0]['prompt_tokens']} tokens, least of {args.reps}")
    print("| P | precision | passes | prefill s | prefill tok/s | TTFT s | first token | "
          "build s | build CPU s | layer packages MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['P']} | {r['precision']} | {r['prefill_passes']} | {r['prefill_seconds']} | "
              f"{r['prefill_tok_s']} | {r['ttft_seconds']} | {r['first_token']} | "
              f"{r['build_s']} | {r['build_cpu_s']} | {r['layer_packages_mib']} |")


def _cpu_seconds() -> float:
    # The build's own CPU time (all its threads: the calibration runs beside the conversion),
    # which the other work on a shared machine disturbs far less than the wall clock.
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
