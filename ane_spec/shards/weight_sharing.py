"""The pass that stores a layer package's weights once for its two functions.

A layer package holds the decode function and the prefill function (programs.with_prefill),
both built from the same weight arrays. coremltools shares a weight between functions by giving
the consts of equal value one `weight_id` (`const_deduplication._deduplicate_const_across_functions`,
what `ct.utils.save_multifunction` runs). Run here as the conversion's last pass rather than
through save_multifunction, which would write both functions as separate packages, read them
back and write the merge: three writes of every weight instead of one.

coremltools finds equal consts by a hash of their first 100 values and then `np.allclose` over
the whole array, once per weight and function: on a Phi-4-mini-shaped layer package that
comparison was a quarter of the conversion (16.6 of 70 s in a 4-layer build, cProfile). Here
the two functions' consts hold the very same arrays, so a pair that shares its memory is
matched without reading it: the same result, since an array equals itself.
"""

from __future__ import annotations

import hashlib

import numpy as np
from coremltools.converters.mil.mil import Block, Program, Var
from coremltools.converters.mil.mil.passes.defs.cleanup.const_deduplication import (
    const_deduplication,
)
from coremltools.converters.mil.mil.passes.graph_pass import AbstractGraphPass
from coremltools.converters.mil.mil.passes.pass_registry import register_pass
from coremltools.converters.mil.mil.var import ListVar


def same_memory(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `a` and `b` are views of the same bytes in the same layout."""
    return a is b or (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                      and a.shape == b.shape and a.strides == b.strides and a.dtype == b.dtype)


class _SharedArrayDeduplication(const_deduplication):
    """coremltools' const deduplication (coremltools 9.0,
    mil/passes/defs/cleanup/const_deduplication.py), its `find_constants` unchanged but for
    `same_memory` tried before `np.allclose`."""

    @staticmethod
    def find_constants(blocks: list[Block]) -> dict[Var, list[Var]]:
        unique2duplicates: dict[Var, list[Var]] = {}
        constant_dict: dict[tuple, list[Var]] = {}
        for block in blocks:
            for op in list(block.operations):
                if op.op_type != "const":
                    continue
                constant_var = op.outputs[0]
                if isinstance(constant_var, ListVar):
                    continue
                if not const_deduplication.should_be_deduplicated(constant_var.val):
                    continue
                dtype, value = constant_var.dtype, constant_var.val
                prefix = np.ascontiguousarray(
                    value.reshape(-1)[: const_deduplication.LENGTH_OF_HASHKEY])
                key = (dtype, constant_var.shape, hashlib.sha1(prefix).hexdigest())
                if hasattr(op, "weight_key"):
                    key = (op.weight_key, *key)
                if key not in constant_dict:
                    constant_dict[key] = [constant_var]
                    unique2duplicates[constant_var] = []
                    continue
                atol = const_deduplication.DTYPE2ATOL.get(dtype, 1e-12)
                existing = next(
                    (var for var in constant_dict[key]
                     if same_memory(value, var.val)
                     or np.allclose(value, var.val, rtol=0.0, atol=atol)), None)
                if existing is None:
                    constant_dict[key].append(constant_var)
                    unique2duplicates[constant_var] = []
                else:
                    unique2duplicates[existing].append(constant_var)
        return unique2duplicates


@register_pass(namespace="ane_spec")
class share_weights_across_functions(AbstractGraphPass):  # noqa: N801 - coremltools' pass style
    """Consts of equal value in different functions get one `weight_id`, so the weight file
    holds them once."""

    def apply(self, prog: Program) -> None:
        if len(prog.functions) > 1:
            _SharedArrayDeduplication()._deduplicate_const_across_functions(prog)
