"""`tune.json`: what `ane-spec tune` measured and chose, and how `ane-spec build --tuned` reads it.

One file, validated at both ends with pydantic: `tune` writes it, `build --tuned` refuses one
that is not this schema (a hand-edited value outside a flag's choices included) with one line,
rather than building something nobody chose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ane_spec.errors import AneSpecError

TUNE_VERSION = 1

# The open choices `tune` measures, each a build option (BuildRequest field), and the values
# each may take. A prefill P is an int; the others are names.
Dimension = Literal["mask_form", "layout", "head_layout", "prefill_t", "kv_write"]
DIMENSIONS: tuple[Dimension, ...] = ("mask_form", "layout", "head_layout", "prefill_t",
                                     "kv_write")
CHOICES: dict[str, tuple[Any, ...]] = {
    "mask_form": ("select", "additive"),
    "layout": ("BCT1", "BC1T"),
    "head_layout": ("channels", "vocab-last"),
    "prefill_t": (16, 32, 64, 128),
    "kv_write": ("scatter", "slice"),
}
# The command-line flag of each, for the report and for `build --tuned`'s messages.
FLAGS: dict[str, str] = {"mask_form": "--mask-form", "layout": "--layout",
                         "head_layout": "--head-layout", "prefill_t": "--prefill-t",
                         "kv_write": "--kv-write"}

Outcome = Literal["ok", "wrong", "crashed", "hung", "error", "skipped"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Check(_Strict):
    """One bit check of a variant (a probe, or its logits against the interpreter)."""

    name: str
    passed: bool | None   # None: skipped here
    summary: str


class VariantResult(_Strict):
    name: str                      # "baseline", "mask_form=additive", ...
    dimension: Dimension | None    # None: the baseline (every dimension's reference)
    options: dict[str, Any]        # the build options that differ from nothing: all five
    outcome: Outcome
    reason: str = ""               # why it is not ok: the failed checks, the signal, the error
    build_seconds: float | None = None
    decode_ms: float | None = None           # median time of one T=4 decode/verify pass
    decode_ms_spread: tuple[float, float] | None = None  # (min, max) over the timed passes
    prefill_ms: float | None = None          # median time of one prefill pass (P rows)
    prefill_ms_per_token: float | None = None
    placement: str = ""                      # MLComputePlan's verdict, or why there is none
    placement_figures: dict[str, Any] = Field(default_factory=dict)
    checks: list[Check] = Field(default_factory=list)
    seconds: float = 0.0                     # wall time of the whole variant, build included


class Choice(_Strict):
    value: Any
    flag: str
    rests_on: str                  # one line: the figures and the checks this choice rests on
    measured: bool                 # False: nothing passed, or it was not measured: the default


DraftOutcome = Literal["ok", "wrong", "crashed", "hung", "error"]


class DraftRow(_Strict):
    """The draft model on one set of compute units beside the target: its costs (what serve's
    policy reads) and one short decode each way on the same prompt."""

    units: str                     # "ane", "gpu", "cpu", or "interpreter" (no Core ML here)
    outcome: DraftOutcome
    reason: str = ""
    verify_ms: float | None = None           # c_verify: a target pass at its decode shape
    draft_ms: float | None = None            # c_draft: a draft pass at T=1
    ratio: float | None = None               # c_draft / c_verify
    overlap: float | None = None             # share of draft passes hidden behind a target pass
    greedy_tok_s: float | None = None        # plain greedy decoding
    ngram_tok_s: float | None = None         # speculative, the n-gram drafter alone
    ngram_tokens_per_pass: float | None = None
    model_tok_s: float | None = None         # speculative, the draft model alone
    model_tokens_per_pass: float | None = None
    both_tok_s: float | None = None          # speculative, both drafters (serve's default)
    both_tokens_per_pass: float | None = None
    both_sources: dict[str, dict[str, int]] = Field(default_factory=dict)  # who drafted
    seconds: float = 0.0


class DraftChoice(_Strict):
    use_draft: bool
    units: str | None              # --draft-units to serve with (None: the interpreter's own)
    mode: Literal["model", "both"] | None = None   # --draft-mode to serve with
    serve_flags: str               # what to add to `ane-spec serve`: "" when no draft pays
    rests_on: str
    measured: bool                 # False: no units ran correctly; nothing was decided


class DraftTune(_Strict):
    draft: str                     # the draft model's build folder
    prompt_tokens: int
    new_tokens: int
    rows: list[DraftRow]
    choice: DraftChoice


class TuneResult(_Strict):
    version: Literal[1] = TUNE_VERSION
    created: str
    platform: str
    backend: str                   # "coreml (CPU_AND_NE)" or "mil (fp16 interpreter)"
    timings: str                   # where the times come from, said plainly
    placement: str                 # whether placement was measured, and how
    source: str                    # the model the variants were built from
    reps: int
    warmup: int
    deadline_s: float
    margin: float                  # how much faster an alternative must be to replace a default
    baseline: dict[str, Any]
    variants: list[VariantResult]
    choices: dict[Dimension, Choice]
    draft: DraftTune | None = None   # with --draft-model: the draft measured beside the build

    def build_options(self) -> dict[str, Any]:
        """The chosen value of every dimension, as BuildRequest fields."""
        return {d: c.value for d, c in self.choices.items()}


def load_tune(path: str | os.PathLike[str]) -> TuneResult:
    """A tune.json, validated (the chosen values included), or one line saying what is wrong."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AneSpecError(f"--tuned {p}: no such file (run `ane-spec tune` first)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AneSpecError(f"--tuned {p}: not a readable JSON file ({exc})") from None
    try:
        result = TuneResult.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise AneSpecError(f"--tuned {p}: not a tune.json of this ane-spec ({where}: "
                           f"{first['msg']})") from None
    for dimension, choice in result.choices.items():
        if choice.value not in CHOICES[dimension]:
            raise AneSpecError(f"--tuned {p}: {dimension} {choice.value!r} is not one of "
                               f"{', '.join(map(str, CHOICES[dimension]))}")
    return result
