"""A prediction, not a measurement: the model drafter's speed on an M-series Mac, from the cost
model and the acceptance measured here.

    python scripts/draft_cost_model.py local-artifacts/real-drafting-1.5b*.json

On the Neural Engine a pass is bound by reading the weights, so its cost scales with the weight
bytes and barely with T: ane-book ran a T=4 pass of Phi-4-mini (3.84B parameters, int8) in about
55 ms, and seeds/003 measured T=1 and T=4 passes alike (16.7-17.8 tok/s at T=1, 68.7 at T=4). So a
pass of a model with W on-device parameters costs ~55 ms * W / 3.84B at T=1 or T=4, and:

- greedy decoding: one token per target pass;
- the model drafter, serial on the ANE: tokens per target pass / (1 + c * draft passes per
  target pass), c = W_draft / W_target, with both figures from the replay at that c
  (scripts/real_drafting.py --ratios, p_min chosen from c);
- the model drafter hidden (its passes entirely overlapped, e.g. the draft on the GPU while the
  ANE verifies): tokens per target pass with every slot filled, an upper bound.

On-device parameters are the layers and the LM head (the embedding table stays on the host).
The replay's acceptance is Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B; the 3.8B and 7B
rows assume a 0.5B draft of the same family is accepted as often there, which bigger targets
usually beat (llama.cpp's published 1B -> 8B pair: 72%). `ane-spec tune` (issue 35) is to
measure c_draft, c_verify and their overlap on the device and replace every assumption here.
"""

from __future__ import annotations

import argparse
import json
import sys

PHI4_PARAMS = 3.84e9
PHI4_T4_MS = 55.0
# On-device parameters (layers + LM head), from the GGUFs where we have them.
DRAFT = ("Qwen2.5-Coder-0.5B", 0.494e9)
TARGETS = (("Qwen2.5-Coder-1.5B", 1.544e9), ("a 3.8B (Phi-4-mini size)", 3.84e9),
           ("Qwen2.5-Coder-7B", 7.07e9))


def nearest(rows: dict, prefix: str, ratio: float) -> tuple[str, dict]:
    """The replay row `prefix c=R` with R nearest `ratio`."""
    best = min((k for k in rows if k.startswith(prefix)),
               key=lambda k: abs(float(k.rsplit("c=", 1)[1]) - ratio))
    return best, rows[best]["overall"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("replay", nargs="+", help="scripts/real_drafting.py --json-out FILE (several "
                                             "files: their rows together)")
    args = p.parse_args(argv)
    rows: dict = {}
    for path in args.replay:
        rows |= json.loads(open(path).read())["drafters"]
    fill = rows["both, fill"]["overall"]
    ms = lambda params: PHI4_T4_MS * params / PHI4_PARAMS  # noqa: E731
    print("| target | c_verify (ms) | c_draft (ms) | c | greedy tok/s | serial: tok/pass, "
          "draft passes/pass | serial tok/s (x greedy) | hidden tok/s (x greedy) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, params in TARGETS:
        verify, draft = ms(params), ms(DRAFT[1])
        c = draft / verify
        row, m = nearest(rows, "both, serial", c)
        greedy = 1000 / verify
        serial = m["tokens_per_pass"] / (1 + c * m["draft_passes_per_pass"]) * greedy
        hidden = fill["tokens_per_pass"] * greedy
        print(f"| {name} | {verify:.1f} | {draft:.1f} | {c:.2f} | {greedy:.1f} | "
              f"{m['tokens_per_pass']:.2f}, {m['draft_passes_per_pass']:.2f} ({row}) | "
              f"{serial:.1f} ({serial / greedy:.2f}x) | {hidden:.1f} "
              f"({hidden / greedy:.2f}x) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
