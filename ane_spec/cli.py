"""`ane-spec`: argument parsing only. Every subcommand calls a plain function the tests also call."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from ane_spec.errors import AneSpecError, one_line, untrusted
from ane_spec.runtime.decode_shape import DECODE_SHAPES, PREFILL_MODES

if TYPE_CHECKING:
    from pathlib import Path

    from ane_spec.model.hash_process import HashesAhead

Handler = Callable[[argparse.Namespace], int]

EXIT_USER_ERROR = 2   # bad input, a tampered build, a full disk: one line on stderr
EXIT_BUG = 70         # EX_SOFTWARE: anything else escaping is a bug in ane-spec


def _parse_tokens(text: str) -> list[int]:
    try:
        tokens = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not tokens:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return tokens


# --- model contract -------------------------------------------------------------------------

def _model_path(arg: str):
    """A GGUF path, catalog name (pulled if not cached) or ollama:NAME[:TAG], as a file path."""
    from ane_spec.model.resolve import resolve_model

    return resolve_model(arg, say=lambda msg: print(msg, file=sys.stderr, flush=True))


def cmd_pull(args: argparse.Namespace) -> int:
    from ane_spec.model.catalog import CATALOG
    from ane_spec.model.pull import cached_path, is_cached, pull

    if args.list:
        for entry in CATALOG.values():
            state = f"cached: {cached_path(entry)}" if is_cached(entry) else "not cached"
            print(f"{entry.name:30} {entry.size / 1e6:7,.1f} MB  {entry.title}  ({state})")
        return 0
    if not args.name:
        raise AneSpecError("name a catalog model (`ane-spec pull --list` lists them)")
    print(pull(args.name, verify=args.verify))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.manifests.inspect_build import describe_build, format_build
    from ane_spec.model.inspect import describe, format_description

    if Path(args.gguf).is_dir():  # a build folder: what each tensor got, and why
        d = describe_build(Path(args.gguf))
        print(json.dumps(d, indent=2) if args.json else format_build(d))
        return 0
    d = describe(open_gguf(_model_path(args.gguf)))
    print(json.dumps(d, indent=2) if args.json else format_description(d))
    return 0


def cmd_tokenize(args: argparse.Namespace) -> int:
    from ane_spec.model.gguf_file import open_gguf
    from ane_spec.model.tokenizer import Tokenizer

    tok = Tokenizer.from_data(open_gguf(_model_path(args.gguf)).tokenizer_data)
    print(json.dumps(tok.encode(args.text, special=args.special)))
    return 0


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    if (args.gguf is None) == (args.manifest is None):
        raise AneSpecError("logits takes either a GGUF file (reference forward pass) or "
                           "--manifest (the built artifacts), not both")
    if args.manifest is not None:
        from ane_spec.probes.gates import open_pipeline
        from ane_spec.runtime.pipeline import prefill_logits

        _, pipeline = open_pipeline(args.manifest, args.backend, args.precision,
                                    verify=not args.no_verify, decode_shape=args.decode_shape,
                                    prefill=args.prefill)
        logits = prefill_logits(pipeline, args.tokens)
        source = f"artifacts, {pipeline.backend.describe()}, T={pipeline.max_t} prefill"
    else:
        from ane_spec.model.gguf_file import open_gguf
        from ane_spec.model.reference import ReferenceModel

        model = ReferenceModel(open_gguf(_model_path(args.gguf)), context_window=args.context)
        logits = model.logits(args.tokens)
        source = f"reference, {model.rope.factor_set} RoPE factors, context {args.context}"
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: logits {logits.shape[0]} x {logits.shape[1]} ({source})",
          file=sys.stderr)
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ane_spec.model.synthetic import preset, write_synthetic_gguf

    spec = preset(args.preset, num_layers=args.layers, hidden_size=args.hidden,
                  num_heads=args.heads, num_kv_heads=args.kv_heads, ffn_size=args.ffn,
                  vocab_size=args.vocab, rope_dims=args.rope_dims, embed_std=args.embed_std,
                  arch=args.arch, head_dim=args.head_dim,
                  branch_scale=args.branch_scale, weight_type=args.weights, seed=args.seed,
                  tied_embeddings=False if args.untied else None)
    with tqdm(desc=f"writing {args.out}", unit="tensor", disable=args.quiet) as bar:
        def progress(name: str, done: int, total: int) -> None:
            bar.total = total
            bar.set_postfix_str(name, refresh=False)
            bar.update(done - bar.n)

        path = write_synthetic_gguf(args.out, spec, progress)
    print(f"wrote {path} ({path.stat().st_size / 1e6:,.1f} MB, "
          f"{spec.to_config().num_parameters() / 1e6:,.1f}M params, random weights)")
    return 0


# --- shard compiler ---------------------------------------------------------------------------

def cmd_build(args: argparse.Namespace) -> int:
    from ane_spec.model.hash_process import start_if_worth_it

    tuned = _tuned_options(args)   # a bad --tuned file is named before the model is looked up
    gguf = _model_path(args.gguf)
    # Before the imports below (~3 s of one core): a child hashes the file on the other.
    ahead = start_if_worth_it(gguf)
    try:
        return _build(args, gguf, tuned, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _build(args: argparse.Namespace, gguf: Path, tuned: dict,
           hashes_ahead: HashesAhead | None) -> int:
    from tqdm import tqdm

    from ane_spec.shards.frozen_heap import collector_paused

    with collector_paused():
        from ane_spec.shards.build import BuildRequest, build

    request = BuildRequest(topology=args.topology, max_seq=args.max_seq, weights=args.weights,
                           head_chunks=args.head_chunks,
                           head_argmax=args.head_argmax, max_shard_mb=args.max_shard_mb,
                           max_head_mb=args.max_head_mb,
                           min_weight_cosine=args.min_weight_cosine,
                           residual_scale=args.residual_scale,
                           force_ane_limits=args.force_ane_limits,
                           swa_ring=not args.no_swa_ring, **tuned)
    result = build(gguf, args.out, request, force=args.force, hashes_ahead=hashes_ahead,
                   progress=lambda msg: tqdm.write(f"[build] {msg}", file=sys.stderr))
    for line in result.summary:
        print(line)
    print(f"built {len(result.built)} and reused {len(result.reused)} packages in "
          f"{result.seconds:.1f}s -> {result.manifest_path}")
    global _teardown_skippable
    _teardown_skippable = True
    return 0


def _tuned_options(args: argparse.Namespace) -> dict:
    """The tuned build options (layout, mask form, head layout, prefill P, K/V write): each as
    given on the command line, else as `--tuned tune.json` chose it, else left to BuildRequest's
    default. A flag given explicitly wins over the file, and that is said."""
    from ane_spec.bench.tune_model import DIMENSIONS, load_tune

    options = {d: getattr(args, d) for d in DIMENSIONS if getattr(args, d) is not None}
    if not args.tuned:
        return options
    tuned = load_tune(args.tuned)
    if tuned.backend.startswith("mil"):
        print(f"[build] note: {args.tuned} was measured on the MIL interpreter, not a device: "
              "its choices rank the interpreter's costs", file=sys.stderr)
    for d, choice in tuned.choices.items():
        if d in options:
            if options[d] != choice.value:
                print(f"[build] {choice.flag} {options[d]} given: it wins over {args.tuned}'s "
                      f"{choice.value}", file=sys.stderr)
            continue
        options[d] = choice.value
        print(f"[build] tuned: {choice.flag} {choice.value} (from {args.tuned}: "
              f"{choice.rests_on.split(';')[0]})", file=sys.stderr)
    return options


def cmd_tune(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ane_spec.bench import tune_source
    from ane_spec.bench.tune import run_tune
    from ane_spec.bench.tune_report import write_tune
    from ane_spec.runtime.backend import default_backend_name

    out = Path(args.out)
    backend = default_backend_name() if args.backend == "auto" else args.backend
    label = ("coreml (CPU_AND_NE, in a worker process)" if backend == "coreml"
             else "mil (the fp16 MIL interpreter; Core ML does not run here)")
    draft = None
    if args.draft_model or args.draft_only:
        if not (args.manifest and args.draft_model):
            raise AneSpecError("--draft-model is measured beside a build: give --manifest too"
                               if args.draft_model else "--draft-only needs --draft-model and "
                               "--manifest")
        from ane_spec.manifests.store import load_manifest

        from ane_spec.bench.tune_draft import prompt_tokens

        args.backend, args.draft_units = backend, None
        target = load_manifest(args.manifest)
        prompt_tokens(target.manifest.build.max_seq, args.draft_tokens)
        draft = _draft_folder(args, target)
    if args.draft_only:  # the build is the target as it is: no variant, no source GGUF needed
        gguf, (request, source) = None, tune_source.options_of(target)
        args.dimensions = []
    elif args.manifest:
        gguf, request, source = tune_source.from_manifest(args.manifest)
    else:
        # Beside the variants' builds: removed with them unless --keep-builds.
        gguf, request, source = tune_source.synthetic(out / "variants", args.preset,
                                                      args.layers, args.max_seq, args.vocab)
    say = lambda msg: print(f"[tune] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    say(f"backend {label}; {source}")
    if backend == "mil":
        say("timings here are the MIL interpreter's on this CPU, not the Neural Engine's")

    def row_done(row) -> None:  # noqa: ANN001
        timing = f", decode {row.decode_ms:.4g} ms" if row.decode_ms is not None else ""
        say(f"{row.name}: {row.outcome}{timing}" + (f" ({row.reason})" if row.reason else ""))

    result = run_tune(gguf, out, request, backend=backend, backend_label=label, source=source,
                      reps=args.reps, warmup=args.warmup, deadline_s=args.deadline,
                      bits=args.bits, dimensions=args.dimensions, margin=args.margin,
                      keep_builds=args.keep_builds, progress=say, on_row=row_done)
    if draft is not None:
        from ane_spec.bench.tune_draft import run_draft_tune

        result.draft = run_draft_tune(args.manifest, draft, backend=backend, margin=args.margin,
                                      deadline_s=args.deadline, new_tokens=args.draft_tokens,
                                      max_seq=request["max_seq"], progress=say)
    json_path, md_path = write_tune(result, out)
    for d, c in result.choices.items():
        print(f"{d}: {c.flag} {c.value}" + ("" if c.measured else " (default: nothing passed)"))
    bad = [r for r in result.variants if r.outcome not in ("ok", "skipped")]
    print(f"wrote {json_path} and {md_path}: {len(result.variants)} variants, "
          f"{len(bad)} not ok" + ("; timings are the interpreter's, not the device's"
                                  if backend == "mil" else ""))
    if result.variants:
        print(f"apply with: ane-spec build MODEL --out DIR --tuned {json_path}")
    if result.draft is not None:
        choice = result.draft.choice
        print(f"draft model: serve with {choice.serve_flags.replace('DRAFT', draft)}"
              if choice.use_draft else "draft model: serve without --draft-model "
              f"({choice.rests_on})")
    return 0


# --- gates and probes -------------------------------------------------------------------------

def _print_reports(reports: list, as_json: bool) -> bool:
    for r in reports:
        print(json.dumps(r.to_dict(), default=float) if as_json else r.summary())
    return all(r.passed or r.skipped for r in reports)


def cmd_probe_gates(args: argparse.Namespace) -> int:
    from ane_spec.probes.gates import GATES, platform_note, run_gates

    gates = GATES if args.gate == "all" else (args.gate,)
    if args.gate == "all" and not args.json:
        print(platform_note(), file=sys.stderr)
    reports = run_gates(args.manifest, gates, backend=args.backend, precision=args.precision,
                        gguf=args.gguf, verify=not args.no_verify, decode_shape=args.decode_shape,
                        strict=args.strict)
    return 0 if _print_reports(reports, args.json) else 1


def cmd_probe_synthetic(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ane_spec.probes.gates import residency_or_lint
    from ane_spec.probes.synthetic import build_synthetic_t4, probe_block
    from ane_spec.runtime.backend import make_backend

    path, config, max_seq = build_synthetic_t4(args.dims, Path(args.out), args.layout)
    backend = make_backend(args.backend, precision=args.precision)
    reports = [probe_block(path, config, max_seq, args.layout, backend, "synthetic-t4"),
               residency_or_lint(path)]
    return 0 if _print_reports(reports, args.json) else 1


def cmd_probe_layer(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ane_spec.probes.gates import residency_or_lint
    from ane_spec.probes.synthetic import build_gguf_layer, probe_block
    from ane_spec.runtime.backend import make_backend

    path, config = build_gguf_layer(_model_path(args.gguf), args.layer, Path(args.out), args.max_seq,
                                    args.layout, args.weights)
    backend = make_backend(args.backend, precision=args.precision)
    reports = [probe_block(path, config, args.max_seq, args.layout, backend, "layer"),
               residency_or_lint(path)]
    return 0 if _print_reports(reports, args.json) else 1


def cmd_doctor(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ane_spec.probes.doctor import run_doctor
    from ane_spec.probes.doctor_report import to_json, to_lines, to_markdown, write_atomically

    def save(done: list) -> None:  # after every check: a crash later loses nothing
        if args.out:
            out = Path(args.out)
            write_atomically(out, to_markdown(done, args.manifest))
            write_atomically(out.with_suffix(".json"), to_json(done, args.manifest))

    draft = None
    if args.draft_model:
        if not args.manifest:
            raise AneSpecError("--draft-model is measured beside a build: give --manifest too")
        from ane_spec.manifests.store import load_manifest

        args.backend = "coreml"  # the draft's units are Core ML's (_draft_folder checks them)
        draft = _draft_folder(args, load_manifest(args.manifest))
    checks = run_doctor(args.manifest, decode_shape=args.decode_shape, gguf=args.gguf,
                        progress=lambda msg: print(f"[doctor] {msg}", file=sys.stderr),
                        on_check=save, strict=args.strict, draft=draft,
                        draft_units=args.draft_units)
    print(to_json(checks, args.manifest) if args.json else to_lines(checks))
    if args.out:
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.json')}", file=sys.stderr)
    return 1 if any(c.status == "failed" for c in checks) else 0


def _add_backend_args(p: argparse.ArgumentParser, *, decode_shape: bool = True) -> None:
    from ane_spec.runtime.backend import default_backend_name

    p.add_argument("--backend", choices=["mil", "coreml"], default=default_backend_name(),
                   help="coreml (macOS) or the MIL interpreter (anywhere)")
    p.add_argument("--precision", choices=["fp32", "fp16"], default="fp32",
                   help="MIL interpreter arithmetic: fp32, or fp16 rounding of every op (ANE-like)")
    if not decode_shape:
        return
    p.add_argument("--decode-shape", choices=DECODE_SHAPES, default="fixed",
                   help="fixed (default): every pass computes 4 rows, so speculative output equals "
                        "greedy bitwise on a row-invariant backend; mixed: T=1 decode + T=4 "
                        "verify, cheaper where T=1 is much faster, exact only up to rounding. "
                        "Residency (MLComputePlan) is proven at T=4, the inputs' default "
                        "shape, only. mixed loads with reshapeFrequency Frequent and is "
                        "expected OFF the ANE (Apple's flexible-input guide: only Infrequent "
                        "runs flexible shapes on the Neural Engine; coremltools #2600 ran a "
                        "stateful RangeDim LLM wholly on the CPU); `doctor --decode-shape "
                        "mixed` measures where it runs")
    p.add_argument("--prefill", choices=PREFILL_MODES, default="auto",
                   help="prompts through the build's prefill function (--prefill-t P: P tokens "
                        "a pass, layers only, the head on the last token): auto (default) where "
                        "this backend's measured pass costs say it is cheaper than T=4 passes, "
                        "on for every chunk, off for none (T=4 passes, as builds without it)")


# decode/draft_policy.DRAFT_MODES and decode/draft_setup.DRAFT_UNITS (the parser imports
# nothing heavy: tests/test_quiet_imports.py)
DRAFT_MODES = ("both", "model", "ngram")
DRAFT_UNITS = ("ane", "gpu", "cpu")


def _add_draft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", metavar="M",
                   help="a smaller model of the same family drafts beside the n-gram drafter: a "
                        "GGUF, a catalog name, ollama:NAME or a build folder (a GGUF is built "
                        "once into local-artifacts/drafts/ with the target's context); its "
                        "vocabulary must match the target's (llama.cpp's rule)")
    p.add_argument("--draft-units", choices=DRAFT_UNITS, default=None,
                   help="Core ML compute units of the draft model: ane (default), gpu or cpu")
    p.add_argument("--draft-mode", choices=DRAFT_MODES, default="both",
                   help="who drafts: both (default; chosen per step from the n-gram match and "
                        "each source's recent acceptance), model, or ngram")
    overlap = p.add_mutually_exclusive_group()
    overlap.add_argument("--draft-overlap", dest="draft_overlap", action="store_true",
                         default=None, help="the draft looks past each block while the target "
                                            "verifies it (default: on; the draft runs in its "
                                            "own process)")
    overlap.add_argument("--no-draft-overlap", dest="draft_overlap", action="store_false",
                         help="draft only after each verify pass (serial)")


def _draft_folder(args: argparse.Namespace, target) -> str | None:  # noqa: ANN001
    """--draft-model as a build folder (built first from a GGUF if needed, once its vocabulary
    is found to match `target`'s, a LoadedManifest), or None."""
    if not getattr(args, "draft_model", None):
        return None
    from ane_spec.decode.draft_setup import check_units
    from ane_spec.model.vocab_compat import check_draft_vocab
    from ane_spec.shards.draft_build import draft_build

    check_units(args.backend, args.draft_units)  # before the draft is built, not after

    def check(vocab, name: str) -> None:  # noqa: ANN001
        check_draft_vocab(target.tokenizer_data(), vocab, target_name=target.manifest.name,
                          draft_name=name)

    return str(draft_build(args.draft_model, max_seq=target.manifest.build.max_seq,
                           say=lambda m: print(f"[draft] {m}", file=sys.stderr), check=check))


def _open_drafter(args: argparse.Namespace, pipeline):  # noqa: ANN001, ANN202
    """The draft model beside the n-gram drafter, or None without --draft-model."""
    folder = _draft_folder(args, pipeline.loaded)
    if folder is None:
        return None
    from ane_spec.decode.draft_setup import open_drafter

    drafter = open_drafter(pipeline, folder, units=args.draft_units, mode=args.draft_mode,
                           overlap=args.draft_overlap, ngram_min=args.ngram_min,
                           ngram_max=args.ngram_max, verify=not args.no_verify)
    if drafter.costs is not None:
        print(f"[draft] {folder}: {drafter.costs.to_dict()}", file=sys.stderr)
    return drafter


# --- decoding ---------------------------------------------------------------------------------

def cmd_generate(args: argparse.Namespace) -> int:
    from ane_spec.decode.generate import generate, load_chat_file, prompt_tokens
    from ane_spec.decode.sampling import SamplingParams
    from ane_spec.decode.session import GenerateOptions
    from ane_spec.probes.gates import open_pipeline

    _, pipeline = open_pipeline(args.manifest, args.backend, args.precision,
                                verify=not args.no_verify, decode_shape=args.decode_shape,
                                prefill=args.prefill)
    messages = load_chat_file(args.chat_file) if args.chat_file else None
    tokens = prompt_tokens(pipeline, prompt=args.prompt, messages=messages)
    options = GenerateOptions(
        max_tokens=args.max_tokens, stop=tuple(args.stop or ()),
        sampling=SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed),
        speculative=not args.no_speculative, guard=not args.no_guard)

    def stream(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    drafter = _open_drafter(args, pipeline)
    try:
        result = generate(pipeline, tokens, options, ngram_min=args.ngram_min,
                          ngram_max=args.ngram_max, trace_path=args.trace,
                          on_text=None if args.json else stream, drafter=drafter)
    finally:
        if drafter is not None:
            from ane_spec.decode.draft_setup import close_drafter

            close_drafter(drafter)
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        print(f"[{result.finish_reason}] {result.stats.summary()}", file=sys.stderr)
    return 0


# --- benchmarks -------------------------------------------------------------------------------

def cmd_sweep(args: argparse.Namespace) -> int:
    from ane_spec.bench.sweep import format_markdown, run_sweep, write_outputs
    from ane_spec.probes.gates import open_pipeline

    _, pipeline = open_pipeline(args.manifest, args.backend, args.precision,
                                verify=not args.no_verify, decode_shape=args.decode_shape,
                                prefill=args.prefill)
    drafter = _open_drafter(args, pipeline)
    try:
        result = run_sweep(pipeline, lengths=args.lengths, reps=args.reps,
                           new_tokens=args.new_tokens, source=args.source,
                           prompts_file=args.prompts_file, ngram_min=args.ngram_min,
                           ngram_max=args.ngram_max,
                           progress=lambda msg: print(msg, file=sys.stderr), drafter=drafter)
    finally:
        if drafter is not None:
            from ane_spec.decode.draft_setup import close_drafter

            close_drafter(drafter)
    paths = write_outputs(result, args.out)
    print(json.dumps(result) if args.json else format_markdown(result))
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0 if all(r["exact"] for r in result["rows"]) else 1


def cmd_bench_drafter(args: argparse.Namespace) -> int:
    from ane_spec.bench.drafter_bench import (
        BUILTIN_STREAMS_CAVEAT, CrossRequest, VllmNgramBaseline, format_markdown,
        format_side_by_side, losses, run_drafter_bench,
    )
    from ane_spec.bench.streams import builtin_streams, load_streams
    from ane_spec.bench.suffix_baseline import SuffixDecodingBaseline
    from ane_spec.decode.drafter import DraftMemory, NgramDrafter

    streams = load_streams(args.streams) if args.streams else builtin_streams(args.per_family)
    ngrams = {"ngram_min": args.ngram_min, "ngram_max": args.ngram_max}
    drafters = {
        "ane-spec": lambda: NgramDrafter(**ngrams),
        "ane-spec cross-request": CrossRequest(lambda: NgramDrafter(
            **ngrams, memory=DraftMemory(args.memory_tokens, ngram_max=args.ngram_max))),
        "suffix-decoding": CrossRequest(SuffixDecodingBaseline),
        "vllm-ngram": lambda: VllmNgramBaseline(**ngrams),
    }
    result = run_drafter_bench(streams, drafters, k=3, fill=args.fill)
    if args.json:
        print(json.dumps(result | {"caveat": None if args.streams else BUILTIN_STREAMS_CAVEAT}))
    else:
        print(format_side_by_side(result) + "\n" + format_markdown(result))
        if not args.streams:
            print(BUILTIN_STREAMS_CAVEAT)
    # The verdict is the pooled figure: with a few streams per family (the default is 4) one
    # family's figure is a handful of requests; scripts/bench_drafter.py judges every family on
    # 60 streams each.
    failed = False
    for ours, base in (("ane-spec", "vllm-ngram"), ("ane-spec cross-request", "suffix-decoding")):
        lost = losses(result, ours, base)
        if lost:
            print(f"{ours} has fewer tokens per pass than {base} on: " + ", ".join(
                f"{f} ({a:.3f} < {b:.3f})" for f, (a, b) in lost.items()), file=sys.stderr)
        failed |= "overall" in lost
    return 1 if failed else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from ane_spec.demo import run_demo

    if args.model is not None:
        from ane_spec.demo import run_model_demo

        result = run_model_demo(args.model, args.out, backend=args.backend,
                                max_seq=args.max_seq, max_tokens=args.max_tokens,
                                draft_model=args.draft_model)
    elif args.draft_model is not None:
        raise AneSpecError("--draft-model goes with --model (a real model and its draft)")
    else:
        result = run_demo(args.out, backend=args.backend)
    return 0 if result["identical"] else 1


def _add_ngram_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ngram-min", type=int, default=1, help="shortest suffix match to draft from")
    p.add_argument("--ngram-max", type=int, default=4, help="longest suffix match tried first")


def _add_probe_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layout", choices=["BCT1", "BC1T"], default="BCT1")
    p.add_argument("--out", default="local-artifacts/probes")
    p.add_argument("--json", action="store_true")
    _add_backend_args(p, decode_shape=False)  # one package's T=4 vs 4 x T=1: no decoding


# --- daemon -------------------------------------------------------------------------------------

def _serve_config(args: argparse.Namespace):
    import os

    from ane_spec.daemon.config import ServeConfig

    draft = None
    if args.draft_model:
        from ane_spec.manifests.store import load_manifest

        draft = _draft_folder(args, load_manifest(args.manifest, verify=False))

    return ServeConfig.create(
        manifest=args.manifest, host=args.host, port=args.port,
        api_key=args.api_key or os.environ.get("ANE_SPEC_API_KEY"),
        backend=args.backend, precision=args.precision, decode_shape=args.decode_shape,
        prefill=args.prefill, max_queue=args.max_queue,
        speculative=not args.no_speculative, ngram_min=args.ngram_min,
        ngram_max=args.ngram_max, guard=not args.no_guard,
        max_body_bytes=args.max_body_bytes, verify=not args.no_verify,
        model_name=args.model_name, log_level=args.log_level,
        allowed_origins=args.allowed_origins, allowed_hosts=args.allowed_hosts,
        special_in_content=args.special_in_content or None, body_timeout=args.body_timeout,
        kv_slots=args.kv_slots, slot_spill_mb=args.slot_spill_mb,
        slot_save_path=args.slot_save_path, slot_save_max_files=args.slot_save_max_files,
        slot_save_max_mb=args.slot_save_max_mb, draft_memory=args.draft_memory,
        draft_memory_tokens=args.draft_memory_tokens, request_timeout=args.request_timeout,
        grammar_token_ms=args.grammar_token_ms, grammar_queue=args.grammar_queue,
        grammar_wait=args.grammar_wait, draft_manifest=draft, draft_units=args.draft_units,
        draft_mode=args.draft_mode, draft_overlap=args.draft_overlap)


def cmd_serve(args: argparse.Namespace) -> int:
    from ane_spec.daemon.server import serve

    return serve(_serve_config(args))


def cmd_daemon_install(args: argparse.Namespace) -> int:
    from ane_spec.daemon.launchd import install_launch_agent

    result = install_launch_agent(_serve_config(args), print_only=args.print)
    if not result.written:
        sys.stdout.write(result.plist.decode())
    print(result.message, file=sys.stderr)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    # launchd.serve_arguments emits exactly these flag names: keep them in step.
    p.add_argument("--manifest", required=True, help="the build folder (or its manifest.json)")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default loopback); any other host needs an API key")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but "
                                     "/health (default: $ANE_SPEC_API_KEY)")
    p.add_argument("--max-queue", type=int, default=8,
                   help="requests that may wait behind the running one; more get 429")
    p.add_argument("--no-speculative", action="store_true",
                   help="plain greedy decoding, one token per pass (padded to T=4 in the "
                        "fixed decode shape, T=1 in the mixed one), unless a request asks for "
                        "speculation")
    p.add_argument("--ngram-min", type=int, help="drafter's shortest n-gram match")
    p.add_argument("--ngram-max", type=int, help="drafter's longest n-gram match")
    p.add_argument("--no-guard", action="store_true",
                   help="turn off the exactness guard (T=1 redo of near-tie rows) by default")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--no-verify", action="store_true", help="skip artifact hash checks at start")
    p.add_argument("--model-name", help="the model id clients see (default: the build's name)")
    p.add_argument("--allowed-origins", metavar="ORIGINS",
                   help="browser origins allowed to call the API (CORS), comma-separated, or "
                        "'*' for any; off by default: any web page could drive the model")
    p.add_argument("--allowed-hosts", metavar="HOSTS",
                   help="Host header names to answer besides localhost, 127.0.0.1, [::1] and "
                        "--host (DNS rebinding protection), comma-separated, or '*' for any")
    p.add_argument("--special-in-content", action="store_true",
                   help="parse special tokens (<|user|>, ...) written in message text, as "
                        "llama.cpp does; by default message text can never produce them")
    p.add_argument("--body-timeout", type=float,
                   help="seconds a client has to send a whole request body (default 60)")
    p.add_argument("--request-timeout", type=float,
                   help="seconds a generation may run; past them it ends with finish_reason "
                        "'length' (default 600)")
    p.add_argument("--grammar-token-ms", type=float,
                   help="milliseconds a grammar's token mask may cost per token on average; "
                        "past them the generation ends with an error (default 50)")
    p.add_argument("--grammar-queue", type=int,
                   help="new grammars that may wait to be compiled; more get 429 (default 8)")
    p.add_argument("--grammar-wait", type=float,
                   help="seconds a new grammar may wait to start compiling; past them 503 "
                        "(default 30)")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--kv-slots", type=int,
                   help="conversations kept resident at once (default: from the build's state "
                        "size and this machine's memory, printed at start)")
    p.add_argument("--slot-spill-mb", type=int,
                   help="host memory for evicted slots' K/V (default: 1/8 of RAM; 0: drop them)")
    p.add_argument("--slot-save-path", help="folder for POST /slots/ID?action=save|restore; "
                                            "slots saved there are loaded at start")
    p.add_argument("--slot-save-max-files", type=int,
                   help="slot files that saves may keep in that folder (default 32)")
    p.add_argument("--slot-save-max-mb", type=float,
                   help="total size of those files in MiB (default 4096)")
    p.add_argument("--draft-memory", choices=["per-key", "shared", "off"],
                   help="draft from earlier requests of the same API key + user, of everyone, "
                        "or not at all (default: per-key with an API key, else shared)")
    p.add_argument("--draft-memory-tokens", type=int,
                   help="tokens of earlier requests remembered per scope (default 65536)")
    _add_draft_args(p)
    _add_backend_args(p)


# --- parser -----------------------------------------------------------------------------------

BITS_CHOICES = ("interpreter", "row-invariance", "overflow", "parity")
DIMENSION_CHOICES = ("mask_form", "layout", "head_layout", "prefill_t", "kv_write")


def _names_of(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"{', '.join(bad) or 'nothing'}: choose from "
                                             f"{', '.join(allowed)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ane-spec",
        description="Phi-4-mini on the Apple Neural Engine: build shards, prove them, serve them.")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model_help = ("a GGUF path, a catalog model name (`ane-spec pull --list`; downloaded once "
                  "into the cache) or ollama:NAME[:TAG] (a model in Ollama's store)")
    p = sub.add_parser("demo", help="the whole toolchain on the shipped tiny-code model "
                                         "(start here), or on a real instruct model (--model)")
    p.add_argument("--out", default="local-artifacts/demo")
    p.add_argument("--backend", choices=["mil", "coreml"], default=None,
                   help="coreml on macOS, the MIL interpreter elsewhere (the default)")
    p.add_argument("--model", help="run the demo on this instruct model instead, with a chat "
                                   "prompt: " + model_help)
    p.add_argument("--max-seq", type=int, default=512,
                   help="with --model: the build's context window (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="with --model: the reply's length limit (default %(default)s)")
    p.add_argument("--draft-model", metavar="M",
                   help="with --model: a smaller model of the same family drafts for it (a "
                        "GGUF, a catalog name or ollama:NAME; built beside the target)")
    p.set_defaults(handler=cmd_demo)

    p = sub.add_parser("pull", help="download a catalog model (a real GGUF, sha256-pinned) into "
                                    "the cache and print its path")
    p.add_argument("name", nargs="?", help="catalog model name, e.g. smollm2-135m-instruct")
    p.add_argument("--list", action="store_true", help="list the catalog and what is cached")
    p.add_argument("--verify", action="store_true",
                   help="hash a cached file again instead of trusting its stamp")
    p.set_defaults(handler=cmd_pull)

    p = sub.add_parser("inspect", help="print a GGUF file's config, tensors and tokenizer facts, "
                                       "or a build folder's per-tensor weight formats")
    p.add_argument("gguf", help=model_help + "; or a build folder (its manifest.json)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("tokenize", help="print the token ids of a text as a JSON list")
    p.add_argument("gguf", help=model_help)
    p.add_argument("--text", required=True)
    p.add_argument("--special", action="store_true",
                   help="parse special tokens such as <|user|> written in the text")
    p.set_defaults(handler=cmd_tokenize)

    p = sub.add_parser("logits", help="dump float32 logits [T, vocab] for a token list")
    p.add_argument("gguf", nargs="?", help="GGUF file: logits from the reference forward pass")
    p.add_argument("--tokens", required=True, type=_parse_tokens, help="e.g. 1,2,3")
    p.add_argument("--context", type=int, default=4096,
                   help="context window; above the original 4096 the long RoPE factors apply")
    p.add_argument("--manifest", help="built artifacts: logits computed by the shards")
    p.add_argument("--out", required=True, help="output .npy file")
    p.add_argument("--no-verify", action="store_true", help="skip artifact hash checks")
    _add_backend_args(p)
    p.set_defaults(handler=cmd_logits)

    p = sub.add_parser("synth", help="write a synthetic GGUF with the exact layout of Phi-4-mini "
                                     "or of a Llama 3 / Qwen 2.5 / Qwen 3 / Gemma 3 model")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny",
                   choices=["tiny", "small", "phi4-mini", "llama-3.2-1b", "llama-3.2-3b",
                            "qwen2.5-3b", "qwen3-4b", "gemma-3-270m", "gemma-3-1b",
                            "gemma-3-4b", "gemma3-tiny"])
    from ane_spec.model.architectures import ARCHITECTURES

    p.add_argument("--arch", choices=list(ARCHITECTURES),
                   help="architecture (default: the preset's)")
    p.add_argument("--head-dim", type=int, help="head width when not hidden / heads (qwen3)")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--ffn", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--rope-dims", type=int)
    p.add_argument("--embed-std", type=float,
                   help="token embedding std (0.05 default keeps greedy output varied; "
                        "1.0 with --branch-scale 1 is well conditioned for llama.cpp comparisons)")
    p.add_argument("--branch-scale", type=float, help="scale of attn_output/ffn_down weights")
    p.add_argument("--weights", choices=["q8_0", "f16", "bf16"], help="matrix storage type")
    p.add_argument("--untied", action="store_true", help="write a separate output.weight")
    p.add_argument("--seed", type=int)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(handler=cmd_synth)

    from ane_spec.shards.topology import DEFAULT_MAX_HEAD_MB, DEFAULT_MAX_SHARD_MB
    from ane_spec.shards.weights import DEFAULT_MIN_WEIGHT_COSINE

    p = sub.add_parser("build", help="compile a Phi-4-mini GGUF into Core ML shards + manifest")
    p.add_argument("gguf", help=model_help)
    p.add_argument("--out", required=True, help="output folder, e.g. local-artifacts/phi4")
    p.add_argument("--topology", help="layers per shard (20,4,6,2) or ranges (0:20,20:32); "
                                      "default: fewest shards under --max-shard-mb")
    p.add_argument("--max-seq", type=int, default=2048,
                   help="context window S (KV slots); a multiple of 32, at most 16,384 (the "
                        "ANE's width; --force-ane-limits to go over)")
    p.add_argument("--weights", choices=["auto", "int8-channel", "q8-block", "fp16"],
                   default="auto",
                   help="auto (default): per tensor, int8 per channel where its cosine against "
                        "the file's values reaches --min-weight-cosine, else an 8-bit LUT per "
                        "group of rows, else fp16; the others force one format")
    p.add_argument("--tuned", metavar="TUNE_JSON",
                   help="apply `ane-spec tune`'s choices (layout, mask form, head layout, "
                   "prefill P, K/V write) from its tune.json; any of those flags given here "
                   "wins over the file")
    p.add_argument("--layout", choices=["BCT1", "BC1T"], default=None,
                   help="hidden-state layout [1,d,T,1] (ane-book, default) or [1,d,1,T] (Apple)")
    p.add_argument("--mask-form", choices=["select", "additive"], default=None,
                   help="how layers hide K/V slots: select (default; exact whatever an "
                   "overflowing row holds) or additive (clip and an added mask only, the ops "
                   "Anemll and ane-book run on the ANE; loses that exactness: see `ane-spec "
                   "doctor`, whose mask-ops check says which a Mac should use)")
    p.add_argument("--kv-write", choices=["scatter", "slice"], default=None,
                   help="how layers store new K/V rows: scatter (default; every pass rewrites "
                   "the whole state, measured ANE-resident) or slice (slice_update of a window "
                   "as wide as the pass, O(T) instead of O(S); its ANE residency is unproven "
                   "and dynamic slice_update has crash reports, apple/coreai-torch#6)")
    p.add_argument("--head-layout", choices=["channels", "vocab-last"], default=None,
                   help="the LM head's logits: channels (default; [1,V,T,1], the hidden "
                   "layout's) or vocab-last ([1,T,V], as Anemll's heads emit them: each row's "
                   "logits contiguous, one transpose more on the device; `ane-spec tune` "
                   "measures which is faster)")
    p.add_argument("--head-chunks", type=int, default=None,
                   help="LM-head vocabulary chunks (default: 4, or as many more as keep each "
                        "chunk within 50,016 channels)")
    p.add_argument("--head-argmax", action="store_true",
                   help="head emits per-chunk max and argmax instead of logits (greedy only)")
    p.add_argument("--max-shard-mb", type=int, default=DEFAULT_MAX_SHARD_MB,
                   help="largest shard's weights (default %(default)s: about 10%% under the "
                        "largest shard measured ANE-resident, 1,921 MiB; above ~2.3 GiB ran "
                        "off the ANE)")
    p.add_argument("--max-head-mb", type=float, default=DEFAULT_MAX_HEAD_MB,
                   help="largest LM-head package's weights: a head over it is split into "
                        "separate packages of whole --head-chunks (default %(default)g: "
                        "ane-book's head ran resident as packages of 146.6 MiB; no larger head "
                        "program was measured)")
    p.add_argument("--min-weight-cosine", type=float, default=DEFAULT_MIN_WEIGHT_COSINE,
                   help="per-tensor cosine floor against the GGUF values: auto picks the first "
                        "format that reaches it; a forced format below it fails")
    p.add_argument("--residual-scale", default="auto", metavar="auto|off|2^K",
                   help="scale the residual stream by a power of two folded into the weights, "
                        "so it stays inside fp16: auto (default) measures activations with the "
                        "fp32 reference on a few prompts and scales where the margin under "
                        "65504 is under 8x; off: no calibration, no scaling; 2^K: that factor "
                        "(e.g. 2^-3)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing output folder (unchanged shards are reused)")
    p.add_argument("--force-ane-limits", action="store_true",
                   help="build what the Neural Engine's known limits refuse (e.g. --max-seq over "
                        "16,384, an LM-head chunk over --max-head-mb); the build says each "
                        "limit it overrides")
    p.add_argument("--prefill-t", type=int, default=None, metavar="P",
                   help="every layer package also holds a prefill function: the same layers "
                        "at a fixed T=P, weights stored once, one KV state for both; prompts "
                        "then run P tokens per pass with no LM head until their last token "
                        "(default 64, or --max-seq where shorter; 0: none, prompts at T=4)")
    p.add_argument("--no-swa-ring", action="store_true",
                   help="sliding-window layers (Gemma 3) keep full-length K/V states instead "
                        "of rings of W + the widest pass (4, or --prefill-t) slots, rounded to "
                        "32; for comparison")
    p.set_defaults(handler=cmd_build)

    p = sub.add_parser("tune", help="build each open variant (mask form, layout, head layout, "
                                    "prefill P, K/V write), measure each through the backend "
                                    "in its own process, write tune.md and tune.json (first "
                                    "Mac run)")
    p.add_argument("--out", required=True, help="folder for tune.json, tune.md, tune.png")
    p.add_argument("--manifest", help="vary this build (rebuilt from its source GGUF with its "
                   "own options, one changed at a time) instead of a synthetic model")
    p.add_argument("--preset", default="phi4-mini",
                   help="without --manifest: the synthetic model's widths (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="its layers (default %(default)s)")
    p.add_argument("--vocab", type=int, default=None, help="its vocabulary (default: the "
                   "preset's, so the head is the real one's size)")
    p.add_argument("--max-seq", type=int, default=512, help="its context (default %(default)s)")
    p.add_argument("--backend", choices=["auto", "coreml", "mil"], default="auto",
                   help="auto (default): Core ML on macOS, else the fp16 MIL interpreter, whose "
                   "timings are not the device's")
    p.add_argument("--reps", type=int, default=30, help="timed passes per variant (median)")
    p.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds a variant may take, its build included, before its process is "
                   "killed and it reads `hung` (default %(default)g)")
    p.add_argument("--bits", type=_names_of(BITS_CHOICES), default=list(BITS_CHOICES),
                   help="checks per variant, comma-separated (default all: "
                   f"{','.join(BITS_CHOICES)}); interpreter: the backend's logits against the "
                   "fp16 interpreter's")
    p.add_argument("--dimensions", type=_names_of(DIMENSION_CHOICES),
                   default=list(DIMENSION_CHOICES),
                   help=f"choices to vary (default all: {','.join(DIMENSION_CHOICES)})")
    p.add_argument("--margin", type=float, default=0.05,
                   help="how much faster an alternative must be to replace a default "
                   "(default %(default)g)")
    p.add_argument("--keep-builds", action="store_true",
                   help="keep each variant's build under OUT/variants")
    p.add_argument("--draft-model", metavar="M",
                   help="with --manifest: also measure this draft model beside the build on "
                   "each compute units (ane, gpu, cpu; the interpreter once): its costs and a "
                   "short decode greedy / n-grams / draft model, and say whether and where it "
                   "pays. A GGUF, a catalog name, ollama:NAME or a build folder, as for serve")
    p.add_argument("--draft-only", action="store_true",
                   help="measure only the draft model (no variants; the build's source GGUF "
                   "is not needed)")
    p.add_argument("--draft-tokens", type=int, default=64,
                   help="new tokens per decode of the draft measurement (default %(default)s)")
    p.set_defaults(handler=cmd_tune)

    p = sub.add_parser("generate", help="generate text with a built model (speculative by default)")
    p.add_argument("--manifest", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="raw prompt text (special tokens in it are parsed)")
    src.add_argument("--chat-file", help="JSON list of {role, content} messages")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--no-speculative", action="store_true",
                   help="plain greedy decoding, one token per pass (padded to T=4 in the fixed "
                        "decode shape, T=1 in the mixed one)")
    p.add_argument("--no-guard", action="store_true", help="mixed decode shape: turn the near-tie guard off")
    _add_ngram_args(p)
    p.add_argument("--trace", help="write one JSON line per pass to this file")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.add_argument("--no-verify", action="store_true", help="skip artifact hash checks")
    _add_draft_args(p)
    _add_backend_args(p)
    p.set_defaults(handler=cmd_generate)

    p = sub.add_parser("sweep", help="plain greedy (one token per pass) vs speculative decoding "
                                          "over prompt lengths, one process")
    p.add_argument("--manifest", required=True)
    p.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")],
                   default=[100, 200, 372, 800], help="prompt lengths, e.g. 100,200,372,800")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=80)
    p.add_argument("--source", choices=["code", "quote"], default="code",
                   help="built-in prompt text: code with repetition, or a document to quote")
    p.add_argument("--prompts-file", help="tile prompts from this text file instead")
    _add_ngram_args(p)
    p.add_argument("--out", default="local-artifacts/sweep", help="folder for JSON, Markdown, PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--no-verify", action="store_true")
    _add_draft_args(p)
    _add_backend_args(p)
    p.set_defaults(handler=cmd_sweep)

    p = sub.add_parser("bench-drafter", help="replay token streams model-free: the n-gram "
                                             "drafter per request and across requests vs "
                                             "vLLM's and SuffixDecoding's rules")
    p.add_argument("--streams", help="JSONL of {family, prompt, output} (default: built-in); a "
                                     "family's streams replay in file order")
    p.add_argument("--per-family", type=int, default=4)
    _add_ngram_args(p)
    p.add_argument("--memory-tokens", type=int, default=65536,
                   help="the cross-request drafter's memory of earlier requests")
    p.add_argument("--fill", action="store_true", help="fill drafts to 3 (the ANE policy)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_bench_drafter)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP daemon (loopback by default)")
    _add_serve_args(p)
    p.set_defaults(handler=cmd_serve)

    daemon = sub.add_parser("daemon", help="run `ane-spec serve` as a macOS LaunchAgent")
    dsub = daemon.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = dsub.add_parser("install", help="write ~/Library/LaunchAgents/com.ane-spec.daemon.plist "
                                        "(starts at login, restarted if it dies)")
    _add_serve_args(p)
    p.add_argument("--print", action="store_true",
                   help="print the plist and where it would go; write nothing")
    p.set_defaults(handler=cmd_daemon_install)

    p = sub.add_parser("doctor", help="check every Core ML assumption on this machine (run "
                                      "first on a Mac; attach the report to bug reports)")
    p.add_argument("--manifest", help="also check this build: residency, JIT, latency, "
                                      "row invariance, drift, parity, memory")
    p.add_argument("--gguf", help="source GGUF for the parity check (default: the manifest's)")
    p.add_argument("--decode-shape", choices=DECODE_SHAPES, default="fixed",
                   help="the decode shape to check (sets Core ML's reshape hint); residency is "
                        "planned at T=4 only, so with mixed, T=1 residency is unproven; mixed "
                        "loads with reshapeFrequency Frequent, expected off the ANE (Apple's "
                        "flexible-input guide; coremltools #2600): the decode-shape check "
                        "measures where it runs")
    p.add_argument("--json", action="store_true", help="print one JSON object with a checks list")
    p.add_argument("--strict", action="store_true",
                   help="the residency check wants every planned op on the Neural Engine "
                        "(default: every conv, and 95%% of the estimated cost)")
    p.add_argument("--out", help="also write a short Markdown report to this file, and JSON "
                   "beside it (.json); both are rewritten after every check")
    p.add_argument("--draft-model", help="also measure this draft model beside the build "
                   "(draft-costs: c_verify, c_draft, the overlap): a GGUF, a catalog name, "
                   "ollama:NAME or a build folder, as for serve")
    p.add_argument("--draft-units", choices=DRAFT_UNITS, default=None,
                   help="the draft's compute units for draft-costs (default: ane)")
    p.set_defaults(handler=cmd_doctor)

    probe = sub.add_parser("probe", help="gates (row-invariance, overflow, parity, block, drift, "
                                         "residency, all) and probes")
    psub = probe.add_subparsers(dest="gate", required=True, metavar="GATE")
    for gate, text in (("row-invariance", "a token's logits and K/V are the same at every row "
                                           "of a pass (what exact fixed-shape decoding needs)"),
                       ("overflow", "a row that overflows fp16 (padding, filler, rejected draft) "
                                    "changes no other slot or row"),
                       ("parity", "whole pipeline vs the reference forward pass"),
                       ("block", "T=4 block vs four T=1 calls, per shard"),
                       ("drift", "T=4 vs T=1 logit drift, stored for the exactness guard"),
                       ("residency", "MLComputePlan on macOS; static ANE lint everywhere"),
                       ("all", "every gate that can run on this platform")):
        p = psub.add_parser(gate, help=text)
        p.add_argument("--manifest", required=True)
        p.add_argument("--gguf", help="source GGUF for parity (default: the manifest's)")
        p.add_argument("--json", action="store_true", help="one JSON object per gate")
        p.add_argument("--no-verify", action="store_true", help="skip artifact hash checks")
        p.add_argument("--strict", action="store_true",
                       help="residency: every planned op on the Neural Engine (default: every "
                            "conv, and 95%% of the estimated cost, each op off it listed)")
        _add_backend_args(p)
        p.set_defaults(handler=cmd_probe_gates)

    p = psub.add_parser("synthetic-t4", help="a random stateful T=4 layer at chosen dims")
    p.add_argument("--dims", choices=["tiny", "d1024", "phi"], default="d1024")
    _add_probe_output_args(p)
    p.set_defaults(handler=cmd_probe_synthetic)

    p = psub.add_parser("layer", help="a one-layer shard from a real GGUF layer")
    p.add_argument("gguf")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--max-seq", type=int, default=2048)
    p.add_argument("--weights", choices=["auto", "int8-channel", "q8-block", "fp16"],
                   default="auto")
    _add_probe_output_args(p)
    p.set_defaults(handler=cmd_probe_layer)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001: every failure ends in one line unless --debug
        if args.debug:
            raise
        message, status = failure_line(exc)
        print(f"ane-spec {args.command}: {message}", file=sys.stderr)
        return status


def failure_line(exc: BaseException) -> tuple[str, int]:
    """One printable line for an exception, and the exit status that goes with it."""
    if isinstance(exc, AneSpecError):
        return one_line(f"error: {exc}"), EXIT_USER_ERROR
    if isinstance(exc, OSError):
        where = f"{untrusted(exc.filename, 200)}: " if exc.filename else ""
        return one_line(f"error: {where}{exc.strerror or exc}"), EXIT_USER_ERROR
    if isinstance(exc, MemoryError):
        return "error: out of memory", EXIT_USER_ERROR
    return one_line(f"internal error: {type(exc).__name__}: {untrusted(str(exc), 300)} (a bug in "
                    "ane-spec; `ane-spec --debug ...` shows the traceback)"), EXIT_BUG


# Set by a command after which the process may end without the interpreter's teardown.
_teardown_skippable = False


def exit_process(status: int) -> NoReturn:
    """End the `ane-spec` process with `status`. After a finished build the interpreter's
    teardown is skipped: everything the build wrote is closed and renamed into place, its
    threads are joined, and what remains is torch's and coremltools' modules, the frozen heap
    and GBs of pooled buffers, whose orderly destruction took 1.5 s of a real-size Phi-4-mini
    build's 40 (torch alone deregisters ~150 operator libraries one by one at exit)."""
    if _teardown_skippable:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except OSError:   # a closed pipe: let the normal exit report it as Python does
            sys.exit(status)
        os._exit(status)
    sys.exit(status)


def run() -> NoReturn:
    """The `ane-spec` console script."""
    exit_process(main())


if __name__ == "__main__":
    run()
