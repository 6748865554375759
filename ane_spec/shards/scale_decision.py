"""How the residual scale 2^k is chosen from a calibration, with no Core ML in sight.

The rule (`choose_log2`, `settled`) and the calibration that feeds it (`calibrate`) are the
build's decision (residual_scale.py folds it into the weights). They sit apart from the fold
so that the calibration's own process (calibration_process.py) imports the reference and this
rule alone: coremltools, which the fold's module needs for the layer weights, takes ~1.5 s to
import, longer than a 0.5B model's whole calibration.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

from ane_spec.errors import BuildError
from ane_spec.model.activation_range import (
    FP16_MAX,
    ActivationRanges,
    NonFiniteActivations,
    margin,
    measure_activations,
)
from ane_spec.model.gguf_file import GGUFModel
from ane_spec.shards.weights import check_tensor_finite

# The stream's largest calibrated |value| times this must stay under 65,504: calibration sees a
# few short prompts, and real inputs (long contexts, rare tokens) can go further. 8 (3 bits) is
# what the choice keeps in hand; a model whose measured peak is within 8x of fp16's maximum gets
# scaled down.
SAFETY = 8.0
# `--residual-scale 2^K` accepts K in this range: beyond it eps * s^2 and most weights' scales
# leave fp16 entirely.
MAX_ABS_LOG2 = 12
# The calibration stops after the first tokens of each prompt (activation_range.HEAD_TOKENS)
# when both margins, as the program would hold them, are this many times SAFETY: the remaining
# tokens would have to raise a peak 16x to change k or to bring either margin near SAFETY.
# Random-weight models sit at hundreds or more (synthetic Phi-4-mini: 573x) and stop; the real
# Qwen2.5-Coder 0.5B (50x) and 1.5B (17x) do not, and are measured on every token: the first
# part ends at the layer whose peak refuses the stop, and every token runs from the start.
SETTLED_HEADROOM = 16.0


def parse_residual_scale(text: str) -> str:
    """`auto`, `off` or `2^K` (K an integer, |K| <= MAX_ABS_LOG2); returns it normalised."""
    text = text.strip()
    if text in ("auto", "off"):
        return text
    m = re.fullmatch(r"2\^\(?(-?\d+)\)?", text)
    if not m or abs(int(m.group(1))) > MAX_ABS_LOG2:
        raise BuildError(f"--residual-scale {text!r} must be auto, off or 2^K with K an integer "
                         f"from -{MAX_ABS_LOG2} to {MAX_ABS_LOG2} (e.g. 2^-3)")
    return f"2^{int(m.group(1))}"


def choose_log2(ranges: ActivationRanges, safety: float = SAFETY) -> int:
    """The k (<= 0) that brings the stream's calibrated peak, times `safety`, under 65,504;
    0 where it is already there (the stream is never scaled up)."""
    peak = ranges.residual_max * safety
    if peak <= FP16_MAX:
        return 0
    return -min(MAX_ABS_LOG2, math.ceil(math.log2(peak / FP16_MAX)))


def requested_log2(setting: str, ranges: ActivationRanges | None) -> int:
    if setting == "off":
        return 0
    if setting == "auto":
        if ranges is None:
            raise ValueError("auto needs a calibration")
        return choose_log2(ranges)
    return int(parse_residual_scale(setting).removeprefix("2^"))


def calibrate(model: GGUFModel, setting: str, say: Callable[[str], None],
              checkpoint: Callable[[], None] | None = None) -> ActivationRanges | None:
    """The activation ranges `setting` needs: None for `off`, else the fp32 reference's
    (activation_range.py, which calls `checkpoint` as it goes). A failure is one BuildError
    line; what `checkpoint` raises passes through."""
    if setting == "off":
        return None
    try:
        # `settled` only ever turns false as peaks grow (it asks the peak, as the program
        # holds it, to stay under a bound; auto's k < 0 leaves a margin under 16x), so a
        # partial measurement it refuses is refused for good.
        return measure_activations(model, progress=say, checkpoint=checkpoint,
                                   settled=lambda first: settled(setting, first),
                                   open_for_good=lambda part: not settled(setting, part))
    except ValueError as exc:
        if isinstance(exc, NonFiniteActivations):  # usually a corrupt file: name the
            for tensor in model.tensors.values():  # tensor, as the conversion would have
                check_tensor_finite(tensor)
        raise BuildError(f"activation calibration failed: {exc}") from None


def settled(setting: str, ranges: ActivationRanges) -> bool:
    """Whether a calibration that measured `ranges` so far may stop (see SETTLED_HEADROOM)."""
    log2 = requested_log2(setting, ranges)
    need = SAFETY * SETTLED_HEADROOM
    return (margin(ranges.residual_max, 2.0 ** log2) >= need
            and margin(ranges.ffn_max) >= need)


# Architectures whose residual stream is expected near or past fp16's range: Gemma, trained in
# bf16 with its embeddings multiplied by sqrt(d), is the family the fold was made for
# (activation_range.py), so auto's k is likely below 0 there, and a build that assumed 2^0
# would make its packages twice.
STREAMS_PAST_FP16 = frozenset({"gemma3"})


def assumed_log2(setting: str, arch: str) -> int | None:
    """The k a build may make packages at before its calibration has decided (they are made
    again should the decision differ): `2^K`'s K and `off`'s 0 are the decision itself; `auto`
    is 0 for the architectures whose streams stay within fp16 (every one but those
    STREAMS_PAST_FP16 names), None (wait for the decision) for the others."""
    setting = parse_residual_scale(setting)
    if setting != "auto":
        return requested_log2(setting, None)
    return None if arch in STREAMS_PAST_FP16 else 0
