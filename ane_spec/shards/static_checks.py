"""Checks run on every built package, by reading it back from disk.

They read the saved protobuf (names, types, op list) without loading the weight blobs, so checking
a 2 GB shard costs well under a second: every input shares the one RangeDim token axis, states
are fp16 and fixed-shape, no op outside the set the compiler emits, no fp32 value anywhere (the
ANE computes only fp16: one fp32-typed op bars it from a layer), weights in the requested format.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import coremltools as ct
import numpy as np
from coremltools.proto import MIL_pb2

from ane_spec.errors import AneSpecError, BuildError
from ane_spec.package_spec import function_description, package_functions
from ane_spec.shards.programs import KV_WRITE_START
from ane_spec.shards.weights import WeightFormat

LAYER_OPS = frozenset({
    "const", "constexpr_blockwise_shift_scale", "constexpr_lut_to_dense", "conv", "concat", "layer_norm", "slice_by_index",
    "mul", "add", "sub", "split", "reshape", "transpose", "matmul", "reduce_sum", "reduce_max",
    "exp", "real_div", "silu", "read_state",
    "gelu",  # gemma3's tanh-GELU gate (mode TANH_APPROXIMATION)
    # Finite-safe KV write (clip, equal, select) and attention mask (greater_equal, select).
    "clip", "equal", "select", "greater_equal",
    # A saved package stores each coreml_update_state as write_state followed by read_state.
    "write_state",
    # The slice-form K/V write (--kv-write slice): a window read, then put back.
    "slice_by_size", "slice_update",
})
HEAD_OPS = LAYER_OPS | {"reduce_argmax"}
# Values a package may hold: fp16 compute, int8 weight payloads, int32 shapes/axes/argmax indices,
# bool flags and string op parameters (pad_type). fp32 and fp64 would run off the Neural Engine;
# any type not named here is refused too, so a new one is a decision, not an accident.
ALLOWED_DTYPES = frozenset({"fp16", "int8", "uint8", "int32", "bool", "string"})

_DTYPES = {MIL_pb2.FLOAT16: "fp16", MIL_pb2.FLOAT32: "fp32", MIL_pb2.FLOAT64: "fp64",
           MIL_pb2.BFLOAT16: "bf16", MIL_pb2.STRING: "string", MIL_pb2.INT32: "int32",
           MIL_pb2.INT8: "int8", MIL_pb2.UINT8: "uint8", MIL_pb2.BOOL: "bool",
           MIL_pb2.INT64: "int64"}


@dataclass
class PackageFacts:
    """What a package says about itself, read from its spec."""

    inputs: dict[str, tuple[list[int], list[tuple[int, int]]]]  # name -> (shape, ranges)
    outputs: list[str]
    states: dict[str, tuple[list[int], str]]                    # name -> (shape, dtype)
    ops: Counter = field(default_factory=Counter)
    conv_weights: list[tuple[str, str, list[int], list[int] | None]] = field(default_factory=list)
    # (conv op name, weight source: "fp16"|"int8"|"lut8"|..., data shape, scale or LUT shape)
    output_dtypes: dict[str, str] = field(default_factory=dict)  # op output name -> tensor dtype
    blockwise: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    # (output name, data shape, scale shape) of every constexpr_blockwise_shift_scale
    palettized: list[tuple[str, str, list[int], list[int]]] = field(default_factory=list)
    # (output name, "lut8" or what it is instead, indices shape, LUT shape) of every
    # constexpr_lut_to_dense
    enumerated_inputs: list[str] = field(default_factory=list)  # inputs with EnumeratedShapes
    io_dtypes: dict[str, str] = field(default_factory=dict)  # model input/output name -> dtype
    # The function's shapes, for limits that depend on them (ane_limits; a prefill function's
    # token axis is its fixed T, the decode function's is symbolic, -1). Weights (const and
    # constexpr_* outputs) are not computed tensors and are left out.
    output_shapes: dict[str, tuple[str, list[int]]] = field(default_factory=dict)
    # op output name -> (op type, dims)
    reductions: list[tuple[str, str, int]] = field(default_factory=list)
    # (output name, "conv"|"matmul", how many products each output element sums; -1 unknown)
    argmax_widths: list[tuple[str, int]] = field(default_factory=list)
    # (output name, length of the axis each reduce_argmax searches; -1 unknown)


def read_package_facts(path: Path, function: str = "main") -> PackageFacts:
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    try:
        desc = function_description(spec, function)
    except AneSpecError as exc:
        raise BuildError(f"{path.name}: {exc}") from None
    inputs = {}
    for i in desc.input:
        arr = i.type.multiArrayType
        ranges = [(r.lowerBound, r.upperBound) for r in arr.shapeRange.sizeRanges]
        inputs[i.name] = (list(arr.shape), ranges)
    states = {}
    for s in desc.state:
        arr = s.type.stateType.arrayType
        states[s.name] = (list(arr.shape), _array_dtype(arr.dataType))
    facts = PackageFacts(inputs=inputs, outputs=[o.name for o in desc.output], states=states)
    facts.io_dtypes = {f.name: _array_dtype(f.type.multiArrayType.dataType)
                       for f in [*desc.input, *desc.output]
                       if f.type.WhichOneof("Type") == "multiArrayType"}
    facts.enumerated_inputs = [i.name for i in desc.input if i.type.WhichOneof("Type") ==
                               "multiArrayType" and i.type.multiArrayType.WhichOneof(
                                   "ShapeFlexibility") == "enumeratedShapes"]

    func = spec.mlProgram.functions[function]
    block = func.block_specializations[func.opset]
    produced: dict[str, tuple[str, str, list[int], list[int] | None]] = {}
    dims = {i.name: _dims(i.type) for i in func.inputs if i.type.WhichOneof("type") ==
            "tensorType"}
    scalars: dict[str, object] = {}  # const op output -> its value, where a scalar
    for op in block.operations:
        facts.ops[op.type] += 1
        if not op.outputs:  # e.g. coreml_update_state whose result nothing reads
            continue
        for o in op.outputs:
            if o.type.WhichOneof("type") == "tensorType":
                facts.output_dtypes[o.name] = _tensor_dtype(o.type)
                dims[o.name] = _dims(o.type)
                if op.type != "const" and not op.type.startswith("constexpr_"):
                    facts.output_shapes[o.name] = (op.type, dims[o.name])
        out = op.outputs[0]
        if op.type == "const":
            scalars[out.name] = _scalar(op.attributes["val"]) if "val" in op.attributes else None
        elif op.type == "matmul":
            facts.reductions.append((out.name, "matmul", _matmul_depth(op, dims, scalars)))
        elif op.type == "reduce_argmax":
            shape = dims.get(_arg_name(op, "x") or "", [])
            axis = _arg_value(op, "axis", scalars)
            width = (shape[int(axis)] if isinstance(axis, int) and -len(shape) <= axis <
                     len(shape) else -1)
            facts.argmax_widths.append((out.name, width))
        if op.type == "const":
            produced[out.name] = ("const", _tensor_dtype(out.type), _dims(out.type), None)
        elif op.type == "constexpr_blockwise_shift_scale":
            data, scale = _source(op, "data", produced), _source(op, "scale", produced)
            produced[out.name] = ("blockwise", data[1], data[2], scale[2])
            facts.blockwise.append((out.name, data[2], scale[2]))
        elif op.type == "constexpr_lut_to_dense":
            indices, lut = _source(op, "indices", produced), _source(op, "lut", produced)
            # An 8-bit palette of fp16 entries is "lut8"; anything else is named as it is.
            kind = ("lut8" if (indices[1], lut[1]) == ("uint8", "fp16")
                    else f"lut({indices[1]} indices, {lut[1]} entries)")
            produced[out.name] = ("lut", kind, indices[2], lut[2])
            facts.palettized.append((out.name, kind, indices[2], lut[2]))
        elif op.type == "conv":
            src = _source(op, "weight", produced)
            facts.conv_weights.append((out.name, src[1], src[2], src[3]))
            # [C_out, C_in / groups, kH, kW]: each output sums C_in / groups x kH x kW products.
            kernel = src[2][1:]
            depth = (int(np.prod(kernel)) if len(kernel) == 3 and min(kernel) > 0 else -1)
            facts.reductions.append((out.name, "conv", depth))
    return facts


def _arg_name(op: MIL_pb2.Operation, name: str) -> str | None:
    if name not in op.inputs or not op.inputs[name].arguments:
        return None
    binding = op.inputs[name].arguments[0]
    return binding.name if binding.WhichOneof("binding") == "name" else None


def _arg_value(op: MIL_pb2.Operation, name: str, scalars: dict[str, object]) -> object:
    """A scalar argument's value, given inline or by a const op; None if absent or unknown."""
    if name not in op.inputs or not op.inputs[name].arguments:
        return None
    binding = op.inputs[name].arguments[0]
    if binding.WhichOneof("binding") == "name":
        return scalars.get(binding.name)
    return _scalar(binding.value)


def _scalar(value: MIL_pb2.Value) -> object:
    """A scalar bool or int stored immediately in a Value; None for anything else."""
    if value.WhichOneof("value") != "immediateValue":
        return None
    tensor = value.immediateValue.tensor
    for kind in ("bools", "ints", "longInts"):
        values = getattr(tensor, kind).values
        if len(values) == 1:
            return bool(values[0]) if kind == "bools" else int(values[0])
    return None


def _matmul_depth(op: MIL_pb2.Operation, dims: dict[str, list[int]],
                  scalars: dict[str, object]) -> int:
    """The length of the axis matmul sums over: x's last axis (its second last, transposed)."""
    x = dims.get(_arg_name(op, "x") or "", [])
    if len(x) < 2:
        return -1
    return x[-2] if _arg_value(op, "transpose_x", scalars) is True else x[-1]


def check_package(path: Path, *, kind: str, weights: WeightFormat, max_t: int = 4,
                  prefill_t: int = 0) -> PackageFacts:
    """Raise BuildError naming every violation; return the facts for the manifest (of the
    default function). `prefill_t` > 0: the package must also hold the prefill function, the
    same program at that fixed T, with the same states."""
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    functions = package_functions(spec)
    want = ["main", "prefill"] if prefill_t else ["main"]
    if functions != want:
        raise BuildError(f"static checks failed for {path.name}: it holds the functions "
                         f"{functions}, not {want}")
    facts = read_package_facts(path)
    problems = _function_problems(facts, kind, weights, flexible_t=max_t)
    if prefill_t:
        prefill = read_package_facts(path, "prefill")
        problems += [f"prefill: {p}" for p in _function_problems(prefill, kind, weights,
                                                                   fixed_t=prefill_t)]
        if prefill.states != facts.states:
            problems.append("the prefill function's states differ from main's: one state "
                            "could not serve both")
    if problems:
        raise BuildError(f"static checks failed for {path.name}:\n  - " + "\n  - ".join(problems))
    return facts


def _function_problems(facts: PackageFacts, kind: str, weights: WeightFormat, *,
                       flexible_t: int = 0, fixed_t: int = 0) -> list[str]:
    """One function's violations: its token axis is one RangeDim(1, flexible_t) shared by every
    input, or (fixed_t) the same axis at that fixed size with no range at all."""
    problems: list[str] = []
    for name, (shape, ranges) in facts.inputs.items():
        if fixed_t:
            if any(lo != hi for lo, hi in ranges) or fixed_t not in shape:
                problems.append(f"input '{name}' must have a fixed shape with a {fixed_t}-row "
                                f"token axis, has shape {shape} and ranges {ranges}")
            continue
        flexible = [(axis, r) for axis, r in enumerate(ranges) if r[0] != r[1]]
        if len(flexible) != 1 or flexible[0][1] != (1, flexible_t):
            problems.append(f"input '{name}' must have exactly one RangeDim(1, {flexible_t}) "
                            f"axis, has ranges {ranges}")
    for name, (shape, dtype) in facts.states.items():
        if dtype != "fp16":
            problems.append(f"state '{name}' is {dtype}, must be fp16")
        if any(d <= 0 for d in shape):
            problems.append(f"state '{name}' has a non-fixed shape {shape}")

    allowed = HEAD_OPS if kind == "head" else LAYER_OPS
    extra = sorted(set(facts.ops) - allowed)
    if extra:
        problems.append(f"ops outside the compiler's set: {', '.join(extra)}")
    problems += dtype_problems(facts)

    for conv, dtype, data_shape, scale_shape in facts.conv_weights:
        problem = _weight_problem(weights, dtype, data_shape, scale_shape)
        if problem:
            problems.append(f"conv '{conv}': {problem}")
    if not facts.conv_weights:
        problems.append("no conv ops: not a layer or head package")
    return problems


def dtype_problems(facts: PackageFacts) -> list[str]:
    """Every value typed wider than fp16 (or otherwise outside ALLOWED_DTYPES), by name: op
    outputs, including consts, and the model's inputs and outputs."""
    problems = []
    by_dtype: dict[str, list[str]] = {}
    for name, dtype in facts.output_dtypes.items():
        if dtype not in ALLOWED_DTYPES:
            by_dtype.setdefault(dtype, []).append(name)
    for dtype, names in sorted(by_dtype.items()):
        problems.append(f"{len(names)} op output(s) typed {dtype} (e.g. '{names[0]}'): every op "
                        "must be fp16 for the Neural Engine")
    for name, dtype in facts.io_dtypes.items():
        if dtype not in ALLOWED_DTYPES:
            problems.append(f"model input/output '{name}' is {dtype}, must be fp16 (or int32)")
        elif dtype == "int32" and name in facts.inputs and name != KV_WRITE_START:
            # The one integer input is the slice form's window starts; any other would be a
            # value the host meant as fp16.
            problems.append(f"model input '{name}' is int32; only '{KV_WRITE_START}' may be")
    return problems


def _weight_problem(fmt: WeightFormat, dtype: str, data: list[int],
                    scale: list[int] | None) -> str | None:
    if fmt == "auto":  # each conv's own choice: int8 per channel, lut8 or fp16
        if dtype == "fp16" and scale is None:
            return None
        if dtype == "lut8":
            return _lut_problem(data, scale)
        return _weight_problem("int8-channel", dtype, data, scale)
    if fmt == "fp16":
        return None if scale is None and dtype == "fp16" else f"weights are {dtype}, not fp16"
    if scale is None or dtype != "int8":
        return f"weights are {dtype} without a blockwise scale, not {fmt}"
    per_channel = scale[1:] == [1] * (len(scale) - 1)
    if fmt == "int8-channel" and not per_channel:
        return f"scale shape {scale} is not one scale per output channel"
    if fmt == "q8-block" and (per_channel or data[1] // scale[1] != 32):
        return f"scale shape {scale} is not one scale per 32 inputs"
    return None


def _lut_problem(indices: list[int], lut: list[int] | None) -> str | None:
    """lut8 as weights.py writes it: [out, in, 1, 1] indices, a [groups, 1, 1, 1, 256, 1]
    table of groups of whole output rows."""
    if lut is None or len(lut) != len(indices) + 2 or lut[-2:] != [256, 1]:
        return f"LUT shape {lut} is not 256 scalar entries per table"
    if lut[1:len(indices)] != [1] * (len(indices) - 1) or lut[0] < 1 or indices[0] % lut[0]:
        return f"LUT shape {lut} is not one table per group of output rows of {indices}"
    return None


def _source(op: MIL_pb2.Operation, name: str,
            produced: dict[str, tuple[str, str, list[int], list[int] | None]]
            ) -> tuple[str, str, list[int], list[int] | None]:
    """Where an op's argument comes from: an earlier op by name, or a value stored inline."""
    binding = op.inputs[name].arguments[0]
    if binding.WhichOneof("binding") == "name":
        return produced.get(binding.name, ("computed", "computed", [], None))
    return ("const", _tensor_dtype(binding.value.type), _dims(binding.value.type), None)


def _dims(t: MIL_pb2.ValueType) -> list[int]:
    return [d.constant.size if d.WhichOneof("dimension") == "constant" else -1
            for d in t.tensorType.dimensions]


def _tensor_dtype(t: MIL_pb2.ValueType) -> str:
    return _DTYPES.get(t.tensorType.dataType, str(t.tensorType.dataType))


def _array_dtype(code: int) -> str:
    from coremltools.proto import FeatureTypes_pb2 as ft

    return {ft.ArrayFeatureType.FLOAT16: "fp16", ft.ArrayFeatureType.FLOAT32: "fp32",
            ft.ArrayFeatureType.DOUBLE: "fp64", ft.ArrayFeatureType.INT32: "int32"
            }.get(code, str(code))
