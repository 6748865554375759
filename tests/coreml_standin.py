"""A stand-in for coremltools' native layer (`coremltools.libcoremlpython`), for tests on Linux.

Test support only: nothing in `ane_spec` can select it. `install` puts it where coremltools 9.0
looks for its pybind module, so everything above it runs unchanged: coremltools' own Python
(`compile_model`, `CompiledMLModel` with its argument checks, the fp16 -> fp32 upcast in
`predict`, `MLState`, `MLComputePlan`) and this project's `CoreMLBackend`, compiled-model
cache, pipeline, probes, doctor, daemon and demo.

It enforces what the native code enforces, each rule cited from coremltools 9.0's source
(`coremlpython/*.mm`) or, where the bridge hands a value to Core ML, from Core ML's documented
behaviour; anything Core ML would refuse raises the same exception type the bridge raises
(`RuntimeError`, pybind11's translation of `std::runtime_error`). It computes with the project's
MIL interpreter in fp16, so results are real. What it cannot model: where ops run (its compute
plan reports every op with no device usage, "unplanned"), speed, JIT specialisation, memory.
"""

from __future__ import annotations

import builtins
import os
import shutil
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import numpy as np

# The macOS this stand-in pretends to be (>= 15: MLState, hints and functionName all exist).
DEFAULT_MACOS = (15, 5)
# Says "the native layer is a stand-in" to ane_spec.runtime.coreml_backend.hardware_problem, so
# checks that measure the hardware (placement, speed, JIT, memory) skip with this reason.
STANDIN_REASON = ("needs Apple hardware: Core ML's native layer here is the test stand-in "
                  "(it checks calls and computes with the MIL interpreter; placement, speed, "
                  "JIT and memory are not modelled)")
COMPUTE_UNIT_NAMES = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")
SITE_DIR = Path(__file__).parent / "coreml_standin_site"  # sitecustomize for child processes
ENV_FLAG = "ANE_SPEC_TEST_COREML_STANDIN"

_macos: tuple[int, ...] = DEFAULT_MACOS


def _need_macos(version: tuple[int, ...], message: str) -> None:
    # The bridge's `if (@available(macOS X, *)) ... else throw std::runtime_error(message)`
    # gates (CoreMLPython.mm), with the bridge's own messages.
    if _macos < version:
        raise RuntimeError(message)


# --- values crossing into Core ML ------------------------------------------------------------

def _array_from_python(value: Any) -> np.ndarray:
    """What `Utils::convertValueToObjC` (CoreMLPythonUtils.mm) accepts as a multi-array.

    Non-array values (int, float, str, dict, list) become other feature types there; this project
    sends only arrays, so anything else is refused here as Core ML would refuse it for a
    multi-array input. Every failure inside `convertValueToArray` is swallowed by the bridge's
    `catch(...)` and ends in `throw std::runtime_error("value type not convertible")`.
    """
    if not isinstance(value, np.ndarray):
        raise RuntimeError("value type not convertible")
    dt = value.dtype
    # PybindCompatibleArray.dataTypeOf (CoreMLPythonArray.mm): kind 'i' itemsize 4 -> Int32,
    # kind 'f' itemsize 4 -> Float32, kind 'f'/'d' itemsize 8 -> Double; int8 only when built
    # with the macOS 26 SDK (not assumed). Everything else, float16 included, throws.
    accepted = (dt.kind == "i" and dt.itemsize == 4) or (dt.kind == "f" and dt.itemsize in (4, 8))
    if not accepted:
        raise RuntimeError("value type not convertible")
    # PybindCompatibleArray initWithArray: `array.mutable_data()` throws on a read-only array
    # (pybind11 check_writeable), swallowed into the same message.
    if not value.flags.writeable:
        raise RuntimeError("value type not convertible")
    # stridesOf: numpy byte strides / itemsize stored as NSNumber unsignedLongLong: a negative
    # stride wraps to a huge element stride (undefined reads), never a valid array.
    if any(s < 0 for s in value.strides):
        raise RuntimeError("value type not convertible (negative stride)")
    return value


def _array_to_python(value: np.ndarray) -> np.ndarray:
    # Utils::convertArrayValueToPython (CoreMLPythonUtils.mm): Float16 multi-arrays are copied
    # to Float32 ("py:array doesn't support fp16"); Int32/Float32/Float64 keep their type. The
    # result is a fresh array the caller owns.
    if value.dtype == np.float16:
        return value.astype(np.float32)
    if value.dtype not in (np.int32, np.float32, np.float64):
        raise AssertionError(f"Core ML never returns {value.dtype} multi-arrays")
    return np.array(value)


# --- compiled models -------------------------------------------------------------------------

_PACKAGE_IN_MODELC = "package.mlpackage"  # where this stand-in keeps the source in a .mlmodelc


def _compile(spec_path: str) -> str:
    # Model::compileModel (CoreMLPython.mm) -> [MLModel compileModelAtURL:error:], which writes
    # `<name>.mlmodelc` into a temporary folder and fails with "Error compiling model" on a bad
    # package. The stand-in "compiles" by checking the program loads and copying the package in.
    from ane_spec.runtime.mil_interpreter import MILInterpreter

    src = Path(spec_path)
    try:
        MILInterpreter.from_package(src, precision="fp16")
    except Exception as exc:  # noqa: BLE001 - any load failure is a compile failure
        raise RuntimeError(f'Error compiling model: "{exc}".') from None
    out = Path(tempfile.mkdtemp(prefix="standin-compile-")) / f"{src.stem}.mlmodelc"
    out.mkdir()
    shutil.copytree(src, out / _PACKAGE_IN_MODELC)
    return str(out)


def _source_package(compiled: str) -> Path:
    package = Path(compiled) / _PACKAGE_IN_MODELC
    if not package.is_dir():
        # [MLModel modelWithContentsOfURL:] on a folder that is not a compiled model.
        raise RuntimeError(f"{{NSLocalizedDescription = \"Unable to load model at {compiled}\"}}")
    return package


class _Description:
    """The model description Core ML checks every prediction's features against."""

    def __init__(self, package: Path, function: str):
        import coremltools as ct

        desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
        for fdesc in desc.functions:  # multifunction packages describe each function
            if fdesc.name == function:
                desc = fdesc
        self.inputs: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        for f in desc.input:
            arr = f.type.multiArrayType
            ranges = tuple((int(r.lowerBound), int(r.upperBound))
                           for r in arr.shapeRange.sizeRanges)
            self.inputs[f.name] = (tuple(int(d) for d in arr.shape), ranges)
        self.states = {s.name: tuple(int(d) for d in s.type.stateType.arrayType.shape)
                       for s in desc.state}

    def check_inputs(self, features: dict[str, np.ndarray]) -> None:
        # Core ML validates a prediction's features against MLModelDescription before running:
        # every input present, no unknown name (coremltools says so too: model.py
        # `_verify_input_dict`, "this is checked during prediction inside CoreML Framework"),
        # the declared rank, each axis inside its shape range (or equal to the fixed shape).
        # Its errors reach Python through Utils::handleError as RuntimeError.
        missing = sorted(set(self.inputs) - set(features))
        if missing:
            raise RuntimeError(f"Feature {missing[0]} is required but not specified.")
        unknown = sorted(set(features) - set(self.inputs))
        if unknown:
            raise RuntimeError(f"Feature {unknown[0]} is not an input of the model.")
        for name, value in features.items():
            shape, ranges = self.inputs[name]
            rank = len(ranges) or len(shape)
            bad = value.ndim != rank or any(
                n < lo or (hi >= 0 and n > hi) for n, (lo, hi) in zip(value.shape, ranges)
            ) or (not ranges and tuple(value.shape) != shape)
            if bad:
                raise RuntimeError(f"MultiArray shape {value.shape} does not match the shape "
                                   f"{shape} (ranges {ranges}) specified in the model "
                                   f"description for feature {name}.")


class StandinState:
    """Model::newState -> State (CoreMLPython.mm) around an MLState: zero-filled fp16 buffers."""

    def __init__(self, owner: StandinModel):
        self.owner = owner
        self.buffers: dict[str, np.ndarray] = owner.interp.make_state()

    def _buffer(self, name: str) -> np.ndarray:
        if not isinstance(name, str):  # pybind11 binds `const std::string&`
            raise TypeError("read_state/write_state: incompatible function arguments")
        if name not in self.buffers:
            # getMultiArrayForStateNamed: raises an NSException for an unknown name, rethrown
            # as std::runtime_error(exception.reason) in State::readState / writeState.
            raise RuntimeError(f"No state named {name!r} in the model")
        return self.buffers[name]

    def read_state(self, name: str) -> np.ndarray:
        # State::readState: the macOS 15 gate, then convertArrayValueToPython(buffer): a float32
        # copy of the fp16 state.
        _need_macos((15, 0), "Reading state is only available on macOS >= 15.0")
        return _array_to_python(self._buffer(name))

    def write_state(self, name: str, value: Any) -> None:
        # State::writeState: macOS 15 gate; `Utils::convertValueToObjC(value)` (so only int32,
        # float32 and float64 arrays: float16 throws "value type not convertible"; MLState.write_
        # state in models/model.py passes the value through untouched, no upcast); then
        # `transferToMultiArray:` into the state's buffer, which needs the whole state's shape
        # (Core ML raises an NSException otherwise) and converts to the state's fp16.
        _need_macos((15, 0), "Writing state is only available on macOS >= 15.0")
        buffer = self._buffer(name)
        array = _array_from_python(value)
        if tuple(array.shape) != buffer.shape:
            raise RuntimeError(f"transferToMultiArray: shape {array.shape} does not match the "
                               f"destination shape {buffer.shape} of state {name!r}")
        buffer[...] = array.astype(np.float16)


class StandinModel:
    """`_MLModelProxy(path, computeUnits, functionName, optimizationHints, asset)` -> Model."""

    def __init__(self, url: str, compute_units: str, function_name: str,
                 optimization_hints: dict, asset: Any = None):
        from ane_spec.runtime.mil_interpreter import MILInterpreter

        if asset is not None:
            raise RuntimeError("MLModelAsset is not modelled by the stand-in")
        # Model::Model: a path not ending in .mlmodelc (Utils::isCompiledModelPath) is compiled
        # on the fly and deleted on exit.
        compiled = url if url.rstrip("/").endswith(".mlmodelc") else _compile(url)
        _set_compute_unit(compute_units)
        _set_optimization_hints(optimization_hints)
        if function_name:
            _need_macos((15, 0), "The 'functionName' property can only be set on macOS >= 15.0")
        self.compute_units = compute_units
        self.optimization_hints = dict(optimization_hints)
        function = function_name or "main"
        package = _source_package(compiled)
        self.description = _Description(package, function)
        self.interp = MILInterpreter.from_package(package, precision="fp16", function=function)

    def newState(self) -> StandinState:  # noqa: N802 - the bridge's name
        # Model::newState: macOS 15 gate ("Stateful model is only available on macOS >= 15.0").
        _need_macos((15, 0), "Stateful model is only available on macOS >= 15.0")
        return StandinState(self)

    def predict(self, data: dict, state: StandinState | None = None) -> dict[str, np.ndarray]:
        # Model::predict: Utils::dictToFeatures -> convertValueToObjC on every value; keys are
        # cast to std::string.
        features = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise RuntimeError("Invalid key type dictionary.")
            features[key] = _array_from_python(value)
        self.description.check_inputs(features)
        if state is not None:
            # predictionFromFeatures:usingState: needs macOS 15. The state must come from the
            # model's newState; Core ML's own check is undocumented, so the stand-in checks only
            # what it can: a stand-in state holding exactly this model's states.
            _need_macos((15, 0), "Stateful predictions using MLState are only supported on "
                        "macOS >= 15.0")
            if not isinstance(state, StandinState) or state.owner.description.states != (
                    self.description.states):
                raise RuntimeError("The state was not created by this model (makeState).")
        elif self.description.states:
            # A stateful model predicted without a state. Assumed refused (Apple documents
            # prediction(from:using:) as the way to run stateful models; not verified here):
            # stricter than Core ML at worst.
            raise RuntimeError("A stateful model needs a state (make_state) to predict.")
        # Core ML converts each input to its declared type (fp16 here) before running.
        out = self.interp.predict(features, None if state is None else state.buffers)
        # Utils::featuresToDict -> convertArrayValueToPython: fp16 outputs come back float32.
        return {name: _array_to_python(np.asarray(v)) for name, v in out.items()}

    def batchPredict(self, data: list) -> list:  # noqa: N802 - the bridge's name
        return [self.predict(d) for d in data]

    # --- class-level entry points of the bridge -------------------------------------------
    @staticmethod
    def compileModel(spec_path: str) -> str:  # noqa: N802
        return _compile(spec_path)

    @staticmethod
    def maximum_supported_specification_version() -> int:
        return 9  # macOS 15 / iOS 18

    @staticmethod
    def get_compute_plan(path: str, compute_units: str):
        # Model::getComputePlan: macOS 14.4 gate, setComputeUnit, then loadContentsOfURL on the
        # compiled model; the Python MLComputePlan is built around the proxy.
        from coremltools.models.compute_plan import MLComputePlan

        _need_macos((14, 4), "MLComputePlan is only available on macOS >= 14.4")
        _set_compute_unit(compute_units)
        return MLComputePlan(StandinComputePlan(_source_package(path)))

    @staticmethod
    def get_model_structure(path: str):
        _need_macos((14, 4), "MLModelStructure is only available on macOS >= 14.4")
        return _structure(_source_package(path))

    @staticmethod
    def get_available_compute_devices() -> list:
        return []  # the stand-in knows no hardware


def _set_compute_unit(compute_units: str) -> None:
    # Model::setComputeUnit (CoreMLPython.mm): the four names (anything else hits
    # `assert(computeUnits == "ALL")`); CPU_AND_NE needs macOS 13.
    if compute_units not in COMPUTE_UNIT_NAMES:
        raise AssertionError(f"unknown compute units {compute_units!r}")
    if compute_units == "CPU_AND_NE":
        _need_macos((13, 0), "MLComputeUnitsCPUAndNeuralEngine is only available on "
                    "macOS >= 13.0")


def _set_optimization_hints(hints: dict) -> None:
    # Model::setOptimizationHints (CoreMLPython.mm): values arrive as strings (CompiledMLModel
    # sends `v.name`, or str(bool)); each known key needs macOS 15; an unknown value leaves the
    # default. coremltools' Python (_verify_optimization_hint_input) already checked the types.
    allowed = {"reshapeFrequency": ("Frequent", "Infrequent"),
               "specializationStrategy": ("Default", "FastPrediction"),
               "allowLowPrecisionAccumulationOnGPU": ("True", "False")}
    for key, value in hints.items():
        if key not in allowed:
            raise AssertionError(f"unknown optimization hint {key!r}")
        if not isinstance(value, str):  # `.cast<std::string>()` throws pybind11::cast_error
            raise RuntimeError(f"Unable to cast Python instance of type {type(value)} to C++ "
                               "type 'std::string'")
        _need_macos((15, 0), f"Setting '{key}' is only available on macOS >= 15.0")
        if value not in allowed[key]:
            raise AssertionError(f"unknown {key} value {value!r}")


# --- compute plan: structure only --------------------------------------------------------------

def _structure(package: Path):
    """MLModelStructure of the package's program: every op of every function, as the bridge's
    toPythonObject(MLModelStructure) builds it (models/compute_plan.py dataclasses)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load
    from coremltools.models import compute_plan as cp

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    program = load(spec, spec.specificationVersion,
                   os.path.join(package, "Data", "com.apple.CoreML", "weights"))

    def named(var) -> cp.MLModelStructureProgramNamedValueType:
        return cp.MLModelStructureProgramNamedValueType(name=var.name,
                                                        type=cp.MLModelStructureProgramValueType())

    def block(blk) -> cp.MLModelStructureProgramBlock:
        block_inputs = blk.inputs.values() if isinstance(blk.inputs, dict) else blk.inputs
        ops = []
        for op in blk.operations:
            inputs = {}
            for param, var in op.inputs.items():
                vars_ = var if isinstance(var, (list, tuple)) else [var]
                inputs[param] = cp.MLModelStructureProgramArgument(bindings=[
                    cp.MLModelStructureProgramBinding(name=v.name, value=None) for v in vars_])
            ops.append(cp.MLModelStructureProgramOperation(
                inputs=inputs, operator_name=op.op_type,
                outputs=[named(v) for v in op.outputs],
                blocks=[block(b) for b in getattr(op, "blocks", [])], __proxy__=None))
        return cp.MLModelStructureProgramBlock(
            inputs=[named(v) for v in block_inputs], operations=ops,
            output_names=[v.name for v in blk.outputs])

    functions = {name: cp.MLModelStructureProgramFunction(
        inputs=[named(v) for v in fn.inputs.values()], block=block(fn))
        for name, fn in program.functions.items()}
    return cp.MLModelStructure(neuralnetwork=None,
                               program=cp.MLModelStructureProgram(functions=functions),
                               pipeline=None)


class StandinComputePlan:
    """ComputePlan proxy: the structure is real; device usage and cost are unknown (None) for
    every op, i.e. "unplanned": the stand-in does not know where Core ML would place anything."""

    def __init__(self, package: Path):
        self.model_structure = _structure(package)

    def get_compute_device_usage_for_mlprogram_operation(self, operation) -> None:
        return None

    def get_compute_device_usage_for_neuralnetwork_layer(self, layer) -> None:
        return None

    def get_estimated_cost_for_mlprogram_operation(self, operation) -> None:
        return None


# --- installing ----------------------------------------------------------------------------------

def native_module() -> types.ModuleType:
    module = types.ModuleType("coremltools.libcoremlpython")
    module._MLModelProxy = StandinModel
    module._MLComputePlanProxy = StandinComputePlan
    module.ANE_SPEC_STANDIN = STANDIN_REASON
    return module


class _Permanent:
    """monkeypatch's setattr/setitem, without the undo: for child processes."""

    @staticmethod
    def setattr(target: Any, name: str, value: Any, raising: bool = True) -> None:
        builtins.setattr(target, name, value)

    @staticmethod
    def setitem(mapping: Any, key: Any, value: Any) -> None:
        mapping[key] = value


def install(patch: Any = _Permanent, macos: tuple[int, ...] = DEFAULT_MACOS) -> None:
    """Put the stand-in where coremltools 9.0 looks for its native module, and make this
    process look like macOS `macos` to coremltools' and ane-spec's gates. Pass pytest's
    `monkeypatch` to undo it after a test."""
    global _macos
    import coremltools
    import coremltools.models._compiled_model as compiled_model
    import coremltools.models.compute_plan as compute_plan
    import coremltools.models.model as model
    import coremltools.models.utils as utils

    _macos = tuple(macos)
    module = native_module()
    patch.setattr(sys, "platform", "darwin")
    for mod in (utils, model, compiled_model):
        patch.setattr(mod, "_macos_version", lambda: _macos)
    # Each coremltools module bound the proxy at its own import (`from ..libcoremlpython
    # import _MLModelProxy`, None when the import failed): rebind them all.
    for mod in (model, compiled_model, compute_plan):
        patch.setattr(mod, "_MLModelProxy", StandinModel)
    patch.setattr(compute_plan, "_MLComputePlanProxy", StandinComputePlan)
    patch.setattr(coremltools, "libcoremlpython", module, raising=False)
    patch.setitem(sys.modules, "coremltools.libcoremlpython", module)


def child_env(macos: tuple[int, ...] = DEFAULT_MACOS) -> dict[str, str]:
    """Environment for a child Python process that should run on the stand-in too."""
    root = str(Path(__file__).parents[1])
    path = os.pathsep.join(p for p in (str(SITE_DIR), root, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, ENV_FLAG: ".".join(map(str, macos))}
