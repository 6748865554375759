#!/usr/bin/env python
"""KV slots: spilling and restoring a conversation against prefilling it again.

    python scripts/bench_slots.py [--preset tiny|small] [--max-seq 1024] [--tokens 128,512,1000]
    python scripts/bench_slots.py --manifest local-artifacts/phi4 --backend coreml

For each conversation length n: prefill n tokens into a fresh state (what a lost cache costs),
spill them (copy the used K/V rows to host memory), restore them into a state that held another
conversation, save them to a slot file and load it back (hash-checked). Checks that the restored
rows equal the originals bit for bit and that the next pass gives the same logits, then prints
the times. Without --manifest it builds a synthetic model first (random weights: the timings are
the machine's, not a real model's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from ane_spec.daemon.kv_state import StateLayout
from ane_spec.daemon.slot_files import load_slot, save_slot
from ane_spec.probes.gates import open_pipeline
from ane_spec.runtime.pipeline import ShardPipeline


def prefill(pipeline: ShardPipeline, tokens: list[int], state) -> object:  # noqa: ANN001
    out = None
    for start in range(0, len(tokens), pipeline.max_t):
        out = pipeline.run(tokens[start:start + pipeline.max_t], start, state)
    return out


def best_of(repeats: int, fn) -> tuple[float, object]:  # noqa: ANN001
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), result


def measure(pipeline: ShardPipeline, n: int, workdir: Path, repeats: int) -> dict:
    rng = np.random.default_rng(n)
    tokens = rng.integers(0, pipeline.config.vocab_size, n).tolist()
    layout = StateLayout(pipeline)
    state = pipeline.new_state()
    t_prefill, _ = best_of(1, lambda: prefill(pipeline, tokens, state))
    t_spill, rows = best_of(repeats, lambda: layout.capture(state, n))
    other = pipeline.new_state()
    prefill(pipeline, rng.integers(0, pipeline.config.vocab_size, n).tolist(), other)
    t_restore, _ = best_of(repeats, lambda: layout.install(other, rows, n))
    exact = all(np.array_equal(a, b) for a, b in zip(rows, layout.capture(other, n)))
    nxt = tokens[-1:]
    a, b = pipeline.run(nxt, n, state), pipeline.run(nxt, n, other)
    same_logits = (a.row_argmax(0) == b.row_argmax(0) if pipeline.head_argmax
                   else np.array_equal(a.row_logits(0), b.row_logits(0)))
    path = workdir / f"bench-{n}.slot"
    t_save, size = best_of(repeats, lambda: save_slot(path, layout, tokens, rows))
    t_load, _ = best_of(repeats, lambda: load_slot(path, layout))
    return {"tokens": n, "prefill_s": t_prefill, "spill_s": t_spill, "restore_s": t_restore,
            "save_s": t_save, "load_s": t_load, "bytes": layout.nbytes(n), "file_bytes": size,
            "exact": exact and bool(same_logits)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--manifest", help="an existing build (default: build a synthetic one)")
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--backend", default="mil", choices=["mil", "coreml"])
    ap.add_argument("--precision", default="fp16", choices=["fp32", "fp16"])
    ap.add_argument("--tokens", default="128,512,1000",
                    type=lambda t: [int(x) for x in t.split(",")])
    ap.add_argument("--repeats", type=int, default=5, help="best of, for the copies")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="ane-spec-slots-") as tmp:
        workdir = Path(tmp)
        manifest = args.manifest
        if manifest is None:
            from ane_spec.model.synthetic import preset, write_synthetic_gguf
            from ane_spec.shards.build import BuildRequest, build

            gguf = write_synthetic_gguf(workdir / "m.gguf", preset(args.preset))
            build(gguf, workdir / "art", BuildRequest(topology="2,2" if args.preset == "small"
                                                      else "2,1", max_seq=args.max_seq))
            manifest = workdir / "art"
        _, pipeline = open_pipeline(manifest, args.backend, args.precision)
        lengths = [n for n in args.tokens if n < pipeline.max_seq]
        print(f"{pipeline.manifest.name}: {pipeline.config.num_layers} layers, context "
              f"{pipeline.max_seq}, {pipeline.backend.describe()}; K/V states "
              f"{StateLayout(pipeline).nbytes(pipeline.max_seq) / 2**20:.2f} MiB per full slot\n")
        print("| tokens | re-prefill | spill | restore | restore vs re-prefill | save file | "
              "load file (hash-checked) | K/V bytes | bit-exact |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
        ok = True
        for n in lengths:
            r = measure(pipeline, n, workdir, args.repeats)
            ok &= r["exact"]
            print(f"| {n} | {r['prefill_s']:.3f} s | {1e3 * r['spill_s']:.2f} ms | "
                  f"{1e3 * r['restore_s']:.2f} ms | {r['prefill_s'] / r['restore_s']:,.0f}x "
                  f"faster | {1e3 * r['save_s']:.2f} ms | {1e3 * r['load_s']:.2f} ms | "
                  f"{r['bytes'] / 2**20:.2f} MiB | {r['exact']} |")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
