"""How often speculative decoding diverges from T=1 greedy under fp16 (ANE-like) arithmetic,
with the exactness guard off and on.

    python scripts/fp16_exactness.py [--manifest DIR] [--prompts 40] [--max-tokens 48]

Without --manifest it writes the tiny synthetic model and builds it (S=256). It measures the
backend's T=4-vs-T=1 drift first (what the guard uses), then for each prompt compares the
speculative tokens against plain T=1 greedy tokens, and explains every divergence: the position,
the two candidate tokens, and the T=1 top-1/top-2 margin there next to the guard threshold.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from ane_spec.decode.session import GUARD_FACTOR, DecodeSession, GenerateOptions
from ane_spec.probes.drift import measure_drift
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import prefill_logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--precision", default="fp16")
    args = ap.parse_args()

    manifest = args.manifest or _tiny_build()
    _, pipeline = open_pipeline(manifest, "mil", args.precision)
    drift = measure_drift(pipeline).figures["drift"]
    pipeline.manifest.drift[pipeline.drift_key] = drift
    print(f"backend {pipeline.backend.describe()}: drift {drift:.5f}, guard threshold "
          f"{GUARD_FACTOR * drift:.5f}")

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 958, int(rng.integers(3, 60))).tolist() for _ in range(args.prompts)]
    report = {"drift": drift, "guard_threshold": GUARD_FACTOR * drift, "prompts": len(prompts)}
    for guard in (False, True):
        diverged, interventions, cases = 0, 0, []
        for prompt in prompts:
            base = DecodeSession(pipeline).generate(
                prompt, GenerateOptions(max_tokens=args.max_tokens, speculative=False))
            spec = DecodeSession(pipeline).generate(
                prompt, GenerateOptions(max_tokens=args.max_tokens, guard=guard))
            interventions += spec.stats.guard_interventions
            if spec.tokens != base.tokens:
                diverged += 1
                cases.append(_explain(pipeline, prompt, base.tokens, spec.tokens))
        key = "guard_on" if guard else "guard_off"
        report[key] = {"diverged": diverged, "interventions": interventions, "cases": cases}
        print(f"guard {'on ' if guard else 'off'}: {diverged}/{len(prompts)} prompts diverge, "
              f"{interventions} guard interventions")
        for c in cases:
            print("   ", json.dumps(c))
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)} |
                     {k: {"diverged": v["diverged"], "interventions": v["interventions"]}
                      for k, v in report.items() if isinstance(v, dict)}))


def _explain(pipeline, prompt, base, spec) -> dict:
    i = next(n for n, (a, b) in enumerate(zip(base, spec)) if a != b) if any(
        a != b for a, b in zip(base, spec)) else min(len(base), len(spec))
    # The T=1 path's logits at the divergence point: prompt + agreed tokens, prefilled.
    row = prefill_logits(pipeline, prompt + base[:i])[-1]
    top = np.sort(row)[-2:]
    return {"prompt_tokens": len(prompt), "position": i,
            "greedy_token": base[i] if i < len(base) else None,
            "speculative_token": spec[i] if i < len(spec) else None,
            "t1_margin": round(float(top[1] - top[0]), 6)}


def _tiny_build() -> str:
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.shards.build import BuildRequest, build

    root = Path(tempfile.mkdtemp(prefix="fp16-exactness-"))
    gguf = write_synthetic_gguf(root / "tiny.gguf", preset("tiny"))
    build(gguf, root / "art", BuildRequest(max_seq=256))
    return str(root / "art")


if __name__ == "__main__":
    main()
