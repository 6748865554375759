"""`ane-spec sweep`: plain greedy vs speculative decoding over prompt lengths, in one process.

One resident process, so a Core ML backend pays its per-process JIT once (during the warm-up
passes, before any timing). For each prompt length x rep it runs plain greedy decoding (one token
per pass: a padded T=4 pass in the fixed decode shape, T=1 in the mixed one) and speculative
decoding on the same prompt with fresh sessions, and reports medians in the format of seeds/003's
sweep table, plus tokens per pass and exactness (speculative tokens == greedy tokens). The time
to the first token (TTFT) is the speculative run's, with the pipeline's prefill mode; on a build
with a prefill function, the TTFT with it off (every prompt chunk a T=4 pass) is measured too.
With a draft model (`--draft-model`), each row also says who drafted the speculative passes
(`draft_sources`: passes, drafted and accepted per source, summed over the reps) and how many
draft-model passes were on the critical path.

Prompts are tiled to each target length from one source text, as seeds/003 did, so n-gram match
density stays representative: built-in code with repetition (stdlib source) or documents to
quote, or a text file of your own.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ane_spec.bench.streams import builtin_texts
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.runtime.pipeline import ShardPipeline

DEFAULT_LENGTHS = (100, 200, 372, 800)
SOURCES = ("code", "quote")


def source_text(source: str, prompts_file: str | None = None) -> str:
    if prompts_file is not None:
        try:
            return Path(prompts_file).read_text()
        except OSError as exc:
            raise AneSpecError(f"cannot read --prompts-file {prompts_file}: {exc}") from None
    if source not in SOURCES:
        raise AneSpecError(f"unknown prompt source '{source}'; choose {', '.join(SOURCES)}")
    family = "code" if source == "code" else "quote"
    return "\n".join(p + o for _, p, o in builtin_texts(2, families=[family]))


def tiled_prompt(tokens: list[int], length: int) -> list[int]:
    if not tokens:
        raise AneSpecError("the prompt source text is empty")
    reps = -(-length // len(tokens))
    return (tokens * reps)[:length]


def run_sweep(pipeline: ShardPipeline, *, lengths: Sequence[int] = DEFAULT_LENGTHS,
              reps: int = 3, new_tokens: int = 80, source: str = "code",
              prompts_file: str | None = None, ngram_min: int = 1, ngram_max: int = 4,
              progress=print, drafter: Any = None) -> dict[str, Any]:
    """`drafter`: the speculative runs' drafter, reset for each (a draft model beside the
    n-gram drafter: decode/draft_setup.py); default: a fresh n-gram drafter each."""
    base = pipeline.tokenizer.encode(source_text(source, prompts_file))
    fits = [n for n in lengths if n + new_tokens <= pipeline.max_seq]
    skipped = [n for n in lengths if n not in fits]
    if not fits:
        raise AneSpecError(f"no prompt length in {list(lengths)} leaves room for {new_tokens} "
                           f"new tokens in the context window of {pipeline.max_seq}")
    warm = time.perf_counter()
    # Pays the JIT of every pass width the decode shape uses, before any timing.
    DecodeSession(pipeline).generate(base[:8], GenerateOptions(max_tokens=8))
    warmup_s = time.perf_counter() - warm
    rows = []
    for n in fits:
        prompt = tiled_prompt(base, n)
        runs: dict[str, list[dict]] = {"greedy": [], "speculative": [], "prefill_off": []}
        exact = True
        for _ in range(reps):
            results = {}
            for mode in ("greedy", "speculative"):
                own = NgramDrafter(ngram_min=ngram_min, ngram_max=ngram_max)
                session = DecodeSession(pipeline, drafter=own if drafter is None or
                                        mode == "greedy" else drafter)
                t0 = time.perf_counter()
                out = session.generate(prompt, GenerateOptions(
                    max_tokens=new_tokens, speculative=mode == "speculative"))
                wall = time.perf_counter() - t0
                results[mode] = out
                runs[mode].append(out.stats.to_dict() | {"wall_s": wall})
            exact &= results["greedy"].tokens == results["speculative"].tokens
            if pipeline.prefill_t:  # the same prompt's first token with every chunk at T=4
                out = DecodeSession(pipeline, prefill="off").generate(
                    prompt, GenerateOptions(max_tokens=1))
                runs["prefill_off"].append(out.stats.to_dict())
        row = _summarise(n, runs, exact)
        rows.append(row)
        progress(f"[sweep] {n} tokens: greedy {row['greedy_decode_tok_s']} tok/s, speculative "
                 f"{row['decode_tok_s']} tok/s ({row['speedup']}x), {row['tokens_per_pass']} "
                 f"tok/pass, exact {exact}")
    return {"backend": pipeline.backend.describe(), "decode_shape": pipeline.decode_shape,
            "max_seq": pipeline.max_seq, "prefill_t": pipeline.prefill_t,
            "prefill_mode": pipeline.prefill_mode,
            "new_tokens": new_tokens, "reps": reps, "source": prompts_file or source,
            "draft_mode": getattr(drafter, "mode", None),
            "warmup_s": round(warmup_s, 2), "skipped_lengths": skipped, "rows": rows}


def _summarise(n: int, runs: dict[str, list[dict]], exact: bool) -> dict[str, Any]:
    def med(mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[mode]), 3)

    greedy, spec = med("greedy", "decode_tok_s"), med("speculative", "decode_tok_s")
    sources: dict[str, dict[str, int]] = {}
    for r in runs["speculative"]:
        for src, counts in r["draft_sources"].items():
            row = sources.setdefault(src, {"passes": 0, "drafted": 0, "accepted": 0})
            for key in row:
                row[key] += counts[key]
    return {"prompt_tokens": n, "decode_tok_s": spec, "greedy_decode_tok_s": greedy,
            "prefill_tok_s": med("speculative", "prefill_tok_s"),
            "prefill_passes": med("speculative", "prefill_passes"),
            "ttft_s": med("speculative", "ttft_seconds"),
            "ttft_prefill_off_s": med("prefill_off", "ttft_seconds") if runs["prefill_off"]
            else None,
            "wall_s": med("speculative", "wall_s"), "greedy_wall_s": med("greedy", "wall_s"),
            "speedup": round(spec / greedy, 3) if greedy else 0.0,
            "tokens_per_pass": med("speculative", "tokens_per_pass"),
            "acceptance": med("speculative", "acceptance"),
            "draft_hit_rate": med("speculative", "draft_hit_rate"), "exact": exact,
            "draft_sources": dict(sorted(sources.items())),
            "draft_model_passes": sum(r["draft_model_passes"] for r in runs["speculative"])}


def format_markdown(result: dict[str, Any]) -> str:
    prefill = (f"prefill function T={result['prefill_t']} ({result['prefill_mode']})"
               if result.get("prefill_t") else "no prefill function (prompts at T=4)")
    lines = [f"Backend: {result['backend']}, {result['decode_shape']} decode shape, {prefill}, "
             f"{result['new_tokens']} new tokens, {result['reps']} reps (medians), prompts: "
             f"{result['source']}", "",
             "| Prompt length | Decode tok/s | Prefill tok/s | Prefill passes | TTFT | "
             "TTFT, prefill off | Wall/req | Speedup vs greedy | Tokens/pass | Exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        off = r.get("ttft_prefill_off_s")
        lines.append(f"| {r['prompt_tokens']} tokens | {r['decode_tok_s']:.1f} | "
                     f"{r['prefill_tok_s']:.1f} | {r['prefill_passes']:g} | "
                     f"{r['ttft_s']:.2f}s | {'-' if off is None else f'{off:.2f}s'} | "
                     f"{r['wall_s']:.2f}s | {r['speedup']:.2f}x | "
                     f"{r['tokens_per_pass']:.2f} | {'yes' if r['exact'] else 'NO'} |")
    if result.get("draft_mode") is not None:
        lines.append(f"\nWho drafted the speculative passes (draft mode {result['draft_mode']}, "
                     "all reps):")
        for r in result["rows"]:
            who = "; ".join(f"{src} {c['passes']} passes, {c['accepted']}/{c['drafted']} drafts "
                            "accepted" for src, c in r["draft_sources"].items())
            lines.append(f"- {r['prompt_tokens']} tokens: {who or 'no decode passes'}; "
                         f"{r['draft_model_passes']} draft-model passes on the critical path")
    if result["skipped_lengths"]:
        lines.append(f"\nSkipped (do not fit the context window with the new tokens): "
                     f"{result['skipped_lengths']}")
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(format_markdown(result) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths  # the plot is optional: pip install 'ane-spec[plot]'
    rows = result["rows"]
    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [r["greedy_decode_tok_s"] for r in rows], "o-", label="greedy (1 token per pass)")
    ax.plot(x, [r["decode_tok_s"] for r in rows], "o-", label="speculative (T=4 verify)")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"ane-spec sweep: {result['backend']}, {result['decode_shape']} shape")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "sweep.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths
