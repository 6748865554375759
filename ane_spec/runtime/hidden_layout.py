"""The packages' hidden-state layouts, read the same way in-process and in the Core ML worker.

A hidden state (and each head output of a "channels" head) is [1, C, T, 1] in BCT1, ane-book's default, or
[1, C, 1, T] in BC1T, Apple's recommended one: channels first, the token axis T in either of
the two trailing axes.
"""

from __future__ import annotations

import numpy as np


def token_axis(layout: str) -> int:
    return 2 if layout == "BCT1" else 3


def token_major(x: np.ndarray, layout: str) -> np.ndarray:
    """A [T, C] view of a hidden-layout array (no copy)."""
    return (x[0, :, :, 0] if layout == "BCT1" else x[0, :, 0, :]).T


def head_token_major(x: np.ndarray, layout: str, head_layout: str) -> np.ndarray:
    """A [T, V_i] view of one head output: the hidden layout's (head layout "channels"), or
    [1, T, V_i] (head layout "vocab-last"), whose rows are already contiguous. No copy."""
    return x[0] if head_layout == "vocab-last" else token_major(x, layout)


def repeat_row(x: np.ndarray, row: int, width: int, layout: str) -> np.ndarray:
    """Row `row` of a hidden-layout array, repeated `width` times along the token axis: a
    prefill chunk's last row, fed to the LM head as a decode pass pads its rows."""
    axis = token_axis(layout)
    return np.ascontiguousarray(np.repeat(np.take(x, [row], axis=axis), width, axis=axis))
