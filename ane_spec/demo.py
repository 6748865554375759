"""`ane-spec demo`: the whole toolchain on an embedded default, end to end, in about a minute.

It writes a small synthetic Phi-4-mini-layout model (random weights: the text is gibberish, the
numbers are real), compiles it to Core ML shards, runs the gates, generates with and without
speculation, and prints the command that serves it.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from ane_spec.bench.sweep import source_text, tiled_prompt
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.probes.gates import GATES, open_pipeline, run_gates
from ane_spec.runtime.backend import default_backend_name
from ane_spec.shards.build import BuildRequest, build

DEMO_MAX_SEQ = 512
DEMO_NEW_TOKENS = 64


def run_demo(out: str | Path = "local-artifacts/demo", *, say=print) -> dict:
    out = Path(out)
    started = time.monotonic()
    backend = default_backend_name()
    say("ane-spec demo: a synthetic model with the exact Phi-4-mini layout and RANDOM weights.")
    say("Its text is gibberish by construction; the build, the gates and the speed figures are "
        "real.\n")

    gguf = out / "tiny-phi4-layout.gguf"
    out.mkdir(parents=True, exist_ok=True)
    if not gguf.exists():
        write_synthetic_gguf(gguf, preset("tiny"))
    say(f"1. model  {gguf}  (3 layers, d=192, GQA 6/2, partial RoPE 24/32, vocab 1024)")

    artifacts = out / "build"
    result = build(gguf, artifacts, BuildRequest(topology="2,1", max_seq=DEMO_MAX_SEQ),
                   force=True, progress=lambda m: say(f"   {m}"))
    say(f"2. build  {artifacts}  ({len(result.built)} packages built, {len(result.reused)} "
        f"reused, {result.seconds:.1f}s)")

    say("3. gates")
    for precision in ("fp32", "fp16") if backend == "mil" else (None,):
        reports = run_gates(artifacts, GATES if precision != "fp16" else ("block", "drift"),
                            backend=backend, precision=precision or "fp32", gguf=str(gguf))
        for r in reports:
            say(f"   {r.summary()}")

    say("4. generate (greedy; the same prompt with and without speculation)")
    _, pipeline = open_pipeline(artifacts, backend, "fp32", verify=False)
    # seeds/003's sweep method: a code text tiled to length, so repetition is there to find
    base = pipeline.tokenizer.encode(source_text("code"))
    prompt = tiled_prompt(base, DEMO_MAX_SEQ - DEMO_NEW_TOKENS - 8)
    runs = {}
    for speculative in (False, True):
        out_ = DecodeSession(pipeline).generate(prompt, GenerateOptions(
            max_tokens=DEMO_NEW_TOKENS, speculative=speculative))
        runs[speculative] = out_
        label = "speculative (n-gram + T=4 verify)" if speculative else "plain T=1 greedy"
        say(f"   {label}: {out_.stats.summary()}")
    same = runs[True].tokens == runs[False].tokens
    plain_rate = runs[False].stats.to_dict()["decode_tok_s"]
    spec_rate = runs[True].stats.to_dict()["decode_tok_s"]
    say(f"   identical tokens: {'yes' if same else 'NO'}; speedup "
        f"{spec_rate / plain_rate:.2f}x on {pipeline.backend.describe()}")
    say(f"   (the prompt: {len(prompt)} tokens of Python stdlib source, tiled)")

    say(f"\nDone in {time.monotonic() - started:.0f}s. Serve it to any OpenAI client with:")
    say(f"   ane-spec serve --manifest {artifacts}")
    if shutil.which("ane-spec") is None:
        say(f"   ({sys.executable} -m ane_spec.cli serve --manifest {artifacts})")
    return {"identical": same, "speedup": spec_rate / plain_rate, "manifest": str(artifacts)}
