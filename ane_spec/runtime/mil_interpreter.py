"""Run Core ML ML-program (MIL) functions with numpy, so shipped .mlpackage files run on Linux.

coremltools can build, save and load ML programs anywhere but only executes them on macOS. This
interpreter walks a loaded `Program`'s function once, evaluating every const and `constexpr_*` op
(and anything depending only on them) at load time, and replays the remaining ops in order on each
`predict` call. The op kernels live in `mil_ops`.

Precision:
  * "fp32": every floating value is float32; fp16 declarations (inputs, consts, states, casts) are
    ignored, giving the "ideal" result of the program's math.
  * "fp16": emulates an fp16 device (the ANE): each op computes in float32 (so matmul, conv,
    reductions, softmax and layer_norm accumulate in fp32) and its output is rounded to float16
    when its declared dtype is fp16. Values declared fp32 (e.g. after `cast(dtype="fp32")`) stay
    float32. States are float16 arrays. The compiler's attention softmax is five fp16 ops
    (reduce_max, sub, exp, reduce_sum, real_div), so it is rounded after each of them, as
    declared; a single `softmax` op would be rounded once, at its output.

Kernels:
  * "row" (default): conv and matmul compute every token row with its own product, so a row's
    result never depends on its index in the block or on its neighbours (row invariance).
  * "batched": one BLAS call per block, as the interpreter first did: faster on wide blocks, and
    a real backend on which `probe row-invariance` fails (OpenBLAS edge kernels).
"""

from __future__ import annotations

import hashlib
import os
import warnings
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.runtime.mil_ops import BATCHED_KERNELS, OPS, Args, Kernel

if TYPE_CHECKING:
    from coremltools.converters.mil import Program

Precision = Literal["fp32", "fp16"]
_PRECISIONS = ("fp32", "fp16")
Kernels = Literal["row", "batched"]
KERNELS: tuple[Kernels, ...] = ("row", "batched")


class MILLoadError(AneSpecError):
    """The package or program cannot be loaded as an executable ML program."""


class UnsupportedOpError(MILLoadError):
    """The program uses an op (or an op parameter) the interpreter does not implement."""

    def __init__(self, op_type: str, op_name: str, reason: str = "") -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"unsupported MIL op '{op_type}' (op '{op_name}'){detail}")
        self.op_type = op_type
        self.op_name = op_name


class InvalidInputError(AneSpecError, ValueError):
    """`predict` was called with inputs or states that do not match the program's declarations."""


# Consts at least this large are shared by content (`SharedConsts`); smaller ones cost less to
# keep twice than to hash.
_SHARED_MIN_BYTES = 1 << 16


@dataclass
class SharedConsts:
    """Large const values, and what the load-time folding makes of them, by content: the
    interpreters of one package's functions (a layer package's decode and prefill functions
    hold the same weights, stored once) hold each weight once, as float32, not once per
    function. Weakly held: a value lives as long as some interpreter uses it."""

    values: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)

    @staticmethod
    def key(value: Any) -> tuple | None:
        """A content key for a large array, None for anything small enough not to share."""
        if not isinstance(value, np.ndarray) or value.nbytes < _SHARED_MIN_BYTES:
            return None
        digest = hashlib.blake2b(np.ascontiguousarray(value).view(np.uint8), digest_size=20)
        return value.dtype.str, value.shape, digest.hexdigest()


@dataclass(frozen=True)
class _Step:
    """One runtime op: where its inputs come from and how to store its outputs."""

    op_type: str
    name: str
    kernel: Kernel
    upcast: bool
    refs: dict[str, str | tuple[str, ...]]  # parameter -> var name(s) in the environment
    defaults: dict[str, Any]  # parameters the op leaves to its declared default
    outputs: tuple[str, ...]
    out_dtypes: tuple[np.dtype | None, ...]  # storage dtype per output; None = leave as is
    out_shapes: tuple[tuple[int | None, ...], ...]  # declared shapes, None where symbolic


class MILInterpreter:
    input_names: list[str]
    output_names: list[str]
    state_names: list[str]
    input_shapes: dict[str, tuple[int | None, ...]]
    state_shapes: dict[str, tuple[int, ...]]

    @classmethod
    def from_package(
        cls, path: str | os.PathLike, precision: Precision = "fp32", function: str = "main",
        kernels: Kernels = "row", shared: SharedConsts | None = None,
    ) -> MILInterpreter:
        import coremltools as ct
        from coremltools.converters.mil.frontend.milproto.load import load

        path = os.fspath(path)
        if not os.path.isdir(path):
            raise MILLoadError(f"{path}: not an .mlpackage directory")
        spec = ct.models.MLModel(path, skip_model_load=True).get_spec()
        if spec.WhichOneof("Type") != "mlProgram":
            raise MILLoadError(f"{path}: not an ML program (model type {spec.WhichOneof('Type')})")
        weights = os.path.join(path, "Data", "com.apple.CoreML", "weights")
        functions = spec.mlProgram.functions
        if function not in functions:
            raise MILLoadError(f"{path}: no function {function!r}; have {sorted(functions)}")
        # coremltools' loader parses (and reads the weights of) every function in the program:
        # only the one asked for is kept, so a package's decode and prefill functions, loaded
        # as two programs, cost one parse each instead of two.
        for other in [name for name in functions if name != function]:
            del functions[other]
        program = load(spec, spec.specificationVersion, weights)
        interp = cls(program, precision, function, kernels, shared)
        interp._bounds = _shape_ranges(spec, function)
        return interp

    @classmethod
    def from_program(
        cls, program: Program, precision: Precision = "fp32", function: str = "main",
        kernels: Kernels = "row",
    ) -> MILInterpreter:
        return cls(program, precision, function, kernels)

    def __init__(self, program: Program, precision: Precision, function: str,
                 kernels: Kernels = "row", shared: SharedConsts | None = None) -> None:
        if precision not in _PRECISIONS:
            raise ValueError(f"precision must be one of {_PRECISIONS}, got {precision!r}")
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
        self.kernels: Kernels = kernels
        if function not in program.functions:
            raise MILLoadError(f"no function {function!r}; have {sorted(program.functions)}")
        self.precision: Precision = precision
        self._shared = shared
        self._bounds: dict[str, tuple[tuple[int, int], ...]] = {}
        self._declare_io(program.functions[function])
        self._consts: dict[str, Any] = {}
        self._steps: list[_Step] = []
        self._compile(program.functions[function])

    # ------------------------------------------------------------------------------ loading

    def _declare_io(self, fn: Any) -> None:
        from coremltools.converters.mil.mil import types

        self.input_names, self.state_names = [], []
        self.input_shapes, self.state_shapes = {}, {}
        self._input_dtypes: dict[str, np.dtype] = {}
        self._state_dtypes: dict[str, np.dtype] = {}
        for name, var in fn.inputs.items():
            if types.is_state(var.sym_type):
                self.state_names.append(name)
                self.state_shapes[name] = tuple(int(d) for d in var.shape)
                self._state_dtypes[name] = self._storage_dtype(var.dtype)
            else:
                self.input_names.append(name)
                self.input_shapes[name] = tuple(_static_dim(d) for d in var.shape)
                self._input_dtypes[name] = self._storage_dtype(var.dtype)
        self.output_names = [v.name for v in fn.outputs]
        # What predict returns: float32 in fp32 mode, the declared dtype in fp16 mode.
        self._output_dtypes = {v.name: self._storage_dtype(v.dtype) for v in fn.outputs}

    def _storage_dtype(self, builtin: Any) -> np.dtype:
        from coremltools.converters.mil.mil import types

        dtype = np.dtype(types.nptype_from_builtin(builtin))
        if dtype.kind == "f":
            return np.dtype(
                np.float16 if self.precision == "fp16" and dtype.itemsize == 2 else np.float32
            )
        return dtype

    def _compile(self, fn: Any) -> None:
        """Walk the ops once: reject unsupported ones, fold everything computable now."""
        keys: dict[str, tuple | None] = {}  # content keys of the shared consts, by var name
        for op in fn.operations:
            if op.op_type == "const":
                name, val = op.outputs[0].name, op.outputs[0].val
                keys[name] = SharedConsts.key(val) if self._shared is not None else None
                self._consts[name] = self._shared_value(
                    keys[name] and ("const", keys[name]), lambda: self._const_value(val))
                continue
            step = self._make_step(op)
            if not OPS[op.op_type].stateful and all(
                _names_in(ref, self._consts) for ref in step.refs.values()
            ):
                # constexpr_* ops, and anything else fed only by consts, run once here; a fold
                # of shared consts is itself shared (same op, same inputs, same precision).
                key = self._fold_key(step, keys)
                for n, name in enumerate(step.outputs):
                    keys[name] = key and (key, n)
                values = self._shared_value(
                    key and (key, 0),
                    lambda: [_upcast(v) for v in self._run_step(step, self._consts)],
                    many=len(step.outputs))
                for name, value in zip(step.outputs, values):
                    self._consts[name] = value
            else:
                self._steps.append(step)
        self._drop_unused_consts()

    def _fold_key(self, step: _Step, keys: Mapping[str, tuple | None]) -> tuple | None:
        """What makes a load-time fold shareable: its op, its parameters (each a shared const's
        key, or a small value itself) and the precision; None if any array input is unshared."""
        if self._shared is None:
            return None
        parts: list[Any] = [step.op_type, self.precision]
        shared = False
        for param, ref in sorted(step.refs.items()):
            for r in (ref,) if isinstance(ref, str) else ref:
                if keys.get(r) is not None:
                    parts.append((param, keys[r]))
                    shared = True
                    continue
                value = self._consts[r]
                if isinstance(value, np.ndarray) and value.nbytes >= _SHARED_MIN_BYTES:
                    return None
                parts.append((param, repr(value)))
        parts.append(repr(sorted(step.defaults.items())))
        return tuple(parts) if shared else None

    def _shared_value(self, key: tuple | None, make: Any, many: int = 0) -> Any:
        """`make()`, or the value another interpreter made under the same key. `many`: make
        returns that many outputs, each held under (key[0], index)."""
        if key is None or self._shared is None:
            return make()
        table = self._shared.values
        if many:
            found = [table.get((key[0], n)) for n in range(many)]
            if all(v is not None for v in found):
                return found
            values = make()
            for n, v in enumerate(values):
                if isinstance(v, np.ndarray):
                    table[(key[0], n)] = v
            return values
        value = table.get(key)
        if value is None:
            value = make()
            if isinstance(value, np.ndarray):
                table[key] = value
        return value

    def _make_step(self, op: Any) -> _Step:
        opdef = OPS.get(op.op_type)
        if opdef is None:
            raise UnsupportedOpError(op.op_type, op.name)
        refs, known = self._resolve_inputs(op)
        defaults = {
            k: v for k, v in op.default_inputs().items() if k not in op.inputs and v is not None
        }
        reason = opdef.check(op, {**defaults, **known}) if opdef.check else None
        if reason:
            raise UnsupportedOpError(op.op_type, op.name, reason)
        return _Step(
            op_type=op.op_type,
            name=op.name,
            kernel=(BATCHED_KERNELS.get(op.op_type, opdef.kernel) if self.kernels == "batched"
                    else opdef.kernel),
            upcast=opdef.upcast,
            refs=refs,
            defaults=defaults,
            outputs=tuple(v.name for v in op.outputs),
            out_dtypes=tuple(
                None if v.dtype is None else self._storage_dtype(v.dtype) for v in op.outputs
            ),
            out_shapes=tuple(tuple(_static_dim(d) for d in v.shape) for v in op.outputs),
        )

    def _resolve_inputs(self, op: Any) -> tuple[dict[str, str | tuple[str, ...]], Args]:
        """Map each op parameter to var name(s); also return parameters already known as consts."""
        refs: dict[str, str | tuple[str, ...]] = {}
        known: Args = {}
        for param, arg in op.inputs.items():
            if isinstance(arg, (list, tuple)):
                refs[param] = tuple(self._ref(v) for v in arg)
            else:
                refs[param] = self._ref(arg)
                if refs[param] in self._consts:
                    known[param] = self._consts[refs[param]]
        return refs, known

    def _ref(self, var: Any) -> str:
        # Vars without a producing op in this block (e.g. builder defaults) carry their value.
        if var.name not in self._consts and var.op is not None and var.op.op_type == "const":
            self._consts[var.name] = self._const_value(var.val)
        return var.name

    @staticmethod
    def _const_value(val: Any) -> Any:
        if isinstance(val, str):
            return val
        # Float consts are kept as float32 in both modes: fp16 values are exact in float32, and
        # weights are then compute-ready instead of being upcast on every call.
        return _upcast(np.asarray(val))

    def _drop_unused_consts(self) -> None:
        # E.g. the int8 payload of a folded constexpr: keep only what runtime steps still read.
        used = set(self.output_names)
        for step in self._steps:
            for ref in step.refs.values():
                used.update((ref,) if isinstance(ref, str) else ref)
        self._consts = {k: v for k, v in self._consts.items() if k in used}

    # ------------------------------------------------------------------------------ running

    def make_state(self) -> dict[str, np.ndarray]:
        return {n: np.zeros(self.state_shapes[n], self._state_dtypes[n]) for n in self.state_names}

    def predict(
        self, inputs: Mapping[str, np.ndarray], state: dict[str, np.ndarray] | None = None
    ) -> dict[str, np.ndarray]:
        """Run the function once; `state` arrays are updated in place (None: a fresh zero state)."""
        env: dict[str, Any] = dict(self._consts)
        env.update(self._check_inputs(inputs))
        env.update(self._check_state(self.make_state() if state is None else state))
        for step in self._steps:
            for name, value in zip(step.outputs, self._run_step(step, env)):
                env[name] = value
        # C order, as coremltools hands Core ML's dense outputs back (CoreMLPythonUtils.mm wraps
        # the MLMultiArray with its strides): the kernels' own layouts (a head's logits come out
        # token-major from its matmul) would make the host's row reads cheaper here than on a Mac.
        return {n: np.array(env[n], dtype=self._output_dtypes[n], order="C")
                for n in self.output_names}

    def _run_step(self, step: _Step, env: Mapping[str, Any]) -> tuple[np.ndarray, ...]:
        args: Args = dict(step.defaults)
        for param, ref in step.refs.items():
            args[param] = env[ref] if isinstance(ref, str) else [env[r] for r in ref]
        if step.upcast:
            args = {k: _upcast(v) for k, v in args.items()}
        try:
            # Like the device, produce inf/nan silently; fp16 overflow is reported in _store.
            with np.errstate(all="ignore"):
                result = step.kernel(args)
        except (ValueError, IndexError, TypeError) as exc:
            raise RuntimeError(f"MIL op '{step.op_type}' (op '{step.name}') failed: {exc}") from exc
        results = result if isinstance(result, tuple) else (result,)
        _check_shapes(step, results)
        stored = []
        for r, dt in zip(results, step.out_dtypes):  # a loop, not a genexpr: keeps stacklevel right
            stored.append(_store(step, np.asarray(r), dt))
        return tuple(stored)

    def _check_inputs(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        missing = [n for n in self.input_names if n not in inputs]
        extra = [n for n in inputs if n not in self.input_shapes]
        if missing:
            raise InvalidInputError(f"missing input(s) {missing}; expected {self.input_names}")
        if extra:
            raise InvalidInputError(f"unexpected input(s) {extra}; expected {self.input_names}")
        return {n: self._check_input(n, np.asarray(inputs[n])) for n in self.input_names}

    def _check_input(self, name: str, value: np.ndarray) -> np.ndarray:
        declared, dtype = self.input_shapes[name], self._input_dtypes[name]
        wrong = value.ndim != len(declared) or any(
            d is not None and d != n for d, n in zip(declared, value.shape)
        )
        if wrong:
            raise InvalidInputError(
                f"input '{name}' must have shape {_fmt(declared)} (rank {len(declared)}), "
                f"got {value.shape}"
            )
        for axis, (lo, hi) in enumerate(self._bounds.get(name, ())):
            if value.shape[axis] < lo or (hi > 0 and value.shape[axis] > hi):
                raise InvalidInputError(
                    f"input '{name}' axis {axis} must be in [{lo}, {hi}], got {value.shape[axis]}"
                )
        if (dtype.kind == "f") != (value.dtype.kind == "f"):
            raise InvalidInputError(f"input '{name}' must have dtype {dtype}, got {value.dtype}")
        return value.astype(dtype, copy=False)

    def _check_state(self, state: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        extra = [n for n in state if n not in self.state_shapes]
        if extra:
            raise InvalidInputError(f"unexpected state(s) {extra}; expected {self.state_names}")
        for name in self.state_names:
            arr = state.get(name)
            shape, dtype = self.state_shapes[name], self._state_dtypes[name]
            # Updates must land in the caller's array, so no converting copies: exact match only.
            ok = isinstance(arr, np.ndarray) and arr.shape == shape and arr.dtype == dtype
            if not ok or not arr.flags.writeable:
                got = "nothing" if arr is None else _describe(arr)
                raise InvalidInputError(
                    f"state '{name}' must be a writable {dtype} array of shape {shape} "
                    f"(see make_state()), got {got}"
                )
        return {name: state[name] for name in self.state_names}


# ---------------------------------------------------------------------------------- helpers


def _upcast(value: Any) -> Any:
    """float16 -> float32 (kernels compute in fp32); everything else unchanged."""
    if isinstance(value, np.ndarray) and value.dtype == np.float16:
        return value.astype(np.float32)
    if isinstance(value, list):
        return [_upcast(v) for v in value]
    return value


def _store(step: _Step, value: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    """Cast an op output to its storage dtype: the one place fp16 rounding happens."""
    if dtype is None:
        return value
    try:
        with np.errstate(over="raise"):
            return value.astype(dtype, copy=False)
    except FloatingPointError:
        # Overflowing fp16 is exactly what fp16 emulation is for finding; say where it happened.
        warnings.warn(
            f"MIL op '{step.op_type}' (op '{step.name}') overflowed {dtype}: |values| > "
            f"{np.finfo(dtype).max} became inf",
            RuntimeWarning,
            stacklevel=4,
        )
        with np.errstate(over="ignore"):
            return value.astype(dtype, copy=False)


def _check_shapes(step: _Step, results: tuple[Any, ...]) -> None:
    # Cheap guard against a kernel disagreeing with coremltools' type inference: a wrong shape
    # here would otherwise surface ops later, or never.
    for name, value, declared in zip(step.outputs, results, step.out_shapes):
        shape = np.shape(value)
        if len(shape) != len(declared) or any(
            d is not None and d != s for d, s in zip(declared, shape)
        ):
            raise RuntimeError(
                f"MIL op '{step.op_type}' (op '{step.name}') produced {name} with shape {shape}, "
                f"but the program declares {_fmt(declared)}"
            )


def _names_in(ref: str | tuple[str, ...], names: Mapping[str, Any]) -> bool:
    return ref in names if isinstance(ref, str) else all(r in names for r in ref)


def _static_dim(dim: Any) -> int | None:
    # Symbolic dims (RangeDim / get_new_symbol) are sympy symbols; after a package round trip they
    # come back as fresh symbols ("is17"), with their bounds only in the spec's shapeRange.
    return int(dim) if isinstance(dim, (int, np.integer)) else None


def _describe(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype} array of shape {value.shape}" + (
            "" if value.flags.writeable else " (read-only)"
        )
    return type(value).__name__


def _fmt(shape: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _shape_ranges(spec: Any, function: str) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per-axis [lower, upper] bounds of flexible inputs (upper -1 = unbounded) from the spec."""
    desc = spec.description
    inputs = desc.input
    for fdesc in getattr(desc, "functions", []):
        if fdesc.name == function:
            inputs = fdesc.input
    bounds = {}
    for feature in inputs:
        if feature.type.WhichOneof("Type") != "multiArrayType":
            continue
        ranges = feature.type.multiArrayType.shapeRange.sizeRanges
        if ranges:
            bounds[feature.name] = tuple((int(r.lowerBound), int(r.upperBound)) for r in ranges)
    return bounds
