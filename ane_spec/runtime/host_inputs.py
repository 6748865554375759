"""The host-side inputs of a block of T tokens at position p, built in one place for every backend.

Slots are append-only: row i of the block writes slot p+i and may see slots 0..p+i. Slots past
p+i may hold rejected drafts from an earlier pass; the mask hides them and a later pass
overwrites them, so no state copy or rollback is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.model.rope import RopeSpec

# Finite so fp16 adds stay finite, and far below any real score so exp() underflows to 0 in the
# fp32 softmax.
MASK_VALUE = -1.0e4


@dataclass
class HostInputs:
    """Precomputed RoPE tables for every slot; per call, only slices and two small masks."""

    rope: RopeSpec
    max_seq: int
    max_t: int = 4
    # fp16 is what the packages declare and the ANE runs; fp32 lets an fp32 backend measure the
    # graph's own math without the rounding of its inputs.
    dtype: type = np.float16

    def __post_init__(self) -> None:
        cos, sin = self.rope.tables(np.arange(self.max_seq), np.float64)
        self.cos = cos.astype(self.dtype)
        self.sin = sin.astype(self.dtype)

    def block(self, position: int, t: int) -> dict[str, np.ndarray]:
        if not 1 <= t <= self.max_t:
            raise AneSpecError(f"a block holds 1..{self.max_t} tokens, got {t}")
        if position < 0 or position + t > self.max_seq:
            raise AneSpecError(f"positions {position}..{position + t - 1} do not fit the "
                               f"context window of {self.max_seq} slots")
        rows = position + np.arange(t)
        mask = np.where(np.arange(self.max_seq)[None, :] <= rows[:, None], 0.0, MASK_VALUE)
        write = np.zeros((self.max_seq, t), dtype=self.dtype)
        write[rows, np.arange(t)] = 1.0
        return {
            "rope_cos": self.cos[position:position + t],
            "rope_sin": self.sin[position:position + t],
            "attn_mask": mask.astype(self.dtype).reshape(1, 1, t, self.max_seq),
            "kv_write_mask": write.reshape(1, 1, self.max_seq, t),
        }
