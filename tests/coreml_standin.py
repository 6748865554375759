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
plan reports every op with no device usage, "unplanned", unless a test gives it a table), speed,
JIT specialisation, memory.

Round 3 (issue 28) rules, each cited where it is enforced; the ones that cost time or kill the
process are switched on by a test through `set_rules(...)` or, for worker processes, the
ANE_SPEC_STANDIN_RULES environment variable (JSON):
- input lifetime: an array given to `predict` that dies within LIFETIME_SECONDS of the call
  returning is an error at the next native call (coremltools PRs #2827, #2829) - always on;
- autorelease pools (issue 35): `State::readState`/`writeState` have no @autoreleasepool
  (CoreMLPython.mm); what they autorelease (writeState's MLFeatureValue, which holds the written
  array; a copy of the state per read, the worst case) stays in the caller's innermost pool,
  or in `unreleased` for good where none is open. `StandinObjC` stands in for libobjc's
  objc_autoreleasePoolPush/Pop, which runtime/autorelease.py opens - always on; `leak_reads`:
  each read's copy goes to `unreleased` whatever pool is open (the leak that a read with no
  pool around it would be; the doctor's `state-reads` check must catch it);
- the GIL is held for the whole of every native call (`gil_seconds`, `first_call_seconds` per
  input shape, `load_seconds`): a ctypes.PyDLL sleep, which never releases it;
- MLComputeDevice.get_all_compute_devices() lists a CPU, a GPU and a 16-core Neural Engine;
- a compute-plan table (`plan_devices`) gives per-op devices, so residency's pass and fail
  branches run;
- reshapeFrequency Frequent + a RangeDim input + CPU_AND_NE runs off the ANE (`placement`);
- `ftz`: fp16 subnormals flushed to zero in every value crossing in or out;
- Core ML's errors read as the bridge writes them (`str(NSError.userInfo)`), the missing-state
  message of coremltools #2519 included;
- `replay` (benchmarks only): a prediction at shapes seen before returns the first result
  again without computing, so what is timed is the host side and the bridge's copies;
- injected failures: `kill_at_first_predict` (a load that "succeeds" and a first predict that
  SIGKILLs the process, #2758; the pattern is matched against "<package>#<function>", so
  "#prefill" fails one function's compile only), `kill_at_predict` (the n-th predict of this
  process; either only once per `kill_once_file`), and
  `code8_at_predict` ("ANE inference error Code=8").

Round 5 (issue 35: verdicts that must not lie on a Mac):
- `small_program_elements`: a program whose inputs, outputs and states all hold fewer elements
  is placed on the CPU whatever its ops (others report it at a few million elements);
- under reshapeFrequency Infrequent a RangeDim input at a shape other than its default runs off
  the Neural Engine (coremltools #2370: "a model with RangeDim input runs on the Neural Engine
  only with the default shape"): `placement` says so per call - always on;
- a `plan_devices` table's "costs" give each op an MLComputePlanCost weight (its share of its
  function's cost), so a plan with some ops on the CPU exercises the residency gate's cost rule.

Round 4 (issue 33: multifunction layer packages, a decode and a prefill function):
- `function_name` chooses the function a CompiledMLModel loads (macOS 15); none loads the
  default; a name the package lacks fails the load (`_function_to_load`);
- a state made by one model is accepted by another's predict only when the two declare the same
  states, names, shapes and element types (`StandinModel.predict`, after Anemll's practice);
- the compute plan holds every function, and `plan_devices` may place one function's ops apart
  (`StandinComputePlan`).

Round 6 (issue 34: the draft model on its own compute units):
- `load_log` (a file path) records every model load, in whichever process it happens, as one
  JSON line: the compiled model's path, the function, the compute units and the optimization
  hints, as `CompiledMLModel.__init__` hands them to the bridge (coremltools 9.0
  models/_compiled_model.py: `_MLModelProxy(path, compute_units.name, function_name,
  optimization_hints_str_vals, asset_proxy)`); `loads(path)` reads it back.
"""

from __future__ import annotations

import builtins
import os
import shutil
import signal
import sys
import tempfile
import time
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

RULES_ENV = "ANE_SPEC_STANDIN_RULES"
# coremltools PR #2827: Core ML's MLE5 engine releases a prediction's inputs "~1 second later";
# an array that dies sooner than this after its call returned was (at best) only alive by luck.
LIFETIME_SECONDS = 2.0
NEURAL_ENGINE_CORES = 16

_macos: tuple[int, ...] = DEFAULT_MACOS
_rules: dict[str, Any] = {}
_predicts = 0  # predictions in this process (for kill_at_predict / code8_at_predict)
lifetime_violations: list[str] = []
placements: dict[str, str] = {}  # compiled model path -> where it runs


def set_rules(**rules: Any) -> None:
    """Turn stand-in rules on in this process (tests); see the module docstring."""
    _rules.update(rules)


def rules_env(**rules: Any) -> dict[str, str]:
    """The environment that turns the same rules on in a worker process."""
    import json

    return {RULES_ENV: json.dumps(rules)}


def ns_error(description: str) -> RuntimeError:
    """An error as the bridge raises it: `Utils::handleError` (CoreMLPythonUtils.mm) formats
    `[error userInfo]` with `%@`, an NSDictionary's description, into std::runtime_error."""
    escaped = description.replace("\\", "\\\\").replace('"', '\\"')
    return RuntimeError(f'{{\n    NSLocalizedDescription = "{escaped}";\n}}')


def _hold_gil(seconds: float) -> None:
    """Sleep without releasing the GIL, as every call into the bridge does: coremltools binds
    predict, the model's load, read_state and write_state as plain pybind `.def`s with no
    `py::call_guard<py::gil_scoped_release>` (CoreMLPython.mm). ctypes.PyDLL keeps the GIL
    during the foreign call (ctypes.CDLL would release it)."""
    if seconds > 0:
        import ctypes

        ctypes.PyDLL(None).usleep(int(seconds * 1e6))


# --- autorelease pools ---------------------------------------------------------------------------
# What a native call autoreleases goes to the innermost pool its thread has open, and is released
# when that pool is popped (objc_autoreleasePoolPop); with none open, to a pool that a Python
# thread never drains while it runs: `unreleased` counts those, and keeps them (real memory, as
# on a Mac, so an RSS watch sees it).

_threads = __import__("threading").local()
unreleased: list[Any] = []


def _pools() -> list[list[Any]]:
    if not hasattr(_threads, "pools"):
        _threads.pools = []
    return _threads.pools


def _autorelease(obj: Any) -> None:
    pools = _pools()
    (pools[-1] if pools else unreleased).append(obj)


class _PoolFunction:
    """A C function of libobjc as ctypes gives it (it takes `restype` and `argtypes`)."""

    def __init__(self, call: Any):
        self.call, self.restype, self.argtypes = call, None, None

    def __call__(self, *args: Any) -> Any:
        return self.call(*args)


def _push() -> int:
    # objc_autoreleasePoolPush returns an opaque token (void *); the stand-in's is the depth.
    pools = _pools()
    pools.append([])
    return len(pools)


def _pop(token: int) -> None:
    # objc_autoreleasePoolPop(token) releases every object autoreleased since that push, inner
    # pools included.
    pools = _pools()
    if not isinstance(token, int) or not 1 <= token <= len(pools):
        raise AssertionError(f"objc_autoreleasePoolPop with a token never pushed: {token!r}")
    del pools[token - 1:]


class StandinObjC:
    """libobjc.A.dylib's pool functions, as `ctypes.PyDLL` opens them (runtime/autorelease.py)."""

    def __init__(self) -> None:
        self.objc_autoreleasePoolPush = _PoolFunction(_push)
        self.objc_autoreleasePoolPop = _PoolFunction(_pop)


def _check_lifetimes() -> None:
    if lifetime_violations:
        raise RuntimeError(f"stand-in: {lifetime_violations[0]}")


def _watch(arrays: list[np.ndarray], what: str) -> Any:
    """Watch arrays handed to the bridge; call the result when the native call returns."""
    import weakref

    returned: list[float] = []

    def died(_ref: Any) -> None:
        if not returned:  # during the call: the bridge holds it, it cannot die
            return
        after = time.monotonic() - returned[0]
        if after < LIFETIME_SECONDS:
            lifetime_violations.append(
                f"an array given to {what} was freed {after:.3f} s after the call returned; "
                "Core ML releases its wrapper about a second later, without the GIL "
                "(coremltools PRs #2827, #2829): keep every input alive past that")

    refs = [weakref.ref(a, died) for a in arrays]
    if len(_watched) > 4096:
        _watched[:] = [r for r in _watched if r() is not None]
    _watched.extend(refs)

    def done() -> None:
        returned.append(time.monotonic())

    return done


_watched: list[Any] = []  # the weakrefs themselves must live for their callbacks to run


def _flush_subnormals(value: np.ndarray) -> np.ndarray:
    """`ftz`: fp16 subnormals (|x| < 2**-14) become zero, as a device that flushes them would."""
    if not _rules.get("ftz") or value.dtype.kind != "f":
        return value
    as16 = value.astype(np.float16)
    tiny = (as16 != 0) & (np.abs(as16) < np.float16(2.0**-14))
    if not tiny.any():
        return value
    out = np.array(value)
    out[tiny] = 0
    return out


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
        raise ns_error(f"Unable to load model at {compiled}")
    return package


def _function_to_load(package: Path, function_name: str) -> str:
    """The function `Model::Model` (CoreMLPython.mm) has Core ML load: it sets
    `MLModelConfiguration.functionName` only for a non-empty name (CompiledMLModel passes "" for
    None, models/_compiled_model.py), and Core ML then loads the model's default function
    (Apple: "Use nil to use a default function"). A name the model lacks fails the load
    (`modelWithContentsOfURL:configuration:error:` -> `Utils::handleError`, a RuntimeError):
    coremltools 9.0's own test expects exactly that ("invalid function error at runtime",
    converters/mil/backend/mil/test_load.py, test_multi_functions_backward_compatibility); a
    one-function model loads by the name `main` (the same test), and only by that name."""
    import coremltools as ct

    desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
    names = [f.name for f in desc.functions] or ["main"]
    if not function_name:
        return desc.defaultFunctionName or names[0]
    if function_name not in names:
        # Core ML's own wording is not documented; the error's type and place are.
        raise ns_error(f"Failed to load the model: no function named {function_name!r} "
                       f"(the model has {', '.join(names)}) [stand-in wording]")
    return function_name


class _Description:
    """The model description Core ML checks every prediction's features against."""

    def __init__(self, package: Path, function: str):
        import coremltools as ct

        desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
        for fdesc in desc.functions:  # multifunction packages describe each function
            if fdesc.name == function:
                desc = fdesc
        self.function = function
        self.inputs: dict[str, tuple[tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        for f in desc.input:
            arr = f.type.multiArrayType
            ranges = tuple((int(r.lowerBound), int(r.upperBound))
                           for r in arr.shapeRange.sizeRanges)
            self.inputs[f.name] = (tuple(int(d) for d in arr.shape), ranges)
        # Each state's name, shape and element type: what a state made by another model must
        # match to be used here (see StandinModel.predict).
        self.states = {s.name: (tuple(int(d) for d in s.type.stateType.arrayType.shape),
                                int(s.type.stateType.arrayType.dataType))
                       for s in desc.state}

    def check_inputs(self, features: dict[str, np.ndarray]) -> None:
        # Core ML validates a prediction's features against MLModelDescription before running:
        # every input present, no unknown name (coremltools says so too: model.py
        # `_verify_input_dict`, "this is checked during prediction inside CoreML Framework"),
        # the declared rank, each axis inside its shape range (or equal to the fixed shape).
        # Its errors reach Python through Utils::handleError as RuntimeError.
        missing = sorted(set(self.inputs) - set(features))
        if missing:
            raise ns_error(f"Feature {missing[0]} is required but not specified.")
        unknown = sorted(set(features) - set(self.inputs))
        if unknown:
            raise ns_error(f"Feature {unknown[0]} is not an input of the model.")
        for name, value in features.items():
            shape, ranges = self.inputs[name]
            rank = len(ranges) or len(shape)
            bad = value.ndim != rank or any(
                n < lo or (hi >= 0 and n > hi) for n, (lo, hi) in zip(value.shape, ranges)
            ) or (not ranges and tuple(value.shape) != shape)
            if bad:
                raise ns_error(f"MultiArray shape {value.shape} does not match the shape "
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
        # copy of the fp16 state. readState has no @autoreleasepool (CoreMLPython.mm), unlike
        # predict: what Core ML autoreleases inside getMultiArrayForStateNamed:handler: goes to
        # the caller's pool. Which objects those are is not documented; the stand-in takes the
        # worst case (issue 35): a copy of the state's buffer per read (`_autorelease`).
        _need_macos((15, 0), "Reading state is only available on macOS >= 15.0")
        _check_lifetimes()
        _hold_gil(_rules.get("gil_seconds", 0.0))
        buffer = self._buffer(name)
        if _rules.get("leak_reads"):  # as if no pool were open around the call: never freed
            unreleased.append(np.array(buffer))
        else:
            _autorelease(np.array(buffer))
        return _array_to_python(buffer)

    def write_state(self, name: str, value: Any) -> None:
        # State::writeState: macOS 15 gate; `Utils::convertValueToObjC(value)` (so only int32,
        # float32 and float64 arrays: float16 throws "value type not convertible"; MLState.write_
        # state in models/model.py passes the value through untouched, no upcast); then
        # `transferToMultiArray:` into the state's buffer, which needs the whole state's shape
        # (Core ML raises an NSException otherwise) and converts to the state's fp16.
        _need_macos((15, 0), "Writing state is only available on macOS >= 15.0")
        _check_lifetimes()
        buffer = self._buffer(name)
        array = _array_from_python(value)
        if tuple(array.shape) != buffer.shape:
            raise RuntimeError(f"transferToMultiArray: shape {array.shape} does not match the "
                               f"destination shape {buffer.shape} of state {name!r}")
        _hold_gil(_rules.get("gil_seconds", 0.0))
        # The copy is synchronous: transferToMultiArray runs inside the handler block, before
        # writeState returns (CoreMLPython.mm). What still holds the array after it is the
        # MLFeatureValue that convertValueToArray made (CoreMLPythonUtils.mm:
        # `[MLFeatureValue featureValueWithMultiArray:array]`, a convenience constructor, so
        # autoreleased) around the PybindCompatibleArray that keeps the py::array: it lives
        # until the caller's autorelease pool drains, and forever on a thread with none.
        buffer[...] = _flush_subnormals(array).astype(np.float16)
        _autorelease(array)


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
        package = _source_package(compiled)
        function = _function_to_load(package, function_name)
        self.description = _Description(package, function)
        self.interp = MILInterpreter.from_package(package, precision="fp16", function=function)
        self.package = str(package)
        self.shapes_seen: set[tuple] = set()
        self.replayed: dict[tuple, dict[str, np.ndarray]] = {}
        _hold_gil(_rules.get("load_seconds", 0.0))  # the load is a native call too
        # Apple's flexible-inputs guide: only reshapeFrequency Infrequent lets a flexible-shape
        # model run on the Neural Engine; coremltools #2600 shows a stateful RangeDim LLM loaded
        # otherwise running wholly on the CPU.
        flexible = any(ranges and any(lo != hi for lo, hi in ranges)
                       for _, ranges in self.description.inputs.values())
        frequent = self.optimization_hints.get("reshapeFrequency") == "Frequent"
        self.placement = ("CPU: not on the ANE (reshapeFrequency Frequent with a RangeDim "
                          "input)" if flexible and frequent and compute_units in (
                              "CPU_AND_NE", "ALL") else "as planned")
        if _small_program(package) and compute_units != "CPU_ONLY":
            self.placement = "CPU: a small program (small_program_elements)"
        placements[compiled] = self.placement
        self.compiled = compiled
        _log_load(url, compute_units, function, self.optimization_hints)
        # Matched against "<package>#<function>": "#prefill" fails one function's compile only.
        self.kill_first = _matches(_rules.get("kill_at_first_predict"),
                                   f"{self.package}#{function}")
        if self.kill_first:
            # coremltools #2758: the ANE compiler's failure goes to stderr and the load returns.
            print("E5RT encountered an STL exception. msg = MILCompilerForANE error: failed to "
                  "compile ANE model using ANEF. Error=_ANECompiler : ANECCompile() FAILED.",
                  file=sys.stderr, flush=True)

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
        _check_lifetimes()
        global _predicts
        _predicts += 1
        if (self.kill_first or _predicts == _rules.get("kill_at_predict")) and _first_time():
            # #2758: "the first predict() silently kills the whole host process with SIGKILL".
            os.kill(os.getpid(), signal.SIGKILL)
        if _predicts == _rules.get("code8_at_predict"):
            # Seen in the field (InvokeAI #4356, stable-diffusion-webui #13419): the ANE fails
            # the request; the error text is the NSError's, as the bridge reports errors.
            raise ns_error("processRequest:model:qos:qIndex:modelStringID:options:error:: "
                           "ANEProgramProcessRequestDirect() Failed with status=0x16 : "
                           "statusType=0x9: Program Inference error (ANE inference error "
                           "Error Domain=com.apple.appleneuralengine Code=8)")
        shapes = tuple(sorted((k, v.shape) for k, v in features.items()))
        first = shapes not in self.shapes_seen
        self._place_shape(features)
        self.shapes_seen.add(shapes)
        if state is not None:
            # predictionFromFeatures:usingState: needs macOS 15. A state made by another model
            # (another function of the package, or another package) is used in practice where
            # both declare the same states: Anemll makes one state from its `prefill` function
            # and predicts with it on every chunk's `infer` and `prefill` functions
            # (Anemll/Anemll tests/chat.py, create_unified_state, run_prefill,
            # generate_next_token). Core ML's own check is undocumented, so the stand-in accepts
            # exactly that: a state whose names, shapes and element types all match this
            # model's, and refuses any other.
            _need_macos((15, 0), "Stateful predictions using MLState are only supported on "
                        "macOS >= 15.0")
            if not isinstance(state, StandinState):
                raise RuntimeError("The state was not created by a model (makeState).")
            if state.owner.description.states != self.description.states:
                raise RuntimeError(
                    f"The state's descriptions (name: shape, type) "
                    f"{_states_text(state.owner.description.states)} do not match this "
                    f"model's {_states_text(self.description.states)} [stand-in wording]")
        elif self.description.states:
            # A stateful model predicted without a state: Core ML's own error, as coremltools
            # #2519 shows it (one state named; the stand-in names the first).
            raise ns_error(f"The input feature for {sorted(self.description.states)[0]} must "
                           "be an MLState, but it was not.")
        # The bridge wraps each array without copying it and Core ML may keep the wrapper
        # after the call (coremltools PRs #2827, #2829): watch each one's lifetime.
        returned = _watch(list(features.values()), "predict")
        # The whole call holds the GIL; a program's first call at a new input shape also pays
        # its specialisation (ane-platform-notes: ~115 s cold at Phi size).
        _hold_gil(_rules.get("gil_seconds", 0.0)
                  + (_rules.get("first_call_seconds", 0.0) if first else 0.0))
        # Core ML converts each input to its declared type (fp16 here) before running.
        feed = {k: _flush_subnormals(v) for k, v in features.items()}
        if _rules.get("replay") and shapes in self.replayed:
            # Benchmarks of the host side only (scripts/bench_worker_boundary.py): the first
            # result at these shapes again, computed in no time; the state is left alone.
            out = self.replayed[shapes]
        else:
            out = self.interp.predict(feed, None if state is None else state.buffers)
            if _rules.get("replay"):
                self.replayed[shapes] = {k: np.array(v) for k, v in out.items()}
        if state is not None and _rules.get("ftz"):
            for name, buf in state.buffers.items():
                buf[...] = _flush_subnormals(buf)
        returned()
        # Utils::featuresToDict -> convertArrayValueToPython: fp16 outputs come back float32.
        return {name: _array_to_python(_flush_subnormals(np.asarray(v)))
                for name, v in out.items()}

    def _place_shape(self, features: dict[str, np.ndarray]) -> None:
        """coremltools #2370: under reshapeFrequency Infrequent a RangeDim model runs on the
        Neural Engine only at its default shape (the description's shape); any other shape
        runs off it. Recorded per call in `placement` (and `placements`); values unchanged."""
        if self.optimization_hints.get("reshapeFrequency", "Infrequent") != "Infrequent" or (
                self.compute_units not in ("CPU_AND_NE", "ALL")) or (
                self.placement.startswith("CPU: a small")):
            return
        off = [name for name, value in features.items()
               if self.description.inputs[name][1]
               and any(lo != hi for lo, hi in self.description.inputs[name][1])
               and tuple(value.shape) != self.description.inputs[name][0]]
        self.placement = (f"CPU: not on the ANE (input {off[0]} at a shape other than its "
                          "RangeDim default under reshapeFrequency Infrequent, coremltools "
                          "#2370)" if off else "as planned")
        placements[self.compiled] = self.placement

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
    def get_all_compute_devices() -> list:
        # getAllComputeDevices (CoreMLPython.mm, macOS 14 gate) ->
        # MLComputeDevice.allComputeDevices,
        # each wrapped in coremltools' Python class (compute_device.py). A Mac with a Neural
        # Engine lists a CPU, a GPU and the Neural Engine.
        from coremltools.models import compute_device as cd

        _need_macos((14, 0), "MLComputeDevice is only available on macOS >= 14.0")
        return [cd.MLCPUComputeDevice(StandinCPUDevice()),
                cd.MLGPUComputeDevice(StandinGPUDevice()),
                cd.MLNeuralEngineComputeDevice(StandinNeuralEngineDevice())]

    get_available_compute_devices = get_all_compute_devices


def _states_text(states: dict[str, tuple[tuple[int, ...], int]]) -> str:
    from coremltools.proto import FeatureTypes_pb2 as ft

    return "{" + ", ".join(f"{name}: {list(shape)} "
                           f"{ft.ArrayFeatureType.ArrayDataType.Name(dtype)}"
                           for name, (shape, dtype) in sorted(states.items())) + "}"


def _log_load(url: str, compute_units: str, function: str, hints: dict) -> None:
    """`load_log`: one JSON line per load (module docstring, round 6). Each line is written
    with one O_APPEND write, so lines from concurrent processes never interleave."""
    path = _rules.get("load_log")
    if not path:
        return
    import json

    line = json.dumps({"url": url, "compute_units": compute_units, "function": function,
                       "hints": hints, "pid": os.getpid()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def loads(path: str | Path) -> list[dict[str, Any]]:
    """The loads `load_log` recorded at `path` (none if nothing was loaded)."""
    import json

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line]


def _first_time() -> bool:
    """`kill_once_file`: kill only the first process that gets there (a restarted worker runs
    on), marking the file; without it, every process."""
    marker = _rules.get("kill_once_file")
    if not marker:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _matches(pattern: str | None, package: str) -> bool:
    return bool(pattern) and (pattern == "*" or pattern in package)


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

def _structure(package: Path, owners: dict[int, str] | None = None):
    """MLModelStructure of the package's program: every op of every function, as the bridge's
    toPythonObject(MLModelStructure) builds it (models/compute_plan.py dataclasses): its
    toPythonObject(MLModelStructureProgram) puts each of `program.functions` in a dict by name,
    and Model::getComputePlan loads the plan with no functionName, so one plan holds every
    function of a multifunction model. `owners`, if given, gets id(op) -> its function's name."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load
    from coremltools.models import compute_plan as cp

    spec = ct.models.MLModel(str(package), skip_model_load=True).get_spec()
    program = load(spec, spec.specificationVersion,
                   os.path.join(package, "Data", "com.apple.CoreML", "weights"))

    def named(var) -> cp.MLModelStructureProgramNamedValueType:
        return cp.MLModelStructureProgramNamedValueType(name=var.name,
                                                        type=cp.MLModelStructureProgramValueType())

    def block(blk, function: str) -> cp.MLModelStructureProgramBlock:
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
                blocks=[block(b, function) for b in getattr(op, "blocks", [])], __proxy__=None))
            if owners is not None:
                owners[id(ops[-1])] = function
        return cp.MLModelStructureProgramBlock(
            inputs=[named(v) for v in block_inputs], operations=ops,
            output_names=[v.name for v in blk.outputs])

    functions = {name: cp.MLModelStructureProgramFunction(
        inputs=[named(v) for v in fn.inputs.values()], block=block(fn, name))
        for name, fn in program.functions.items()}
    return cp.MLModelStructure(neuralnetwork=None,
                               program=cp.MLModelStructureProgram(functions=functions),
                               pipeline=None)


def _small_program(package: Path) -> bool:
    """`small_program_elements` (a count): a program none of whose inputs, outputs or states
    reaches that many elements is placed on the CPU whatever its ops, by the compute plan and
    in `placement` (issue 35: reported by others at a few million elements; Core ML's choice
    is undocumented, so the threshold is the test's)."""
    limit = _rules.get("small_program_elements")
    if not limit:
        return False
    import coremltools as ct

    desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
    sizes = [int(np.prod(f.type.multiArrayType.shape)) for f in [*desc.input, *desc.output]]
    sizes += [int(np.prod(s.type.stateType.arrayType.shape)) for s in desc.state]
    return max(sizes, default=0) < limit


class StandinCPUDevice:
    """_MLCPUComputeDeviceProxy"""


class StandinGPUDevice:
    """_MLGPUComputeDeviceProxy"""


class StandinNeuralEngineDevice:
    """_MLNeuralEngineComputeDeviceProxy: NeuralEngineComputeDevice::getTotalCoreCount."""

    def get_total_core_count(self) -> int:
        return NEURAL_ENGINE_CORES


class StandinComputePlan:
    """ComputePlan proxy: the structure is real; device usage and cost are unknown (None) for
    every op, i.e. "unplanned": the stand-in does not know where Core ML would place anything.
    With the `plan_devices` rule ({"default": "NeuralEngine", "ops": {"select": "CPU"}}) each
    non-const op gets the device of its type from that table, so residency's pass and fail
    branches both run; consts stay None, as Core ML leaves them (ane-platform-notes). The
    table's "functions" ({"prefill": {"ops": {...}, "default": ...}}) overrides it for the ops
    of one function of a multifunction model."""

    def __init__(self, package: Path):
        self.owners: dict[int, str] = {}  # id(op) -> the function it belongs to
        self.model_structure = _structure(package, self.owners)
        self.small = _small_program(package)

    @staticmethod
    def _dispatched(operation) -> bool:  # noqa: ANN001
        return operation.operator_name != "const" and not (
            operation.operator_name.startswith("constexpr_"))

    def get_compute_device_usage_for_mlprogram_operation(self, operation):  # noqa: ANN001, ANN201
        table = _rules.get("plan_devices")
        if not table or not self._dispatched(operation):
            return None
        from coremltools.models import compute_device as cd
        from coremltools.models.compute_plan import MLComputePlanDeviceUsage

        own = table.get("functions", {}).get(self.owners.get(id(operation)), {})
        ops = table.get("ops", {}) | own.get("ops", {})
        name = ops.get(operation.operator_name, own.get("default", table.get("default")))
        if self.small:  # a small program goes to the CPU whatever its ops (_small_program)
            name = "CPU"
        if name is None:
            return None
        device = {"CPU": lambda: cd.MLCPUComputeDevice(StandinCPUDevice()),
                  "GPU": lambda: cd.MLGPUComputeDevice(StandinGPUDevice()),
                  "NeuralEngine": lambda: cd.MLNeuralEngineComputeDevice(
                      StandinNeuralEngineDevice())}[name]()
        return MLComputePlanDeviceUsage(preferred_compute_device=device,
                                        supported_compute_devices=[device])

    def get_compute_device_usage_for_neuralnetwork_layer(self, layer) -> None:
        return None

    def get_estimated_cost_for_mlprogram_operation(self, operation):  # noqa: ANN001, ANN201
        """With a `plan_devices` table that has "costs" ({op type: relative cost, "default":
        ...}), each dispatched op's MLComputePlanCost: its cost over its function's total, a
        weight in [0, 1] as Core ML gives it (coremltools models/compute_plan.py: "the
        estimated workload of executing the operation over the total model execution");
        None otherwise, as for a const."""
        costs = (_rules.get("plan_devices") or {}).get("costs")
        if not costs or not self._dispatched(operation):
            return None
        from coremltools.models.compute_plan import MLComputePlanCost

        function = self.owners.get(id(operation))

        def cost(op) -> float:  # noqa: ANN001
            return float(costs.get(op.operator_name, costs.get("default", 1.0)))

        ops = [op for fn, f in self.model_structure.program.functions.items() if fn == function
               for op in f.block.operations if self._dispatched(op)]
        return MLComputePlanCost(weight=cost(operation) / sum(cost(op) for op in ops))


# --- installing ----------------------------------------------------------------------------------

def native_module() -> types.ModuleType:
    module = types.ModuleType("coremltools.libcoremlpython")
    module._MLModelProxy = StandinModel
    module._MLComputePlanProxy = StandinComputePlan
    module._MLCPUComputeDeviceProxy = StandinCPUDevice
    module._MLGPUComputeDeviceProxy = StandinGPUDevice
    module._MLNeuralEngineComputeDeviceProxy = StandinNeuralEngineDevice
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

    global _predicts
    _macos = tuple(macos)
    _rules.clear()
    lifetime_violations.clear()
    placements.clear()
    _predicts = 0
    unreleased.clear()
    _pools().clear()
    module = native_module()
    import ane_spec.runtime.autorelease as autorelease

    patch.setattr(autorelease, "open_library", StandinObjC)
    patch.setattr(sys, "platform", "darwin")
    for mod in (utils, model, compiled_model):
        patch.setattr(mod, "_macos_version", lambda: _macos)
    # Each coremltools module bound the proxy at its own import (`from ..libcoremlpython
    # import _MLModelProxy`, None when the import failed): rebind them all.
    for mod in (model, compiled_model, compute_plan):
        patch.setattr(mod, "_MLModelProxy", StandinModel)
    patch.setattr(compute_plan, "_MLComputePlanProxy", StandinComputePlan)
    import coremltools.models.compute_device as compute_device

    patch.setattr(compute_device, "_MLModelProxy", StandinModel)
    patch.setattr(compute_device, "_MLCPUComputeDeviceProxy", StandinCPUDevice)
    patch.setattr(compute_device, "_MLGPUComputeDeviceProxy", StandinGPUDevice)
    patch.setattr(compute_device, "_MLNeuralEngineComputeDeviceProxy", StandinNeuralEngineDevice)
    if os.environ.get(RULES_ENV):  # a worker process: the rules its test chose
        import json

        _rules.clear()
        _rules.update(json.loads(os.environ[RULES_ENV]))
    patch.setattr(coremltools, "libcoremlpython", module, raising=False)
    patch.setitem(sys.modules, "coremltools.libcoremlpython", module)


def child_env(macos: tuple[int, ...] = DEFAULT_MACOS) -> dict[str, str]:
    """Environment for a child Python process that should run on the stand-in too."""
    root = str(Path(__file__).parents[1])
    path = os.pathsep.join(p for p in (str(SITE_DIR), root, os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": path, ENV_FLAG: ".".join(map(str, macos))}
