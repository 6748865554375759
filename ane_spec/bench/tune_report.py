"""`ane-spec tune`'s report: tune.json, and a Markdown page with a plot of time per variant.

The plot is a PNG from matplotlib where it is installed (it is not a dependency of ane-spec),
else a text bar chart inside the page. Both files are written whole into a temporary name and
renamed, so a reader never sees half a report.
"""

from __future__ import annotations

import os
from pathlib import Path

from ane_spec.bench.tune import metric_of
from ane_spec.bench.tune_model import DraftTune, TuneResult, VariantResult

BAR_WIDTH = 40


def write_tune(result: TuneResult, out: Path) -> tuple[Path, Path]:
    """tune.json and tune.md (with tune.png where matplotlib is installed) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    json_path = _atomic(out / "tune.json", result.model_dump_json(indent=2))
    plot = _png(result, out / "tune.png") if result.variants else None
    md_path = _atomic(out / "tune.md", markdown(result, plot))
    return json_path, md_path


def _atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _fmt(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:.4g}{unit}"


def markdown(result: TuneResult, plot: Path | None) -> str:
    lines = [
        "# ane-spec tune", "",
        f"- platform: {result.platform}",
        f"- backend: {result.backend}",
        f"- **timings: {result.timings}**",
        f"- placement: {result.placement}",
        f"- source: {result.source}",
        f"- each time: median of {result.reps} passes after {result.warmup} warm-up; each "
        f"variant in its own process, deadline {result.deadline_s:g} s",
        f"- baseline: " + ", ".join(f"{k} {v}" for k, v in result.baseline.items()),
        "",
    ]
    if result.variants:
        lines += _variants(result, plot)
    if result.draft is not None:
        lines += _draft(result.draft)
    return "\n".join(lines)


def _variants(result: TuneResult, plot: Path | None) -> list[str]:
    lines = [
        "## Choices", "",
        "`ane-spec build --tuned tune.json` applies these; a flag given on its command line "
        "wins over the file.", "",
        "| choice | value | rests on |", "|---|---|---|",
    ]
    for d, c in result.choices.items():
        value = f"`{c.flag} {c.value}`" + ("" if c.measured else " (default)")
        lines.append(f"| {d} | {value} | {_cell(c.rests_on)} |")
    lines += ["", "## Variants", "",
              "| variant | outcome | decode pass ms (min-max) | prefill ms (per token) | "
              "placement | checks | build s |",
              "|---|---|---|---|---|---|---|"]
    for r in result.variants:
        spread = (f" ({r.decode_ms_spread[0]:.4g}-{r.decode_ms_spread[1]:.4g})"
                  if r.decode_ms_spread else "")
        prefill = (f"{_fmt(r.prefill_ms)} ({_fmt(r.prefill_ms_per_token)})"
                   if r.prefill_ms is not None else "-")
        checks = "; ".join(f"{c.name}: {c.summary}" for c in r.checks) or "-"
        outcome = r.outcome + (f": {r.reason}" if r.reason else "")
        lines.append(f"| {r.name} | {_cell(outcome)} | {_fmt(r.decode_ms)}{spread} | {prefill} "
                     f"| {_cell(r.placement or '-')} | {_cell(checks)} | "
                     f"{_fmt(r.build_seconds)} |")
    lines += ["", "## Time per variant", ""]
    if plot is not None:
        lines += [f"![time per variant]({plot.name})", ""]
    lines += ["```", *text_chart(result.variants), "```", ""]
    return lines


def _draft(draft: DraftTune) -> list[str]:
    c = draft.choice
    verdict = (f"serve with `{c.serve_flags.replace('DRAFT', draft.draft)}`" if c.use_draft
               else "serve without `--draft-model`")
    lines = ["## Draft model", "",
             f"- draft: {draft.draft}",
             f"- each decode: a {draft.prompt_tokens}-token prompt of built-in code, "
             f"{draft.new_tokens} new tokens; each units in its own process",
             f"- **{verdict}**: {c.rests_on}", "",
             "| units | outcome | c_verify ms | c_draft ms | ratio | overlap | greedy tok/s | "
             "n-grams tok/s (tok/pass) | model tok/s (tok/pass) | both tok/s (tok/pass) | "
             "who drafted (both) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in draft.rows:
        who = "; ".join(f"{src} {n['passes']} passes, {n['accepted']}/{n['drafted']} accepted"
                        for src, n in r.both_sources.items()) or "-"
        outcome = r.outcome + (f": {r.reason}" if r.reason else "")
        runs = " | ".join(f"{_fmt(getattr(r, f'{m}_tok_s'))} "
                          f"({_fmt(getattr(r, f'{m}_tokens_per_pass'))})"
                          for m in ("ngram", "model", "both"))
        lines.append(f"| {r.units} | {_cell(outcome)} | {_fmt(r.verify_ms)} | "
                     f"{_fmt(r.draft_ms)} | {_fmt(r.ratio)} | {_fmt(r.overlap)} | "
                     f"{_fmt(r.greedy_tok_s)} | {runs} | {_cell(who)} |")
    return lines + [""]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def text_chart(rows: list[VariantResult]) -> list[str]:
    """Bars of each variant's decode pass, and of prefill time per token, scaled to the slowest;
    a variant with no time reads its outcome instead."""
    out = []
    for field in ("decode_ms", "prefill_ms_per_token"):
        _, words = metric_of("prefill_t" if field == "prefill_ms_per_token" else "layout")
        values = [getattr(r, field) for r in rows if getattr(r, field) is not None]
        top = max(values, default=0.0) or 1.0
        width = max(len(r.name) for r in rows)
        out.append(f"{words}, ms:")
        for r in rows:
            v = getattr(r, field)
            bar = "#" * max(1, round(BAR_WIDTH * v / top)) + f" {v:.4g}" if v is not None \
                else f"({r.outcome})"
            out.append(f"  {r.name:<{width}} {bar}")
        out.append("")
    return out[:-1]


def _png(result: TuneResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # not a dependency: the page keeps its text chart
        return None
    rows = result.variants
    names = [r.name for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.5))
    for ax, field, title in ((axes[0], "decode_ms", "decode/verify pass (T=4), ms"),
                             (axes[1], "prefill_ms_per_token", "prefill, ms per token")):
        values = [getattr(r, field) or 0.0 for r in rows]
        colours = ["tab:blue" if r.outcome == "ok" else "tab:red" for r in rows]
        ax.barh(names, values, color=colours)
        for y, r in enumerate(rows):
            if r.outcome != "ok":
                ax.text(0, y, f" {r.outcome}", va="center", fontsize=8)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
    axes[1].set_yticklabels([])
    interpreter = result.backend.startswith("mil")
    fig.suptitle(f"ane-spec tune: {result.backend} (red: not ok)"
                 + ("\ntimings: the MIL interpreter's on this CPU, NOT the device's"
                    if interpreter else ""), fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
