"""Reshape shapes solved once per distinct question while a program is built.

A decode function's token axis T is a symbol (save_package gives it the RangeDim). Each
`reshape` with a -1 in its target shape (to_heads, the grouped attention, merge_heads: eight
per layer) then infers its output shape by asking sympy to solve volume(x) == volume(shape) for
the new symbol that stands for the -1 (coremltools' iOS15 `reshape._infer_shape_dynamic`, then
`enforce_volumetric_constraint`). That solve was 37% of building a real-size Phi-4-mini's
decode programs (9 ms a reshape, 1.5 s a build); the fixed-T prefill function never asks it.
Every layer asks the same few questions, in symbols of its own.

`solved_once` answers a question it has seen from a cache. Each layer's ops carry symbols of
their own, so a question is keyed with its symbols renamed by their place in it, and the
cached answer is renamed back. The answer is the original function's own; one that still holds
a symbol the volume lacks (nothing solved it) depends on what that symbol is, and is never
cached. So every op gets the shape coremltools would have given it, and the program is the
same (tests/test_reshape_shapes.py). Ten real-size Phi-4-mini layers ask sympy 7 times instead
of 80, and their decode program is built in 0.32 s instead of 0.82.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

import sympy as sm
from coremltools.converters.mil.mil.ops.defs.iOS15 import tensor_transformation
from coremltools.converters.mil.mil.types.symbolic import is_symbolic

_reshape = tensor_transformation.reshape
# One program is built at a time in a process; a second thread that builds one waits here
# rather than seeing the class patched by another's cache. Reentrant: a nested `with` (a
# program built while building another) shares the outer cache.
_lock = threading.RLock()
_depth = 0


@contextlib.contextmanager
def solved_once() -> Iterator[None]:
    """While building: reshape shape questions asked again are answered from a cache (one per
    outermost `with`)."""
    global _depth
    with _lock:
        if _depth:
            _depth += 1
            try:
                yield
            finally:
                _depth -= 1
            return
        original = _reshape.__dict__["enforce_volumetric_constraint"]
        _reshape.enforce_volumetric_constraint = staticmethod(_cached(original.__func__))
        _depth = 1
        try:
            yield
        finally:
            _depth = 0
            _reshape.enforce_volumetric_constraint = original


def _cached(solve):
    cache: dict[tuple, list] = {}

    def enforce(left_volume, inshape: Sequence) -> list:
        names = _canonical_names(left_volume, inshape)
        key = (_rename(left_volume, names), tuple(_rename(d, names) for d in inshape))
        hit = cache.get(key)
        if hit is not None:
            back = {v: k for k, v in names.items()}
            return [_rename(d, back) for d in hit]
        shape = solve(left_volume, list(inshape))
        known = left_volume.free_symbols if is_symbolic(left_volume) else set()
        if not any(is_symbolic(d) and d.free_symbols - known for d in shape):
            cache[key] = [_rename(d, names) for d in shape]
        return shape

    return enforce


def _canonical_names(left_volume, inshape: Sequence) -> dict:
    """Each symbol of the question, mapped to one named by its place in it: the volume's by
    name order, then the shape's by first appearance. Each layer's ops carry symbols of their
    own (is6 in one layer is is34 in the next): renamed, the layers ask one question. The
    canonical symbol keeps the original's assumptions (positive, integer), which the solve
    may use."""
    order: list = sorted(left_volume.free_symbols, key=str) if is_symbolic(left_volume) else []
    for dim in inshape:
        if is_symbolic(dim):
            order.extend(sorted(dim.free_symbols - set(order), key=str))
    return {s: sm.Symbol(f"_canonical_{i}", **s.assumptions0) for i, s in enumerate(order)}


def _rename(value, names: dict):
    return value.xreplace(names) if is_symbolic(value) else value
