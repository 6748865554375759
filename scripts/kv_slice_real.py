"""`--kv-write slice` on the real catalog models: the checks of tests/test_kv_slice.py on files
people download, too slow for the suite (see the README's figures).

    python scripts/kv_slice_real.py [MODEL ...] [--out local-artifacts/kv-slice-real]
                                    [--max-seq 1024] [--no-probes]

MODEL: catalog names (default: smollm2-135m-instruct qwen2.5-coder-0.5b-instruct). Each is built
twice with the default settings at --max-seq (the suite's real builds use 1024), scatter and
slice, into --out (kept, and reused when the folder holds a build already). Then, in the fp16
interpreter (the ANE's arithmetic):

- every prompt's prefill rows, 4 a pass, and the prefill function's last-row logits: the slice
  build's equal the scatter build's, bit for bit, and so does every state after every pass;
- fp16 speculative decoding on the slice build equals its greedy decoding and the scatter
  build's, token for token, on two chat prompts (those of tests/test_real_decoding.py);
- the block, overflow and row-invariance probes pass on the slice build (--no-probes: skipped).

Prints one line per check with its time; exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from ane_spec.decode.generate import prompt_tokens
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.pull import pull
from ane_spec.probes.block import run_block
from ane_spec.probes.gates import open_pipeline
from ane_spec.probes.overflow import run_overflow
from ane_spec.probes.row_invariance import run_row_invariance, state_arrays
from ane_spec.runtime.pipeline import ShardPipeline
from ane_spec.shards.build import BuildRequest, build

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.test_real_decoding import SPEC_CHATS  # noqa: E402 - the real-model suite's prompts

CHATS = SPEC_CHATS
FORMS = ("scatter", "slice")


def built(name: str, out: Path, max_seq: int) -> dict[str, Path]:
    gguf = pull(name)
    folders = {}
    for form in FORMS:
        folder = out / f"{name}-{form}"
        if not (folder / "manifest.json").is_file():
            t0 = time.perf_counter()
            build(gguf, folder, BuildRequest(max_seq=max_seq, kv_write=form))
            print(f"{name}: {form} build {time.perf_counter() - t0:.0f}s", flush=True)
        folders[form] = folder
    return folders


def same_bits(pipes: dict[str, ShardPipeline], prompt: list[int]) -> tuple[int, bool]:
    """Prefill `prompt` 4 rows a pass, then again through the prefill function: every row's
    logits and every state the same in both builds. Returns (rows compared, all equal)."""
    rows, equal = 0, True
    states = {f: p.new_state() for f, p in pipes.items()}
    for start in range(0, len(prompt), 4):
        out = {f: p.run(prompt[start:start + 4], start, states[f]) for f, p in pipes.items()}
        for r in range(out["slice"].rows):
            equal &= np.array_equal(out["scatter"].row_native(r), out["slice"].row_native(r))
            rows += 1
        equal &= all(np.array_equal(a, b) for a, b in zip(
            *(state_arrays(pipes[f], states[f]) for f in FORMS)))
    p = pipes["slice"].prefill_t
    if p:
        states = {f: pipe.new_state() for f, pipe in pipes.items()}
        for start in range(0, len(prompt), p):
            out = {f: pipe.run_prefill(prompt[start:start + p], start, states[f], head=True)
                   for f, pipe in pipes.items()}
            equal &= np.array_equal(out["scatter"].row_native(0), out["slice"].row_native(0))
            rows += 1
        equal &= all(np.array_equal(a, b) for a, b in zip(
            *(state_arrays(pipes[f], states[f]) for f in FORMS)))
    return rows, bool(equal)


def check(name: str, folders: dict[str, Path], probes: bool) -> bool:
    pipes = {f: open_pipeline(folder, "mil", "fp16")[1] for f, folder in folders.items()}
    ok = True
    for chat in CHATS[name]:
        prompt = prompt_tokens(pipes["slice"], messages=chat)
        t0 = time.perf_counter()
        rows, equal = same_bits(pipes, prompt)
        print(f"{name}: {len(prompt)}-token prompt, {rows} rows: slice == scatter bitwise "
              f"(logits and states): {equal} ({time.perf_counter() - t0:.0f}s)", flush=True)
        t0 = time.perf_counter()
        greedy = DecodeSession(pipes["slice"]).generate(
            prompt, GenerateOptions(max_tokens=48, speculative=False))
        spec = DecodeSession(pipes["slice"]).generate(prompt, GenerateOptions(max_tokens=48))
        other = DecodeSession(pipes["scatter"]).generate(prompt, GenerateOptions(max_tokens=48))
        same = spec.tokens == greedy.tokens == other.tokens
        print(f"{name}: fp16 speculative == greedy == scatter's greedy: {same}; "
              f"{len(spec.tokens)} tokens, {spec.stats.passes} passes, drafted "
              f"{spec.stats.drafted}, accepted {spec.stats.accepted} "
              f"({time.perf_counter() - t0:.0f}s)", flush=True)
        ok &= equal and same
    if probes:
        for run in (run_block, run_row_invariance, run_overflow):
            t0 = time.perf_counter()
            report = run(pipes["slice"])
            print(f"{name}: {report.summary()} ({time.perf_counter() - t0:.0f}s)", flush=True)
            ok &= report.passed
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*", default=list(CHATS))
    ap.add_argument("--out", type=Path, default=Path("local-artifacts/kv-slice-real"))
    ap.add_argument("--max-seq", type=int, default=1024)
    ap.add_argument("--no-probes", action="store_true")
    args = ap.parse_args()
    ok = True
    for name in args.models:
        if name not in CHATS:
            ap.error(f"no prompts for {name!r}; choose from {', '.join(CHATS)}")
        ok &= check(name, built(name, args.out, args.max_seq), not args.no_probes)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
