"""How often speculative decoding diverges from plain greedy decoding under fp16 (ANE-like)
arithmetic, per decode shape.

    python scripts/fp16_exactness.py [--manifest DIR] [--prompts 120] [--max-tokens 48]
                                     [--kernels row,batched] [--json OUT.json]

Without --manifest it writes the tiny synthetic model and builds it (S=256). For each kernel set
of the interpreter ("row": every token row its own product, row-invariant by construction, the
default; "batched": one BLAS call per block, as the interpreter first ran, which is not) it runs
`probe row-invariance`, then compares speculative against plain greedy tokens on every prompt:

- fixed shape (every pass 4 rows wide): no guard, nothing to calibrate;
- mixed shape (T=1 decode, T=4 verify): drift measured first, then guard off and guard on.

Every divergence is explained: the position, the two candidate tokens, and the greedy path's
top-1/top-2 margin there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.runtime.decode_shape import GUARD_FACTOR
from ane_spec.manifests.store import load_manifest
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.row_invariance import run_row_invariance
from ane_spec.runtime.mil_backend import MILBackend
from ane_spec.runtime.pipeline import ShardPipeline, prefill_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest")
    ap.add_argument("--prompts", type=int, default=120)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--precision", default="fp16")
    ap.add_argument("--kernels", default="row", help="comma-separated: row, batched")
    ap.add_argument("--json", help="write the full report here")
    args = ap.parse_args()

    loaded = load_manifest(args.manifest or _tiny_build())
    # Random prompts of ordinary (NORMAL-type) tokens; on the tiny model these are ids 0..957,
    # drawn exactly as the first version of this script drew them.
    types = loaded.tokenizer_data().token_types
    ordinary = np.array([i for i, t in enumerate(types) if t == 1])
    rng = np.random.default_rng(0)
    prompts = [ordinary[rng.integers(0, len(ordinary), int(rng.integers(3, 60)))].tolist()
               for _ in range(args.prompts)]
    report: dict = {"prompts": len(prompts), "max_tokens": args.max_tokens, "runs": []}
    for kernels in args.kernels.split(","):
        backend = MILBackend(args.precision, kernels=kernels)
        pipelines = {shape: ShardPipeline(loaded, backend, shape) for shape in ("fixed", "mixed")}
        probe = run_row_invariance(pipelines["fixed"])
        print(f"\n== {backend.describe()}: {probe.figures['verdict']}")
        drift = measure_drift(pipelines["mixed"]).figures["drift"]
        pipelines["mixed"].manifest.drift[pipelines["mixed"].drift_key] = drift
        print(f"   mixed-shape drift {drift:.5f}, guard threshold {GUARD_FACTOR * drift:.5f}")
        for shape, guards in (("fixed", (False,)), ("mixed", (False, True))):
            pipeline = pipelines[shape]
            started = time.perf_counter()
            greedy = [DecodeSession(pipeline).generate(p, GenerateOptions(
                max_tokens=args.max_tokens, speculative=False)) for p in prompts]
            greedy_s = time.perf_counter() - started
            for guard in guards:
                run = _compare(pipeline, prompts, greedy, args.max_tokens, guard)
                run |= {"kernels": kernels, "shape": shape, "row_invariant": probe.passed,
                        "greedy_seconds": round(greedy_s, 1)}
                if shape == "mixed":
                    run["drift"] = drift
                report["runs"].append(run)
                label = f"{shape}" + (f", guard {'on' if guard else 'off'}" if shape == "mixed"
                                      else "")
                print(f"   {label:18s} {run['identical']}/{len(prompts)} identical, "
                      f"{run['diverged']} diverge, {run['interventions']} guard interventions, "
                      f"{run['passes']} passes ({run['seconds']}s)")
                for c in run["cases"]:
                    print("      ", json.dumps(c))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps([{k: v for k, v in r.items() if k != "cases"} for r in report["runs"]]))


def _compare(pipeline: ShardPipeline, prompts, greedy, max_tokens: int, guard: bool) -> dict:
    started = time.perf_counter()
    diverged, interventions, passes, cases = 0, 0, 0, []
    for prompt, base in zip(prompts, greedy):
        spec = DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=max_tokens,
                                                                        guard=guard))
        interventions += spec.stats.guard_interventions
        passes += spec.stats.passes
        if spec.tokens != base.tokens:
            diverged += 1
            cases.append(_explain(pipeline, prompt, base.tokens, spec.tokens))
    return {"guard": guard, "identical": len(prompts) - diverged, "diverged": diverged,
            "interventions": interventions, "passes": passes,
            "seconds": round(time.perf_counter() - started, 1), "cases": cases}


def _explain(pipeline: ShardPipeline, prompt, base, spec) -> dict:
    i = next((n for n, (a, b) in enumerate(zip(base, spec)) if a != b), min(len(base), len(spec)))
    # The greedy path's logits at the divergence point: prompt + agreed tokens, prefilled.
    row = prefill_logits(pipeline, prompt + base[:i])[-1]
    top = np.sort(row)[-2:]
    return {"prompt_tokens": len(prompt), "position": i,
            "greedy_token": base[i] if i < len(base) else None,
            "speculative_token": spec[i] if i < len(spec) else None,
            "greedy_margin": round(float(top[1] - top[0]), 6)}


def _tiny_build() -> str:
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.shards.build import BuildRequest, build

    root = Path(tempfile.mkdtemp(prefix="fp16-exactness-"))
    gguf = write_synthetic_gguf(root / "tiny.gguf", preset("tiny"))
    build(gguf, root / "art", BuildRequest(max_seq=256))
    return str(root / "art")


if __name__ == "__main__":
    main()
