"""The Core ML worker's memory and copies: a slot swap at Phi-4-mini's K/V shape, and the feed ring.

    python scripts/bench_worker_memory.py [--part swap|ring|both] [--tokens 300] [--reps 3]
                                          [--tree PATH]

`--tree PATH` runs the same measurement on another checkout's `ane_spec` and test stand-in (an
export of an older commit, for the before figures: `git archive <commit> | tar -x -C PATH`).

**swap**: a build with Phi-4-mini's K/V states (32 layers, 8 KV heads, head dim 128, S = 2048:
64 states of [1, 8, 2048, 128], 256 MiB in fp16; the layers' other widths are small, which
changes nothing here) loaded through the Core ML worker (runtime/coreml_worker.py) on
coremltools 9.0's real Python over the test stand-in for its native layer
(tests/coreml_standin.py). A slot swap is what the daemon does to switch conversations: capture
the first n rows of the running state (`StateLayout.capture`) and install another
conversation's n rows into a state (`StateLayout.install`); `clear` (a fresh slot) is timed on
its own. Figures: the median time of --reps swaps, and the peak resident memory of this process
and of the worker during them (Linux VmHWM, reset through /proc/<pid>/clear_refs before the
swaps). The stand-in keeps states as fp16 arrays like Core ML and its calls copy as the bridge
copies, so the copies and the memory are the host side's; a Mac's own state and compute come on
top, the same before and after.

**ring**: the worker's pass (`_Handler.run_pass`, the real code) over 30 shards at S = 2048 with
Phi-4-mini's pass inputs (x [1, 3072, 4, 1], attn_mask [1, 1, 4, 2048], kv_write_mask
[1, 1, 2048, 4], RoPE tables [4, 96]), 1,000 passes at 20 passes/s on a simulated clock; the
programs are CoreMLProgram over a model that returns a fresh output of x's shape at once (what
Core ML's bridge hands back), so what is measured is what the feed ring holds: its bytes
(distinct arrays) after the last pass, and the most it held.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PHI_LAYERS, PHI_KV_HEADS, PHI_HEAD_DIM, CONTEXT = 32, 8, 128, 2048
PHI_HIDDEN, SHARDS, PASS_RATE = 3072, 30, 20.0


def _status(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as fh:  # "5": reset the peak RSS (VmHWM)
        fh.write("5")


def swap(args: argparse.Namespace, root: Path) -> None:
    from ane_spec.daemon.kv_state import StateLayout
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.probes.gates import open_pipeline
    from ane_spec.shards.build import BuildRequest, build
    from tests import coreml_standin

    for key, value in coreml_standin.child_env().items():
        os.environ[key] = value
    coreml_standin.install()
    art = Path(args.build) if args.build else root / "art"
    if not (art / "manifest.json").exists():
        gguf = write_synthetic_gguf(root / "phi-kv.gguf", preset(
            "tiny", num_layers=PHI_LAYERS, num_heads=PHI_KV_HEADS, num_kv_heads=PHI_KV_HEADS,
            head_dim=PHI_HEAD_DIM, hidden_size=64, ffn_size=64, vocab_size=512, rope_dims=None))
        started = time.perf_counter()
        build(gguf, art, BuildRequest(topology="8,8,8,8", max_seq=CONTEXT))
        print(f"built {art} in {time.perf_counter() - started:.0f} s", flush=True)
    _, pipeline = open_pipeline(art, "coreml", "fp16")
    layout = StateLayout(pipeline)
    shapes = {e.shape for e in layout.entries}
    print(f"states: {len(layout.entries)} x {sorted(shapes)}, "
          f"{layout.nbytes(CONTEXT) / 2**20:.0f} MiB in fp16")
    a, b = pipeline.new_state(), pipeline.new_state()
    n = args.tokens
    worker = pipeline.backend.worker
    worker.start()
    layout.capture(a, n)  # warm: slabs and the first calls' costs
    for pid in (os.getpid(), worker.pid):
        _reset_peak(pid)
    base = {pid: _status(pid, "VmRSS") for pid in (os.getpid(), worker.pid)}
    times, clears = [], []
    for _ in range(args.reps):
        started = time.perf_counter()
        rows = layout.capture(a, n)
        layout.install(b, rows, n)
        times.append(time.perf_counter() - started)
        del rows
        started = time.perf_counter()
        layout.clear(b)
        clears.append(time.perf_counter() - started)
    for label, pid in (("this process", os.getpid()), ("worker", worker.pid)):
        print(f"{label}: RSS before the swaps {base[pid] / 2**20:.0f} MiB, peak during them "
              f"{_status(pid, 'VmHWM') / 2**20:.0f} MiB, after {_status(pid, 'VmRSS') / 2**20:.0f}"
              f" MiB")
    print(f"slot swap of n={n} tokens (capture + install): median "
          f"{statistics.median(times) * 1e3:.0f} ms over {args.reps}; clear: median "
          f"{statistics.median(clears) * 1e3:.0f} ms")
    pipeline.backend.close()


class _InstantModel:
    """What CompiledMLModel.predict hands back, at once: a fresh float32 output of x's shape."""

    def predict(self, feed: dict, state: object = None) -> dict:
        import numpy as np

        return {"hidden": np.zeros(feed["x"].shape, np.float32)}


def ring(args: argparse.Namespace) -> None:
    import numpy as np

    from ane_spec.runtime import coreml_worker
    from ane_spec.runtime.coreml_backend import FEEDS, CoreMLProgram
    from tests import coreml_standin

    coreml_standin.install()
    clock = [0.0]
    FEEDS.clock = lambda: clock[0]
    handler = coreml_worker._Handler(None, "CPU_AND_NE", "Infrequent")
    names = ["x", "rope_cos", "rope_sin", "attn_mask", "kv_write_mask"]
    calls = []
    for k in range(SHARDS):
        handler.programs[k] = CoreMLProgram(_InstantModel(), names, ["hidden"],
                                            [f"layer_{k}_k", f"layer_{k}_v"])
        handler.states[k] = (k, object())
        calls.append((k, k))
    t = 4
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((1, PHI_HIDDEN, t, 1)).astype(np.float16),
              "rope_cos": rng.standard_normal((t, 96)).astype(np.float16),
              "rope_sin": rng.standard_normal((t, 96)).astype(np.float16),
              "attn_mask": np.zeros((1, 1, t, CONTEXT), np.float16),
              "kv_write_mask": np.zeros((1, 1, CONTEXT, t), np.float16)}

    def held() -> int:  # distinct arrays the ring keeps alive
        seen = {id(a): a.nbytes for entry in FEEDS._kept for a in entry[1].values()}
        return sum(seen.values())

    peak = 0
    for _ in range(args.passes):
        handler.run_pass(calls, [], [], 1, [], None, [], arrays=dict(inputs))
        clock[0] += 1 / PASS_RATE
        peak = max(peak, held())
    print(f"feed ring after {args.passes} passes of {SHARDS} shards at S={CONTEXT} "
          f"({PASS_RATE:.0f} passes/s): {held() / 2**20:.1f} MiB in {len(FEEDS)} entries "
          f"(most held: {peak / 2**20:.1f} MiB)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["swap", "ring", "both"], default="both")
    ap.add_argument("--tokens", type=int, default=300, help="the conversation's length n")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--passes", type=int, default=1000)
    ap.add_argument("--build", help="reuse this build folder (made on first run)")
    ap.add_argument("--tree", help="import ane_spec and the stand-in from this checkout")
    args = ap.parse_args()
    tree = Path(args.tree).resolve() if args.tree else Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(tree))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)
    root = Path(tempfile.mkdtemp(prefix="worker-memory-"))
    os.environ["ANE_SPEC_CACHE_DIR"] = str(root / "cache")
    print(f"code: {tree}")
    if args.part in ("ring", "both"):
        ring(args)
    if args.part in ("swap", "both"):
        swap(args, root)


if __name__ == "__main__":
    main()
