"""What the prefill function costs a build: the same GGUF built without it (--prefill-t 0) and
with it (--prefill-t P), alternating, best of --reps each, wall and CPU seconds (all the
build's threads: the calibration runs beside the conversion).

    python scripts/bench_prefill_build.py [GGUF or catalog name] [--max-seq 1024] [--prefill-t 64]
                                          [--reps 2] [--out local-artifacts/bench-prefill-build]

Issue 33 bounds the ratio at 1.25x. Wall time on a loaded machine says little; the CPU seconds
are the steadier figure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

from ane_spec.model.resolve import resolve_model
from ane_spec.shards.build import BuildRequest, build


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", nargs="?", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--prefill-t", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", default="local-artifacts/bench-prefill-build")
    args = ap.parse_args()
    gguf = resolve_model(args.gguf)
    best: dict[int, tuple[float, float]] = {}
    for rep in range(args.reps):
        for p in (0, args.prefill_t):
            out = Path(args.out) / f"p{p}"
            shutil.rmtree(out, ignore_errors=True)
            cpu, wall = time.process_time(), time.perf_counter()
            build(gguf, out, BuildRequest(max_seq=args.max_seq, prefill_t=p))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            print(f"rep {rep + 1} --prefill-t {p}: {wall:.1f} s wall, {cpu:.1f} CPU s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            w, c = best.get(p, (wall, cpu))
            best[p] = (min(w, wall), min(c, cpu))
    (w0, c0), (w1, c1) = best[0], best[args.prefill_t]
    print(f"with / without the prefill function (best of {args.reps}): wall {w1:.1f} / "
          f"{w0:.1f} s = {w1 / w0:.2f}x, CPU {c1:.1f} / {c0:.1f} s = {c1 / c0:.2f}x")


if __name__ == "__main__":
    main()
