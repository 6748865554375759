"""What the Core ML worker process costs per pass: the process boundary, at 4 rows read.

    python scripts/bench_worker_boundary.py [--context 2048] [--passes 300] [--reps 5]

Core ML runs in a worker process (runtime/coreml_worker.py): each program's prediction is one
message on a pipe, its inputs and outputs cross through shared memory. This measures what that
adds to a decode pass over running Core ML in the caller's process, with everything else equal:
the same build as scripts/bench_host_overhead.py (the real 200,064-token vocabulary in 4 head
chunks, S = 2048, one small layer: host work depends on the vocabulary and S, not the layers),
the same pass (T = 4, fixed decode shape) reading all 4 rows of logits (argmax of each, the
NaN check included), on coremltools 9.0's real Python over the test stand-in for its native
layer (tests/coreml_standin.py) with its `replay` rule: a prediction returns the first result
at its shapes again, computed in no time, still copied out as the bridge copies it. So the
figures are host and boundary costs only; on a Mac the Neural Engine's compute comes on top of
both, the same for both. Passes alternate in blocks between the two pipelines so that the
machine's load falls on both alike; the figure is the median per pass, the least of --reps
medians (other processes only ever add time). On a machine with more runnable threads than
cores, each hand-over between the two processes waits for a core, so the wall figure also
reports CPU time per pass (this process, plus the worker's own), which waiting does not
inflate. The pass's drafts are the argmax of the rows before them (all accepted, as when greedy
decoding reads all 4 rows); --unchained reads all 4 rows of a pass whose drafts do not chain.
Target: <= 0.3 ms per pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import coreml_standin  # noqa: E402 - the stand-in lives with the tests

VOCAB = 200064


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--passes", type=int, default=300)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--unchained", action="store_true",
                    help="pass tokens whose drafts greedy decoding would reject at row 0, still "
                         "reading all 4 rows (each later row is then its own call to the worker)")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="worker-boundary-"))
    os.environ["ANE_SPEC_CACHE_DIR"] = str(root / "cache")
    for key, value in (coreml_standin.child_env() | coreml_standin.rules_env(replay=True)
                       ).items():
        os.environ[key] = value
    coreml_standin.install()  # this process too (it reads the rules from the environment)

    from ane_spec.manifests.store import load_manifest
    from ane_spec.model.synthetic import preset, write_synthetic_gguf
    from ane_spec.runtime.backend import make_backend
    from ane_spec.runtime.coreml_backend import CoreMLBackend
    from ane_spec.runtime.pipeline import ShardPipeline
    from ane_spec.shards.build import BuildRequest, build

    gguf = write_synthetic_gguf(root / "m.gguf", preset("tiny", num_layers=1, vocab_size=VOCAB))
    build(gguf, root / "art", BuildRequest(max_seq=args.context, head_chunks=4))
    loaded = load_manifest(root / "art")
    pipelines = {"in_process": ShardPipeline(loaded, CoreMLBackend()),
                 "worker": ShardPipeline(loaded, make_backend("coreml"))}
    tokens = [11, 12, 13, 14]

    def one_pass(pipeline, state, position: int) -> float:  # noqa: ANN001
        t0 = time.perf_counter()
        out = pipeline.run(tokens, position, state)
        for row in range(4):
            out.row_argmax(row)
        return time.perf_counter() - t0

    states = {name: p.new_state() for name, p in pipelines.items()}
    for name, p in pipelines.items():  # first calls compute (and fill the replay)
        for _ in range(20):
            one_pass(p, states[name], 100)
    if not args.unchained:
        # Greedy decoding reads 4 rows when all 3 drafts are accepted: each draft is the argmax
        # of the row before. The replayed outputs do not depend on the tokens, so drafts taken
        # from them make every pass an all-accepted one.
        out = pipelines["in_process"].run(tokens, 100, states["in_process"])
        tokens[1:] = [out.row_argmax(row) for row in range(3)]
    medians: dict[str, list[float]] = {name: [] for name in pipelines}
    cpu: dict[str, list[float]] = {name: [] for name in pipelines}
    worker = pipelines["worker"].backend.worker
    for _ in range(args.reps):
        seconds: dict[str, list[float]] = {name: [] for name in pipelines}
        used = {name: 0.0 for name in pipelines}
        for _ in range(args.passes // 20):
            for name, p in pipelines.items():
                c0 = time.process_time()
                w0 = worker.cpu_seconds() if name == "worker" else 0.0
                seconds[name] += [one_pass(p, states[name], 100) for _ in range(20)]
                w1 = worker.cpu_seconds() if name == "worker" else 0.0
                used[name] += time.process_time() - c0 + (w1 - w0)
        for name in pipelines:
            medians[name].append(statistics.median(seconds[name]))
            cpu[name].append(used[name] / len(seconds[name]))
    best = {name: min(m) for name, m in medians.items()}
    report = {"vocab": VOCAB, "context": args.context, "rows_read": 4, "width": 4,
              "drafts": "rejected" if args.unchained else "accepted",
              "shards": len(loaded.manifest.shards), "head_chunks": 4,
              "ms_per_pass": {k: round(1000 * v, 4) for k, v in best.items()},
              "medians_ms": {k: [round(1000 * x, 4) for x in v] for k, v in medians.items()},
              "boundary_ms_per_pass": round(1000 * (best["worker"] - best["in_process"]), 4),
              "cpu_ms_per_pass": {k: round(1000 * min(v), 4) for k, v in cpu.items()},
              "boundary_cpu_ms_per_pass": round(1000 * (min(cpu["worker"])
                                                        - min(cpu["in_process"])), 4),
              "target_ms": 0.3}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
