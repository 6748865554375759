"""Benchmark: the build of a K-quant (Q4_K_M) source against the Q8_0 source of the same model.

    python scripts/bench_quant_build.py --gguf MODEL.gguf [--max-seq 2048] [--repeats 1]
    python scripts/bench_quant_build.py --preset phi4-mini      # writes a real-size synthetic

Issue 27's target: a K-quant source costs at most 1.25x the Q8_0 build of the same model, with
peak RSS within the Phi-4-mini build's budget (3.5 GB). Both files are made from the one given,
with llama.cpp's own quantizer (`llama_model_quantize` through llama-cpp-python, requantizing
allowed, in a child process: native code that can crash stays out of this one): the Q8_0 from
a K-quant file, the Q4_K_M from a Q8_0 one. Each build runs in a child that reports its own
VmHWM (bench_build.run_measured), one after the other, alternating with `--repeats`, with the
default `--weights auto`; the best of the repeats counts, since the machine is shared, and the
children's CPU seconds are reported beside the wall times (other sessions' load inflates wall
time far more than CPU time).
Everything this run writes goes under --workdir and is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_build import run_measured  # noqa: E402

from ane_spec.model.gguf_file import open_gguf  # noqa: E402

# llama_ftype values (llama.h): what llama_model_quantize writes.
FTYPES = {"Q8_0": 7, "Q4_K_M": 15}

_QUANTIZE_CHILD = """
import ctypes, sys
import llama_cpp.llama_cpp as L
L.llama_backend_init()
params = L.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.allow_requantize = True
params.nthread = max(1, len(__import__("os").sched_getaffinity(0)))
rc = L.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params))
sys.exit(0 if rc == 0 else 3)
"""


def quantize(src: Path, dst: Path, ftype: str) -> float:
    """llama.cpp's quantizer, src -> dst as `ftype`; returns its wall seconds."""
    import time

    start = time.monotonic()
    child = subprocess.run([sys.executable, "-c", _QUANTIZE_CHILD, str(src), str(dst),
                            str(FTYPES[ftype])], capture_output=True, text=True)
    if child.returncode or not dst.is_file():
        sys.exit(f"llama_model_quantize {src.name} -> {ftype} failed (exit {child.returncode}):"
                 f"\n{child.stderr[-2000:]}")
    return time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="a Q8_0 or K-quant file; the other is made from it")
    src.add_argument("--preset", help="write a real-size synthetic Q8_0 model of this preset")
    ap.add_argument("--workdir", default="local-artifacts/bench-quant")
    ap.add_argument("--max-seq", type=int, default=2048)
    ap.add_argument("--topology", default="auto")
    ap.add_argument("--weights", default="auto")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--keep", action="store_true",
                    help="keep the files this run made (and reuse them next time)")
    args = ap.parse_args()

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"benchmark": "quant-build", "max_seq": args.max_seq,
                                 "weights": args.weights, "load_average": os.getloadavg()[0]}
    files: dict[str, Path] = {}
    made: list[Path] = []
    try:
        if args.preset:
            given = work / f"{args.preset}.Q8_0.gguf"
            if not given.exists():
                wall, peak = run_measured(["synth", str(given), "--preset", args.preset,
                                           "--quiet"])
                made.append(given)
                report["synth_s"] = round(wall, 1)
        else:
            given = Path(args.gguf)
        kind = open_gguf(given).file_type_name
        report["given"] = {"path": str(given), "file_type": kind}
        target = "Q4_K_M" if kind == "Q8_0" else "Q8_0"
        files[kind], files[target] = given, work / f"{given.stem}.{target}.gguf"
        if files[target].exists() and args.keep:  # kept by an earlier --keep run
            report["quantize_s"] = "reused"
        else:
            made.append(files[target])
            report["quantize_s"] = round(quantize(given, files[target], target), 1)
        kquant = next(k for k in files if k != "Q8_0")
        results: dict[str, list[tuple[float, int, float]]] = {k: [] for k in files}
        for _ in range(args.repeats):
            for k, path in files.items():
                out = work / f"build-{k}"
                shutil.rmtree(out, ignore_errors=True)
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                wall, peak = run_measured([
                    "build", str(path), "--out", str(out), "--topology", args.topology,
                    "--max-seq", str(args.max_seq), "--weights", args.weights])
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                # CPU seconds of the build child: what other sessions' load on a shared
                # machine disturbs least (wall time counts their share of the cores too).
                cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
                results[k].append((wall, peak, cpu))
                manifest = json.loads((out / "manifest.json").read_text())
                formats: dict[str, int] = {}
                for p in [*manifest["shards"], *manifest["heads"]]:
                    for t in p["quant"].get("tensors", {}).values():
                        formats[t["format"]] = formats.get(t["format"], 0) + 1
                report.setdefault("formats", {})[k] = formats
                shutil.rmtree(out, ignore_errors=True)
        for k, runs in results.items():
            report[k] = {"file_gb": round(files[k].stat().st_size / 1e9, 3),
                         "build_wall_s": round(min(w for w, _, _ in runs), 1),
                         "all_walls_s": [round(w, 1) for w, _, _ in runs],
                         "build_cpu_s": round(min(c for _, _, c in runs), 1),
                         "all_cpu_s": [round(c, 1) for _, _, c in runs],
                         "peak_rss_gb": round(max(p for _, p, _ in runs) / 1e9, 2)}
        ratio = report[kquant]["build_wall_s"] / report["Q8_0"]["build_wall_s"]
        report["ratio_kquant_over_q8_0"] = round(ratio, 3)
        report["cpu_ratio_kquant_over_q8_0"] = round(
            report[kquant]["build_cpu_s"] / report["Q8_0"]["build_cpu_s"], 3)
        report["target"] = {"ratio": 1.25, "peak_rss_gb": 3.5}
        report["meets_target"] = bool(ratio <= 1.25 and all(
            report[k]["peak_rss_gb"] <= 3.5 for k in files))
    finally:
        if not args.keep:
            for p in made:
                p.unlink(missing_ok=True)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
