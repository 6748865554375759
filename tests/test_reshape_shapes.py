"""Reshape shapes answered from a cache while a program is built (shards/reshape_shapes.py)
give every program the shapes coremltools' own solve gives it: the same program, op for op."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import pytest
import sympy as sm
from coremltools.converters.mil.mil import get_new_symbol

from ane_spec.model.gguf_file import open_gguf
from ane_spec.model.synthetic import preset, write_synthetic_gguf
from ane_spec.shards import programs, reshape_shapes
from ane_spec.shards.build import BuildRequest, ring_size
from ane_spec.shards.layer_weights import layer_weights

# Every architecture's layer graph (NORM RoPE, fused q|k|v bias, per-head norms, a sliding
# window's ring), both layouts and both K/V write forms.
CASES = {
    "phi3-BC1T": ("tiny", {"num_layers": 2}, {"layout": "BC1T"}),
    "phi3-slice": ("tiny", {"num_layers": 2}, {"kv_write": "slice"}),
    "llama": ("tiny", {"arch": "llama", "num_layers": 2}, {}),
    "qwen2": ("tiny", {"arch": "qwen2", "num_layers": 2}, {}),
    "qwen3": ("tiny", {"arch": "qwen3", "num_layers": 2}, {"layout": "BC1T"}),
    "gemma3-ring": ("gemma3-tiny", {"seed": 11}, {"max_seq": 512}),
}


def _programs(gguf: Path, options: dict) -> list[str]:
    """The text of every program a build of `gguf` makes from its layers: decode and prefill,
    for the whole model in one shard and for one layer at a time."""
    model = open_gguf(gguf)
    c = model.config
    r = BuildRequest(**{"max_seq": 64, **options})
    layers = [layer_weights(model, i, "int8-channel", {}) for i in range(c.num_layers)]
    out = []
    for first, part in [(0, layers)] + [(i, [w]) for i, w in enumerate(layers)]:
        for tokens in (None, 16):
            out.append(_named_in_order(str(programs.layer_program(
                first, part, c, r.max_seq, r.layout, ring=ring_size(c, r), tokens=tokens,
                kv_write=r.kv_write))))
    return out


def _named_in_order(text: str) -> str:
    """`text` with its symbols and blocks (is<N>, block<N>: numbered by counters global to the
    process) renamed by first appearance: two builds of one program in one process then read
    the same."""
    names: dict[str, str] = {}
    return re.sub(r"\b(is|block)\d+\b",
                  lambda m: names.setdefault(m[0], f"{m[1]}_{len(names)}"), text)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cached_shapes_build_the_same_programs(case: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    name, spec, options = CASES[case]
    gguf = write_synthetic_gguf(tmp_path / "m.gguf", preset(name, **spec))
    cached = _programs(gguf, options)
    monkeypatch.setattr(programs, "solved_once", contextlib.nullcontext)
    assert _programs(gguf, options) == cached


def _counting_cache() -> tuple[object, list]:
    asked: list = []
    original = reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"].__func__

    def solve(left, shape):
        asked.append((left, shape))
        return original(left, shape)

    return reshape_shapes._cached(solve), asked


def test_each_layers_symbols_ask_one_question() -> None:
    enforce, asked = _counting_cache()
    answers = []
    for _ in range(3):   # three layers: new symbols for T and for the -1 each time
        t, fresh = get_new_symbol(), get_new_symbol()
        answers.append((t, enforce(3072 * t, [1, 8, fresh, 128])))
    assert len(asked) == 1
    for t, shape in answers:
        assert shape == [1, 8, 3 * t, 128]


def test_an_unsolved_question_is_solved_every_time() -> None:
    """An answer that keeps a symbol the volume lacks depends on what that symbol is: never
    reused."""
    enforce, asked = _counting_cache()
    t = get_new_symbol()
    for _ in range(2):
        a, fresh = get_new_symbol(), get_new_symbol()
        shape = enforce(3072 * t, [a, fresh, 128])
        assert a in sm.sympify(shape[0]).free_symbols
    assert len(asked) == 2


def test_the_class_is_restored_and_nesting_shares_it() -> None:
    original = reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"]
    with reshape_shapes.solved_once():
        inside = reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"]
        assert inside is not original
        with reshape_shapes.solved_once():
            assert reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"] is inside
        assert reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"] is inside
    assert reshape_shapes._reshape.__dict__["enforce_volumetric_constraint"] is original
