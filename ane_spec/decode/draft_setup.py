"""`--draft-model`: a built draft model opened beside a target, checked, measured and wrapped.

One function for generate, sweep, demo and serve (`open_drafter`):

1. the vocabulary check (model/vocab_compat.py: llama.cpp's rule, the first difference named);
2. where the draft runs: its own process (decode/draft_process.py) by default, so its passes
   overlap the target's; in this process with `process=False` (tests, the replay). On Core ML,
   `--draft-units ane|gpu|cpu` picks its compute units (CPU_AND_NE, CPU_AND_GPU, CPU_ONLY);
   on the ANE it runs the fixed decode shape (Core ML's `Infrequent` hint, the shape the ANE
   is assured at), elsewhere the mixed one, whose T=1 passes are a draft's natural cost. The
   interpreter runs the draft in fp32 (drafts never decide a token, so its precision moves
   acceptance at most, never output);
3. the costs that drive the policy (decode/draft_policy.py): c_verify, a target pass at its
   decode shape, and c_draft, a draft pass at T=1, each the median of a few passes on scratch
   states; with the draft in its own process, also how much of a draft pass hides behind a
   target pass when both run at once (`DraftCosts.overlap`).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

from ane_spec.decode.draft_policy import BothDrafters, DraftCosts, DraftMode, SourceFigures
from ane_spec.decode.draft_process import DraftProcess, DraftSpec, open_draft_pipeline
from ane_spec.decode.drafter import NgramDrafter
from ane_spec.decode.model_drafter import ModelDrafter, PipelineDraftModel
from ane_spec.errors import AneSpecError
from ane_spec.manifests.store import load_manifest
from ane_spec.model.vocab_compat import check_draft_vocab
from ane_spec.runtime.pipeline import ShardPipeline

DraftUnits = Literal["ane", "gpu", "cpu"]
DRAFT_UNITS: tuple[DraftUnits, ...] = ("ane", "gpu", "cpu")
COMPUTE_UNITS = {"ane": "CPU_AND_NE", "gpu": "CPU_AND_GPU", "cpu": "CPU_ONLY"}
_REPS = 3


def check_units(backend: str, units: DraftUnits | None) -> None:
    """Refuse `--draft-units` the backend cannot honour (before any draft is built)."""
    if units is not None and units not in DRAFT_UNITS:
        raise AneSpecError(f"unknown --draft-units {units!r} (choose {', '.join(DRAFT_UNITS)})")
    if backend == "mil" and units is not None:
        raise AneSpecError("--draft-units picks Core ML compute units; the MIL interpreter "
                           "runs on the CPU (leave it out, or use --backend coreml)")


def draft_spec(target: ShardPipeline, manifest: str | Path, *, units: DraftUnits | None = None,
               states: int = 1, verify: bool = True) -> DraftSpec:
    """Where and how the draft model runs beside `target` (module docstring, point 2)."""
    backend = target.backend.name
    check_units(backend, units)
    if backend == "mil":
        return DraftSpec(manifest=Path(manifest), backend="mil", precision="fp32",
                         decode_shape="mixed", states=states, verify=verify,
                         limit_vocab=target.config.vocab_size)
    units = units or "ane"
    return DraftSpec(manifest=Path(manifest), backend=backend, precision="fp16",
                     compute_units=COMPUTE_UNITS[units],
                     decode_shape="fixed" if units == "ane" else "mixed", states=states,
                     verify=verify, limit_vocab=target.config.vocab_size, blas_threads=None)


def check_pair(target: ShardPipeline, manifest: str | Path) -> None:
    """Refuse a draft build whose vocabulary differs from the target's (VocabMismatch)."""
    draft = load_manifest(manifest, verify=False)
    check_draft_vocab(target.tokenizer_data, draft.tokenizer_data(),
                      target_name=target.manifest.name, draft_name=draft.manifest.name)


def target_pass_seconds(target: ShardPipeline, reps: int = _REPS) -> float:
    """Median seconds of a target pass at its decode shape (T=4 in the fixed one)."""
    state = target.new_state()
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        target.run([0] * target.max_t, 4 * rep, state)
        if rep:  # the first pays Core ML's per-process JIT
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def measure_draft_costs(target: ShardPipeline, draft: Any, reps: int = _REPS) -> DraftCosts:
    """c_verify and c_draft (module docstring, point 3); with a DraftProcess also the overlap:
    one target pass and as many draft passes as fit in it, started together, against the sum
    of the two when run one after the other."""
    verify = target_pass_seconds(target, reps)
    if isinstance(draft, DraftProcess):
        one = draft.measure_pass(reps)
        n = max(1, round(verify / one)) if one > 0 else 1
        with ThreadPoolExecutor(1) as pool:
            walls = []
            for _ in range(reps):
                t0 = time.perf_counter()
                job = pool.submit(draft.measure_pass, n)
                target_pass_seconds(target, 1)
                job.result()
                walls.append(time.perf_counter() - t0)
        # The draft's measure runs n + 1 passes (one warm-up), the target's 2.
        alone = 2 * verify + (n + 1) * one
        together = sorted(walls)[len(walls) // 2]
        hidden = min(2 * verify, (n + 1) * one)
        overlap = max(0.0, min(1.0, (alone - together) / hidden)) if hidden > 0 else 0.0
        return DraftCosts(verify, one, overlap)
    model = draft.model
    state = model.new_state()
    times = []
    for rep in range(reps + 1):
        t0 = time.perf_counter()
        model.run([0], rep, state)
        if rep:
            times.append(time.perf_counter() - t0)
    return DraftCosts(verify, sorted(times)[len(times) // 2])


def open_drafter(target: ShardPipeline, manifest: str | Path, *, units: DraftUnits | None = None,
                 mode: DraftMode = "both", overlap: bool | None = None, process: bool = True,
                 states: int = 1, ngram_min: int = 1, ngram_max: int = 4, verify: bool = True,
                 measure: bool = True, figures: SourceFigures | None = None) -> BothDrafters:
    """The n-gram drafter and the draft model at `manifest` beside `target`, ready to decode.

    `overlap` (None: wherever the draft has its own process) looks past each block while the
    target verifies it. `measure=False` leaves the costs unmeasured (the draft's passes then
    count as free: every slot filled)."""
    check_pair(target, manifest)
    spec = draft_spec(target, manifest, units=units, states=states, verify=verify)
    if process:
        model: Any = DraftProcess(spec)
        model.start()
    else:
        if overlap:
            raise AneSpecError("overlap needs the draft model in its own process")
        model = ModelDrafter(PipelineDraftModel(open_draft_pipeline(spec)), states=states,
                             limit_vocab=spec.limit_vocab)
    costs = measure_draft_costs(target, model) if measure else None
    return BothDrafters(NgramDrafter(ngram_min=ngram_min, ngram_max=ngram_max), model,
                        mode=mode, costs=costs, overlap=process if overlap is None else overlap,
                        figures=figures)


def close_drafter(drafter: Any) -> None:
    """Stop a draft model's process, if the drafter has one."""
    model = getattr(drafter, "model", None)
    if isinstance(model, DraftProcess):
        model.close()
