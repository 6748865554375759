"""Per-layer activation maxima of a GGUF model's fp32 reference, and the residual scale the
build would choose (`ane-spec build --residual-scale auto`).

    python scripts/calibrate_activations.py MODEL [--json]

MODEL: a path, a catalog name or ollama:NAME (the CLI's resolver).
"""

from __future__ import annotations

import argparse
import json
import sys

from ane_spec.model.activation_range import margin, measure_activations
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.resolve import resolve_model
from ane_spec.shards.scale_decision import SAFETY, choose_log2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model = open_gguf(resolve_model(args.model))
    r = measure_activations(model, progress=lambda m: print(m, file=sys.stderr))
    k = choose_log2(r)
    s = 2.0 ** k
    if args.json:
        print(json.dumps({"model": model.path.name, "arch": model.config.arch,
                          "prompts": r.prompts, "tokens": r.tokens, "seconds": r.seconds,
                          "embedding": r.embedding, "log2_factor": k,
                          "layers": [vars(x) for x in r.layers]}, indent=1))
        return 0
    print(f"{model.path.name} ({model.config.arch}, {model.config.num_layers} layers): "
          f"{r.prompts} prompts, {r.tokens} tokens, {r.seconds:.1f}s")
    print(f"embedding max |x| {r.embedding:.4g}")
    print(f"{'layer':>5} {'residual':>10} {'margin':>8} {'ffn_up':>10} {'down_in':>10} "
          f"{'ffn margin':>10}")
    for i, x in enumerate(r.layers):
        print(f"{i:5d} {x.residual:10.4g} {margin(x.residual):8.1f} {x.ffn_up:10.4g} "
              f"{x.ffn_down_in:10.4g} {margin(max(x.ffn_up, x.ffn_down_in)):10.1f}")
    print(f"residual peak {r.residual_max:.4g} (margin {margin(r.residual_max):.1f}x), FFN "
          f"intermediate peak {r.ffn_max:.4g} (margin {margin(r.ffn_max):.1f}x)")
    print(f"auto residual scale (safety {SAFETY:g}x): 2^{k}, stream margin after scaling "
          f"{margin(r.residual_max, s):.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
