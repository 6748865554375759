"""How large a model's activations get: the fp32 reference run on a few varied prompts.

The Neural Engine computes only in fp16, whose largest finite value is 65,504. Models trained in
bf16 (Gemma above all, but any family may) can carry residual-stream values near or past that;
an fp16 program then turns them into inf, and the next RMSNorm into NaN. This module measures,
per layer, the largest |value| of:

- `residual`: the stream itself, after each add into it (and the embedding row, as layer 0's
  input). The build can scale the stream by a power of two (shards/residual_scale.py);
- `ffn_up`: the gate and up projections' outputs, which the fp16 program also holds;
- `ffn_down_in`: silu(gate) * up, the down projection's input. Scaling the stream does not
  scale the FFN intermediates (RMSNorm in front of the FFN undoes it), so their margin is
  reported apart.

Prompts are short and varied (prose, code, digits, repeated characters, markup): outlier
("massive") activations depend on the token, most of all the first one, so each prompt runs
from position 0 on its own. They run layer-major (ReferenceModel.run_layer_major): each weight
is dequantized once and only one layer's fp32 weights are held, so the cost is about one pass
over the weights plus a few hundred tokens of fp32 matmuls (seconds on a 0.5B model), and the
memory one layer's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ane_spec.model.gguf_file import GGUFModel
from ane_spec.model.memory_pool import MemoryPool
from ane_spec.model.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is imported with the reference, only when measuring
    import torch

FP16_MAX = 65504.0

# Varied on purpose: prose, code, numbers, a run of one character, markup with special-looking
# text. Each starts differently, since the first token's activations are often the largest.
CALIBRATION_PROMPTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. In 1905, Einstein published four papers "
    "that changed physics: on the photoelectric effect, Brownian motion, and relativity.",
    "def fibonacci(n: int) -> list[int]:\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
    "        out.append(a)\n        a, b = b, a + b\n    return out\n",
    "3.14159 2.71828 1.41421 0 0 0 0 1 1 2 3 5 8 13 21 34 55 89 144 233 377 610 987 "
    "1597 2584 4181 6765 10946",
    "!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!",
    "<html><body><h1>Résumé</h1><p>naïve café — 東京 😀</p></body></html>\n{\"key\": [1, 2, 3]}",
)
DEFAULT_MAX_TOKENS = 48
# A calibration that may stop early runs this many tokens of every prompt first: the first
# token's activations are often a model's largest ("massive activations" sit on it and on the
# first delimiters), and 8 of each prompt are ~40 of the ~220.
HEAD_TOKENS = 8

Progress = Callable[[str], None]


@dataclass
class LayerRange:
    """Largest |value| seen in one layer (fp32 reference, unscaled)."""

    residual: float = 0.0
    ffn_up: float = 0.0
    ffn_down_in: float = 0.0


@dataclass
class ActivationRanges:
    layers: list[LayerRange]
    prompts: int
    tokens: int
    seconds: float
    embedding: float = 0.0

    @property
    def residual_max(self) -> float:
        return max([self.embedding, *(r.residual for r in self.layers)])

    @property
    def ffn_max(self) -> float:
        return max([0.0, *(max(r.ffn_up, r.ffn_down_in) for r in self.layers)])


@dataclass
class _Collector:
    ranges: list[LayerRange]
    embedding: float = 0.0
    non_finite: list[str] = field(default_factory=list)

    def reset(self) -> None:
        self.ranges = [LayerRange() for _ in self.ranges]
        self.embedding = 0.0

    def __call__(self, what: str, layer: int, x: torch.Tensor) -> None:
        peak = float(x.abs().max())
        if not math.isfinite(peak):
            # fp32 overflow (or a NaN) in the reference itself: nothing a power of two fixes.
            self.non_finite.append(f"{what} of layer {layer}")
            return
        if what == "embedding":
            self.embedding = max(self.embedding, peak)
            return
        r = self.ranges[layer]
        setattr(r, what, max(getattr(r, what), peak))


class _DecisionOpen(Exception):
    """Raised by the observer when what the first part has measured already decides that the
    rest must be measured too (`measure_activations`' `open_for_good`)."""

    def __init__(self, layer: int):
        super().__init__(layer)
        self.layer = layer


class CalibrationStopped(Exception):
    """A running calibration was asked to stop (its `checkpoint` raised this): the build it
    served failed or was interrupted, and nothing will read its result."""


@dataclass
class _Progress:
    """Passes observations on, says how far the calibration is every few layers, and calls
    `checkpoint` before each observation (a few times per layer): a caller running the
    calibration beside other work stops it there, or changes its thread count."""

    collect: _Collector
    say: Progress
    layers: int
    started: float
    checkpoint: Callable[[], None] | None = None
    last: float = 0.0
    # While the first part runs: whether the maxima so far already leave the decision open
    # whatever comes (asked after each add into the stream).
    first_part_done: Callable[[], bool] | None = None

    def __call__(self, what: str, layer: int, x: "torch.Tensor") -> None:
        if self.checkpoint is not None:
            self.checkpoint()
        self.collect(what, layer, x)
        if what == "residual" and self.first_part_done is not None and self.first_part_done():
            raise _DecisionOpen(layer)
        now = time.monotonic()
        if what == "residual" and now - self.last > 5.0 and layer + 1 < self.layers:
            self.last = now
            self.say(f"calibrating activations: layer {layer + 1}/{self.layers}, "
                     f"{now - self.started:.1f}s")


class NonFiniteActivations(ValueError):
    """The fp32 reference computed inf or NaN on the calibration prompts."""


def calibration_tokens(model: GGUFModel, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                       max_tokens: int = DEFAULT_MAX_TOKENS) -> list[list[int]]:
    """The prompts as token ids (with BOS where the model adds one), cut to `max_tokens`."""
    tok = Tokenizer.from_data(model.tokenizer_data)
    out = []
    for text in prompts:
        ids = tok.encode(text, add_special=True)[:max_tokens]
        if ids:
            out.append(ids)
    return out


def measure_activations(model: GGUFModel, prompts: Sequence[str] = CALIBRATION_PROMPTS,
                        max_tokens: int = DEFAULT_MAX_TOKENS,
                        progress: Progress | None = None,
                        checkpoint: Callable[[], None] | None = None,
                        settled: Callable[["ActivationRanges"], bool] | None = None,
                        open_for_good: Callable[["ActivationRanges"], bool] | None = None
                        ) -> ActivationRanges:
    """Per-layer activation maxima of the fp32 reference over `prompts` (see module docstring).
    Raises ValueError if the fp32 reference itself produces a non-finite value; whatever
    `checkpoint` raises (CalibrationStopped) ends the run.

    With `settled`, the first HEAD_TOKENS of every prompt run through every layer first, and
    the rest only if `settled` says their maxima leave the decision open: the caller's rule for
    "no later token could change what I decide" (residual_scale.py: a margin far beyond the
    safety factor). The rest continues from the first part's caches, so every token is still
    seen once; what the early stop saves is the rest's matmuls, what a full run costs beyond it
    is one more dequantization of the weights.

    With `open_for_good` too (true of maxima that no further token could let `settled` accept:
    a peak already past its bound), the first part is asked after each layer, and ends as soon
    as it says so: every token then runs from the start in one pass, the run without
    `settled`. Real models' margins are under the early stop's bound from their first layers
    (massive activations), so they dequantize those layers twice, not the whole model."""
    from ane_spec.model.reference import ReferenceModel

    say = progress or (lambda _msg: None)
    started = time.monotonic()
    c = model.config
    sequences = calibration_tokens(model, prompts, max_tokens)
    window = max(len(s) for s in sequences)
    collect = _Collector([LayerRange() for _ in range(c.num_layers)])
    # Layer-major: all prompts through layer i before layer i+1, so each weight is dequantized
    # once and one layer's fp32 weights are held at a time (the build's memory stays bounded by
    # a shard, and a 3.8B model costs one pass over its weights, not one per prompt).
    # Each matrix is streamed through a 2 MB block (Weights.project), not dequantized whole:
    # the same products, without one layer's fp32 weights (0.45 GB on Phi-4-mini) written to
    # memory and read back. The block comes from a pool: fresh pages cost a host fault each on
    # the VMs this runs on (memory_pool.py).
    progress_observer = _Progress(collect, say, c.num_layers, started, checkpoint)
    ref = ReferenceModel(model, context_window=window, materialize=False,
                         observer=progress_observer,
                         allocate=MemoryPool().empty, stream_weights=True)
    total = sum(map(len, sequences))
    say(f"calibrating activations: {len(sequences)} prompts, {total} tokens, fp32 reference")

    def measured(tokens: int) -> ActivationRanges:
        if collect.non_finite:
            raise NonFiniteActivations(
                f"the fp32 reference is not finite ({collect.non_finite[0]}) on the calibration "
                "prompts: its weights hold NaN or infinite values, or the model itself "
                "overflows fp32")
        # The first part's ranges are returned or dropped before the rest runs: no copy.
        return ActivationRanges(layers=collect.ranges, prompts=len(sequences),
                                tokens=tokens, seconds=time.monotonic() - started,
                                embedding=collect.embedding)

    # A corrupt file's inf/NaN weights would warn in numpy's dequantization; they are found and
    # named below (and the build then names the tensor), so the warnings say nothing more.
    with np.errstate(invalid="ignore", over="ignore"):
        if settled is None or total <= len(sequences) * HEAD_TOKENS:
            ref.run_layer_major(sequences)
            return measured(total)
        heads = [s[:HEAD_TOKENS] for s in sequences]
        head_tokens = sum(map(len, heads))
        if open_for_good is not None:
            progress_observer.first_part_done = lambda: (not collect.non_finite
                                                         and open_for_good(measured(head_tokens)))
        try:
            caches = ref.run_layer_major(heads)
        except _DecisionOpen as early:
            say(f"calibrating activations: the first {HEAD_TOKENS} tokens of each prompt leave "
                f"the decision open by layer {early.layer + 1}; all {total} tokens from the "
                "start")
            progress_observer.first_part_done = None
            collect.reset()
            ref.run_layer_major(sequences)
            return measured(total)
        progress_observer.first_part_done = None
        first = measured(head_tokens)
        if settled(first):
            say(f"calibrating activations: settled by the first {HEAD_TOKENS} tokens of each "
                f"prompt ({first.tokens} of {total}), in {first.seconds:.1f}s")
            return first
        rest = [(s[HEAD_TOKENS:], cache) for s, cache in zip(sequences, caches)
                if len(s) > HEAD_TOKENS]
        say(f"calibrating activations: the first {HEAD_TOKENS} tokens of each prompt leave "
            f"the decision open; the other {total - first.tokens}")
        ref.run_layer_major([s for s, _ in rest], [cache for _, cache in rest])
        return measured(total)


def margin(peak: float, factor: float = 1.0) -> float:
    """How many times `peak * factor` fits under fp16's largest value (inf for an all-zero
    activation)."""
    scaled = peak * factor
    return math.inf if scaled == 0 else FP16_MAX / scaled
