"""Bytes of K/V state one pass moves, scatter against slice (`ane-spec build --kv-write`).

    python scripts/kv_traffic.py                  # Phi-4-mini's shapes at S = 2048 and 8192
    python scripts/kv_traffic.py --build FOLDER   # a build's model, context and rings

Per pass, every layer, K and V together: what the K/V write reads and writes (the scatter: every
slot; the slice form: its window, 4 slots for a decode pass and P for a prefill chunk), and what
attention reads (every slot, in both forms). The milliseconds are those bytes at --bandwidth
(default 120 GB/s, the figure issue 35 uses), not a measurement: what the Neural Engine moves
for either form is for `tune` on a device to show.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ane_spec.model.config import ModelConfig
from ane_spec.model.synthetic import preset
from ane_spec.shards.kv_traffic import format_bytes, kv_traffic


def table(c: ModelConfig, contexts: list[int], passes: dict[str, int], ring: int,
          bandwidth: float) -> list[str]:
    head = (f"{'S':>6}  {'pass':<14} {'form':<8} {'write reads':>12} {'write writes':>13} "
            f"{'write ms':>9}  {'attention reads':>15}")
    lines = [head, "-" * len(head)]
    for s in contexts:
        for label, window in passes.items():
            for form in ("scatter", "slice"):
                t = kv_traffic(c, s, form, window, ring)
                ms = 1000 * t.write_total / bandwidth
                lines.append(f"{s:>6}  {label:<14} {form:<8} {format_bytes(t.write_read):>12} "
                             f"{format_bytes(t.write_written):>13} {ms:>9.3f}  "
                             f"{format_bytes(t.attention_read):>15}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", type=Path, help="a build folder (default: Phi-4-mini's shapes)")
    ap.add_argument("--max-seq", type=int, nargs="+", default=[2048, 8192],
                    help="contexts for Phi-4-mini's shapes (default 2048 8192)")
    ap.add_argument("--bandwidth", type=float, default=120e9, help="bytes per second")
    args = ap.parse_args()
    if args.build:
        from ane_spec.manifests.store import load_manifest

        m = load_manifest(args.build, verify=False).manifest
        c, contexts, ring, prefill = m.model, [m.build.max_seq], m.build.swa_ring, m.build.prefill_t
        print(f"{m.name}: {c.num_layers} layers, {c.num_kv_heads} KV heads of {c.head_dim}"
              + (f", {ring}-slot rings" if ring else "") + f"; built {m.build.kv_write}")
    else:
        c, contexts, ring, prefill = preset("phi4-mini").to_config(), args.max_seq, 0, 64
        print(f"Phi-4-mini: {c.num_layers} layers, {c.num_kv_heads} KV heads of {c.head_dim}")
    passes = {"decode (T<=4)": 4} | ({f"prefill (P={prefill})": prefill} if prefill else {})
    print("\n".join(table(c, contexts, passes, ring, args.bandwidth)))


if __name__ == "__main__":
    main()
