"""RoPE tables: factor-set choice, partial dims, attention factor."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from ane_spec.errors import ConfigError
from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.rope import choose_factor_set


def test_factor_set_switches_above_the_original_context() -> None:
    assert choose_factor_set(4096, 4096) == "short"
    assert choose_factor_set(4097, 4096) == "long"
    assert choose_factor_set(2048, 4096) == "short"


def test_tables_follow_the_contract_formula(tiny_gguf: Path) -> None:
    m = open_gguf(tiny_gguf)
    attn = m.config.rope_attn_factor
    for window, factors in ((4096, m.rope_factors("short")), (8192, m.rope_factors("long"))):
        spec = m.rope_spec(window)
        assert spec.factor_set == ("short" if window == 4096 else "long")
        cos, sin = spec.tables([0, 1, 37], np.float64)
        assert cos.shape == (3, 12)
        np.testing.assert_allclose(cos[0], attn)  # theta 0: cos scaled by the factor, sin 0
        np.testing.assert_allclose(sin[0], 0.0)
        j = 5
        theta = 37 * 10000 ** (-2 * j / 24) / float(factors[j])
        assert cos[2, j] == pytest.approx(math.cos(theta) * attn, rel=1e-12)
        assert sin[2, j] == pytest.approx(math.sin(theta) * attn, rel=1e-12)
    assert not np.allclose(m.rope_factors("long"), 1.0)
    np.testing.assert_array_equal(m.rope_factors("short"), 1.0)


def test_window_beyond_context_is_refused(tiny_gguf: Path) -> None:
    with pytest.raises(ConfigError, match="outside 1..131072"):
        open_gguf(tiny_gguf).rope_spec(200000)
