"""Host overhead per decode pass at a 2k context: everything but backend compute.

    python scripts/bench_host_overhead.py [--context 2048] [--new-tokens 128]

Host work scales with the context window (masks are [T, S]) and the vocabulary (the head returns
[T, 200064] logits that are copied and arg-maxed), not with the layers. So this builds a synthetic
model with the real vocabulary and S, but one small layer, and decodes at a prompt of ~S - new
tokens: the per-pass host time it reports is what a real-size model on the ANE would pay on top
of its ~55 ms of compute. Target: <= 1 ms per pass.

Both decode shapes: fixed (every pass 4 rows; only the real rows of the head are read) and mixed
(T=1 decode, T=4 verify, with the exactness guard on at this backend's measured drift, as in
production). In the fixed shape, also greedy under a JSON-schema grammar (the llguidance mask
of every row verification reads) and with penalties on (a full processed row per read row).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ane_spec.decode.grammar import Grammar, json_schema_grammar
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="host-overhead-"))
    gguf = write_synthetic_gguf(root / "m.gguf", preset("tiny", num_layers=1, vocab_size=200064))
    build(gguf, root / "art", BuildRequest(max_seq=args.context, head_chunks=4))
    rng = np.random.default_rng(0)
    base = rng.integers(0, 199000, 64).tolist()
    prompt = (base * (args.context // 64))[: args.context - args.new_tokens - 1]
    report = {"context": args.context, "vocab": 200064, "prompt_tokens": len(prompt),
              "new_tokens": args.new_tokens}
    for shape in ("fixed", "mixed"):
        _, pipeline = open_pipeline(root / "art", "mil", "fp16", decode_shape=shape)
        if shape == "mixed":
            drift = measure_drift(pipeline).figures["drift"]
            pipeline.manifest.drift[pipeline.drift_key] = report["mixed_drift"] = drift
        modes = {"speculative": {}, "greedy": {"speculative": False}}
        if shape == "fixed":
            schema = {"type": "object", "properties": {"items": {"type": "array", "items": {
                "type": "string"}}}, "required": ["items"]}
            modes["speculative+json_grammar"] = {"grammar": Grammar(
                pipeline.tokenizer, json_schema_grammar(schema))}
            modes["speculative+penalties"] = {"sampling": SamplingParams(
                repeat_penalty=1.1, frequency_penalty=0.1)}
        per_pass = {mode: [] for mode in modes}
        for _ in range(args.reps):
            for mode in per_pass:
                session = DecodeSession(pipeline)
                t0 = time.perf_counter()
                out = session.generate(prompt, GenerateOptions(
                    max_tokens=args.new_tokens, **modes[mode]))
                wall = time.perf_counter() - t0
                s = out.stats  # backend/host split covers decode passes only
                per_pass[mode].append({
                    "host_ms_per_pass": 1000 * s.host_seconds / s.passes,
                    "backend_ms_per_pass": 1000 * s.backend_seconds / s.passes,
                    "tokens_per_pass": s.to_dict()["tokens_per_pass"], "wall_s": wall})
        report[shape] = {mode: {k: round(statistics.median(r[k] for r in runs), 4)
                                for k in runs[0]} for mode, runs in per_pass.items()}
    report["target_host_ms_per_pass"] = 1.0
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
