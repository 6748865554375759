"""Which drafter drafts each step, and how far the draft model drafts, from measured costs.

Costs are in target passes. The target's verify pass has the fixed T=4 shape whatever it carries,
so a shorter draft never makes it cheaper: the only cost a draft has is the draft model's own
passes on the critical path, c = c_draft / c_verify each (`DraftCosts.ratio`). The n-gram drafter
costs nothing (microseconds).

**How far the model drafts (p_min).** After i drafts whose probability (under the draft model) of
all being accepted is P, one more pass gains about P * a tokens (a: the model's measured per-token
acceptance) and costs c target passes, time that would otherwise produce R tokens per target
pass (R: the measured tokens per unit of time, verify plus drafting). So it pays while
P * a >= c * R: the next pass runs while P >= p_min = c * R / a. With the CPU figures of the
issue (c = 0.43, a ~0.8, R ~1.4) that is ~0.75 on the first drafts' probability, falling as the
cost falls: for a 7B target (c ~0.07) it is ~0.1, and when the draft's passes are hidden behind
the target's (overlap) c is 0 and every slot is filled. llama.cpp's fixed p_min drifted from 0.9
to 0.75 to 0.0 (and 0.0 with long drafts fell to 7% acceptance, llama.cpp #25908): here it moves
with the measured costs and acceptance, per step.

**Which source drafts a step.** Both proposals are considered every step. The n-gram drafter's is
judged by its match length (the evidence behind its first token, `NgramDrafter.evidence`), from
the tokens such matches have recently been worth: every step, whichever source drafted, the
n-gram's proposal is scored against the tokens the target then committed (it costs nothing to
ask), so its figures stay current. The model's is judged by what its drafts have recently been
worth and what its passes cost. The step takes the source with the higher expected tokens per
unit of time: (1 + E_ngram) against (1 + E_model) / (1 + passes * c). A long match (editing given
code) wins, since its draft is free and usually accepted whole; a weak match does not crowd out
a good model draft, which llama.cpp's fixed precedence (n-gram first) lets it do. The model's
figures change only when it drafts, so after EXPLORE_EVERY steps without it, it drafts one.

`BothDrafters` is itself a drafter (reset / append / draft / finish), so the decode session and
the replay bench use it unchanged; `propose` also says which source drafted and carries the
model's q for sampling.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.model_drafter import Proposal
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import common_prefix
from ane_spec.errors import AneSpecError

DraftMode = Literal["both", "model", "ngram"]
DRAFT_MODES: tuple[DraftMode, ...] = ("both", "model", "ngram")
EMA = 0.15  # weight of the newest observation in the running figures
# A source not chosen for this many steps drafts the next one anyway: the n-gram's figures are
# kept current for free (its proposal is scored every step), the model's only by drafting.
EXPLORE_EVERY = 16
P_MIN_CAP = 0.95


@dataclass(frozen=True)
class DraftCosts:
    """Seconds per pass, measured on the loaded models (`measure_draft_costs`)."""

    verify_seconds: float  # c_verify: a target pass at its decode shape (T=4)
    draft_seconds: float   # c_draft: a draft-model pass at T=1
    # Measured with both running at once (draft in its own process): the fraction of the
    # draft's passes hidden behind the target's pass; None where not measured.
    overlap: float | None = None

    @property
    def ratio(self) -> float:
        return self.draft_seconds / self.verify_seconds if self.verify_seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | None]:
        return {"verify_ms": round(1000 * self.verify_seconds, 3),
                "draft_ms": round(1000 * self.draft_seconds, 3),
                "ratio": round(self.ratio, 4),
                "overlap": None if self.overlap is None else round(self.overlap, 3)}


def p_min(ratio: float, tokens_per_time: float, acceptance: float) -> float:
    """The probability below which another draft pass does not pay (module docstring)."""
    if ratio <= 0.0:
        return 0.0
    return min(P_MIN_CAP, ratio * tokens_per_time / max(acceptance, 0.05))


def evidence_bucket(match: int) -> int:
    """Match lengths grouped by what they are: none, 1, 2, 3, 4-7 (a full n-gram), 8+ (a
    followed copy)."""
    return 0 if match <= 0 else match if match <= 3 else 4 if match < 8 else 5


# What a step's drafts are worth (accepted tokens) before anything is measured: from the
# replay of the real Qwen2.5-Coder pair (scripts/real_drafting.py), rounded down.
NGRAM_PRIOR = (0.0, 0.3, 0.5, 0.9, 1.5, 2.2)
MODEL_PRIOR = 1.5


@dataclass
class _Pending:
    """A proposal waiting for the committed tokens that score it."""

    at: int                # history length when it was proposed
    tokens: list[int]
    source: str            # "model", or "ngram" with its bucket
    bucket: int = 0
    counterfactual: bool = False


class SourceFigures:
    """Running figures of both sources, kept across requests."""

    def __init__(self) -> None:
        self.ngram = list(NGRAM_PRIOR)        # accepted tokens per draft, by evidence bucket
        self.model = MODEL_PRIOR              # accepted tokens per model draft
        self.model_acceptance = 0.75          # accepted / drafted, model drafts
        self.model_passes = 3.0               # model passes on the critical path per step
        self.tokens_per_time = 1.5            # tokens per unit of time (target passes)

    def record(self, p: _Pending, accepted: int) -> None:
        if p.source == "ngram":
            b = p.bucket
            self.ngram[b] += EMA * (accepted - self.ngram[b])
        elif p.tokens:
            self.model += EMA * (accepted - self.model)
            self.model_acceptance += EMA * (accepted / len(p.tokens) - self.model_acceptance)

    def to_dict(self) -> dict[str, Any]:
        return {"ngram_by_match": [round(x, 3) for x in self.ngram],
                "model": round(self.model, 3),
                "model_acceptance": round(self.model_acceptance, 3),
                "model_passes": round(self.model_passes, 3),
                "tokens_per_time": round(self.tokens_per_time, 3)}


class BothDrafters:
    """The n-gram drafter and a draft model, one of them per step (module docstring).

    `model`: a ModelDrafter or a DraftProcess (None: n-gram only). `costs`: the measured pass
    costs (None: the draft's passes count as free, as when they are hidden). `overlap`: the
    model's next block is drafted while the target verifies the current one (`verifying`): its
    passes are off the critical path, and the model fills every slot.
    """

    def __init__(self, ngram: NgramDrafter, model: Any = None, *, mode: DraftMode = "both",
                 costs: DraftCosts | None = None, overlap: bool = False,
                 figures: SourceFigures | None = None):
        if mode not in DRAFT_MODES:
            raise AneSpecError(f"unknown draft mode {mode!r} (choose {', '.join(DRAFT_MODES)})")
        if model is None and mode == "model":
            raise AneSpecError("draft mode 'model' needs a draft model (--draft-model)")
        self.ngram = ngram
        self.model = model
        self.mode: DraftMode = mode if model is not None else "ngram"
        self.costs = costs
        self.overlap = overlap and model is not None and hasattr(model, "predraft_async")
        self.figures = figures or SourceFigures()
        self._hist_len = 0
        self._hist: list[int] = []
        self._pending: list[_Pending] = []
        self.last_p_min = 0.0
        self._k = 3  # the last proposal's k: a look-ahead prepares as many
        self._idle = 0  # steps since the model last drafted

    def __repr__(self) -> str:
        return f"BothDrafters(mode={self.mode!r}, overlap={self.overlap}, ngram={self.ngram!r})"

    # --- the n-gram drafter's settings, as the daemon sets them ---------------------------------

    @property
    def memory(self):  # noqa: ANN201
        return self.ngram.memory

    @memory.setter
    def memory(self, value) -> None:  # noqa: ANN001
        self.ngram.memory = value

    @property
    def ngram_min(self) -> int:
        return self.ngram.ngram_min

    @property
    def ngram_max(self) -> int:
        return self.ngram.ngram_max

    # --- the Drafter protocol -------------------------------------------------------------------

    def prepare(self, sampling: SamplingParams) -> None:
        """The next request's sampling (the model draws its drafts from q when sampling)."""
        self._sampling = sampling

    def reset(self, prompt_tokens: Sequence[int]) -> None:
        self.ngram.reset(prompt_tokens)
        if self.model is not None and self.mode != "ngram":
            sampling = getattr(self, "_sampling", None)
            self.model.reset(prompt_tokens, sampling, None if sampling is None else sampling.seed)
        self._hist = [int(t) for t in prompt_tokens]
        self._pending = []

    def append(self, tokens: Sequence[int]) -> None:
        self.ngram.append(tokens)
        if self.model is not None and self.mode != "ngram":
            self.model.append(tokens)
        self._hist.extend(int(t) for t in tokens)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        """As `NgramDrafter.finish` (where the request's tokens go), and the model's state keeps
        the request's tokens."""
        self.ngram.finish(*args, **kwargs)
        if self.model is not None:
            self.model.finish()

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        return self.propose(k, fill=fill).tokens

    # --- choosing -------------------------------------------------------------------------------

    def _score(self) -> None:
        """Score pending proposals against the tokens committed since."""
        hist, keep = self._hist, []
        for p in self._pending:
            seg = hist[p.at:p.at + len(p.tokens)]
            n = common_prefix(p.tokens, seg)
            if n < len(seg) or len(seg) == len(p.tokens):
                self.figures.record(p, n)
            else:
                keep.append(p)
        self._pending = keep

    def model_cost(self) -> float:
        """The model's expected passes on the critical path per step (with overlap, those the
        look-ahead did not cover), in target passes."""
        if self.costs is None:
            return 0.0
        return self.figures.model_passes * self.costs.ratio

    def current_p_min(self) -> float:
        if self.costs is None:
            return 0.0
        f = self.figures
        return p_min(self.costs.ratio, f.tokens_per_time, f.model_acceptance)

    def propose(self, k: int, *, fill: bool = False) -> Proposal:
        self._k = k
        self._score()
        at = len(self._hist)
        t0 = time.perf_counter()
        ng = self.ngram.draft(k, fill=fill) if self.mode != "model" else []
        bucket = evidence_bucket(self.ngram.evidence) if ng else 0
        ng_seconds = time.perf_counter() - t0
        use_model = self.mode == "model" or (self.mode == "both" and (
            not ng or self._idle >= EXPLORE_EVERY or (1 + self.figures.ngram[bucket])
            < (1 + self.figures.model) / (1 + self.model_cost())))
        self._idle = 0 if use_model else self._idle + 1
        if ng and self.mode != "model":
            self._pending.append(_Pending(at, list(ng), "ngram", bucket,
                                          counterfactual=use_model))
        if not use_model:
            self._account(0, 1 + self.figures.ngram[bucket])
            return Proposal(list(ng), "ngram", None, 0, ng_seconds)
        self.last_p_min = self.current_p_min()
        prop = self.model.propose(k, p_min=self.last_p_min)
        if not prop.tokens and ng:  # the model has nothing (blind, out of room): the n-gram's
            self._pending[-1].counterfactual = False
            return Proposal(list(ng), "ngram", None, prop.passes, prop.seconds + ng_seconds)
        self._pending.append(_Pending(at, list(prop.tokens), "model"))
        f = self.figures
        f.model_passes += EMA * (prop.passes - f.model_passes)
        self._account(prop.passes, 1 + f.model)
        return prop

    def _account(self, passes: int, tokens: float) -> None:
        """The running tokens per unit of time, with this step's critical-path draft passes."""
        cost = 1.0 + (0.0 if self.costs is None else passes * self.costs.ratio)
        f = self.figures
        f.tokens_per_time += EMA * (tokens / cost - f.tokens_per_time)

    def lookahead_passes(self) -> int:
        """Passes the draft model runs while the target verifies a block: one to guess the
        bonus and one per next draft (k + 1 in all), as many as fit in the target's pass by the
        measured costs (at least one)."""
        full = self._k + 1
        if self.costs is None or self.costs.ratio <= 0:
            return full
        return max(1, min(full, int(1.0 / self.costs.ratio)))

    def verifying(self, block: Sequence[int]) -> None:
        """The target is about to verify `block` ([pending, drafts...]): with overlap, the draft
        model looks past it meanwhile, assuming every draft is accepted."""
        if self.overlap and self.mode != "ngram":
            self.model.predraft_async(list(block), self.lookahead_passes())
