"""How wide decoding passes are, and everything that follows from that one choice.

- `fixed` (default): every pass computes T_max rows, whatever it carries; short blocks are padded
  with rows that repeat the last token and write nothing. A token's arithmetic then never depends
  on how the decoder batched it, so on a row-invariant backend (`probe row-invariance`)
  speculative decoding equals greedy decoding bitwise, in fp16 too. Nothing needs calibrating:
  one JIT width, no guard, and every draft slot is filled (an empty one costs as much).
- `mixed`: a pass is as wide as its tokens (T=1 decode, T=T_max verify). Cheaper where a T=1
  pass costs much less than a wide one, but the widths round differently, so in fp16 it is only
  close: the exactness guard redoes near-tie rows at T=1 (margin from the measured drift), and
  drafts fill every slot only where a wide pass costs little more than a T=1 pass.

`DecodeShapePolicy` is the only place that branches on the shape: the pipeline, the decode session
and the daemon ask it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ane_spec.errors import AneSpecError

DecodeShape = Literal["fixed", "mixed"]
DECODE_SHAPES: tuple[DecodeShape, ...] = ("fixed", "mixed")
# Core ML's reshapeFrequency hint: one shape for the program's lifetime, or alternating widths.
ReshapeFrequency = Literal["Infrequent", "Frequent"]
RESHAPE_FREQUENCIES: tuple[ReshapeFrequency, ...] = ("Infrequent", "Frequent")
# Which prompt chunks run through a build's prefill function (decode/prefill_plan.py): where the
# backend's measured costs say it is cheaper, every chunk, or none.
PrefillMode = Literal["auto", "on", "off"]
PREFILL_MODES: tuple[PrefillMode, ...] = ("auto", "on", "off")
# Two logits that may each move by `drift` can swap when their gap is under 2 * drift.
GUARD_FACTOR = 2.0
# Below this c(T=T_max)/c(T=1) the extra rows are close enough to free that guessing pays.
FILL_BELOW_RATIO = 1.5


def check_prefill_mode(mode: str) -> PrefillMode:
    if mode not in PREFILL_MODES:
        raise AneSpecError(f"unknown prefill mode '{mode}' (choose {', '.join(PREFILL_MODES)})")
    return mode  # type: ignore[return-value]


def check_decode_shape(decode_shape: str) -> DecodeShape:
    if decode_shape not in DECODE_SHAPES:
        raise AneSpecError(f"unknown decode shape '{decode_shape}' (choose "
                           f"{' or '.join(DECODE_SHAPES)})")
    return decode_shape  # type: ignore[return-value]


@dataclass(frozen=True)
class DecodeShapePolicy:
    name: DecodeShape
    max_t: int = 4

    def __post_init__(self) -> None:
        check_decode_shape(self.name)

    @property
    def uniform(self) -> bool:
        """Every pass has the same width: exact by construction, nothing to calibrate."""
        return self.name == "fixed"

    def pass_width(self, t: int) -> int:
        """Rows a pass carrying `t` tokens computes."""
        return self.max_t if self.uniform else t

    @property
    def jit_widths(self) -> list[int]:
        """The pass widths this shape runs: on Core ML, one JIT specialisation per program each,
        paid on first use (so warm-up runs each)."""
        return [self.max_t] if self.uniform else sorted({1, self.max_t})

    @property
    def reshape_frequency(self) -> ReshapeFrequency:
        return "Infrequent" if self.uniform else "Frequent"

    @property
    def needs_drift(self) -> bool:
        """Whether the guard needs the backend's measured drift between pass widths."""
        return not self.uniform

    @property
    def needs_pass_costs(self) -> bool:
        """Whether filling draft slots depends on measured T=1 / T=T_max pass costs."""
        return not self.uniform

    def guard_margin(self, drift: float | None) -> float | None:
        """The exactness guard's top-1/top-2 margin: None where no row needs a second opinion
        (uniform widths) or the drift was never measured."""
        return None if self.uniform or drift is None else GUARD_FACTOR * drift

    def fill_drafts(self, pass_cost_ratio: Callable[[], float]) -> bool:
        """Whether every draft slot is filled. `pass_cost_ratio` (c(T_max) / c(T=1)) is measured
        only when this shape needs it."""
        return True if self.uniform else pass_cost_ratio() <= FILL_BELOW_RATIO

    def drafts_cannot_change_output(self, greedy: bool, seeded: bool) -> bool:
        """Whether drafts from other requests may be used: greedy output is independent of the
        drafts only where it is exact by construction; a seeded sample depends on the random
        draws its drafts consume, an unseeded one has nothing to reproduce."""
        return self.uniform if greedy else not seeded
