"""Core ML as a backend (macOS 15+ only): packages compiled once into a per-user cache.

coremltools' runtime is imported inside the functions, never at module import, so this module
loads anywhere; everything that needs Core ML first calls `require_macos`, which names what is
missing in one line ("unavailable: needs macOS 15 ..."). Calls follow coremltools 9.0's source:
models/utils.py `compile_model` and `_macos_version`, models/_compiled_model.py `CompiledMLModel`
(with `optimization_hints`), models/model.py `MLState`.
"""

from __future__ import annotations

import math
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.package_spec import function_description, is_multifunction, read_spec
from ane_spec.runtime.autorelease import autorelease_pool
from ane_spec.runtime.backend import BackendUnavailable
from ane_spec.runtime.decode_shape import RESHAPE_FREQUENCIES, ReshapeFrequency
from ane_spec.runtime.compiled_cache import compile_cached

COMPUTE_UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")  # coremltools.ComputeUnit names
# Every package is an iOS18-opset program and the layer shards are stateful: both need macOS 15
# (MLState, the iOS18 opset). MLComputePlan alone would need 14.4, so 15 covers everything.
MIN_MACOS = (15, 0)


def check_reshape_frequency(name: str) -> ReshapeFrequency:
    if name not in RESHAPE_FREQUENCIES:
        raise AneSpecError(f"unknown reshape frequency '{name}' (choose "
                           f"{' or '.join(RESHAPE_FREQUENCIES)})")
    return name  # type: ignore[return-value]


def check_compute_units(name: str) -> str:
    if name not in COMPUTE_UNITS:
        raise AneSpecError(f"unknown compute units '{name}' (choose one of "
                           f"{', '.join(COMPUTE_UNITS)})")
    return name


def macos_problem(platform: str, version: tuple[int, ...]) -> str | None:
    """Why Core ML cannot run these packages on `platform` at `version`, or None if it can."""
    need = MIN_MACOS[0]
    if platform != "darwin":
        return f"unavailable: needs macOS {need} (this is {platform})"
    if tuple(version) < MIN_MACOS:
        have = ".".join(str(v) for v in version) or "of unknown version"
        return f"unavailable: needs macOS {need} (this is macOS {have})"
    return None


def require_macos(what: str, advice: str = "") -> None:
    """Raise BackendUnavailable, one line naming what is missing, unless Core ML can run here."""
    tail = f": {what} needs Core ML" + (f"; {advice}" if advice else "")
    version: tuple[int, ...] = ()
    if sys.platform == "darwin":
        from coremltools.models.utils import _macos_version  # coremltools' own check (sw_vers)

        try:
            version = _macos_version()
        except Exception as exc:  # it raises a bare Exception when sw_vers fails
            raise BackendUnavailable(f"unavailable: could not read the macOS version ({exc})"
                                     + tail) from None
    problem = macos_problem(sys.platform, version)
    if problem:
        raise BackendUnavailable(problem + tail)
    try:  # the native bridge every runtime call goes through (models/model.py imports it)
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(f"unavailable: coremltools' native Core ML bridge failed to "
                                 f"load ({exc})" + tail) from None


def hardware_problem() -> str | None:
    """Why results here say nothing about Apple hardware (placement, speed, JIT, memory), or
    None on a real Core ML. Only a test stand-in for coremltools' native layer says so (through
    its module attribute); Core ML itself never does."""
    module = sys.modules.get("coremltools.libcoremlpython")
    return getattr(module, "ANE_SPEC_STANDIN", None)


def compile_package(package: Path, digest: str | None = None) -> Path:
    """The compiled `.mlmodelc` of a package, from the per-user cache (see compiled_cache),
    compiling it on first use. `digest` is the package's content hash as a manifest records it;
    without one the package is hashed here."""
    require_macos("compiling a Core ML package")
    from coremltools.models.utils import compile_model

    from ane_spec.manifests.store import hash_path

    package = Path(package)
    if not package.is_dir():
        raise AneSpecError(f"{package}: not an .mlpackage folder")
    digest = digest or hash_path(package)[1]

    def compile_to(src: Path, dst: Path) -> None:
        # compile_model moves Core ML's output to destination_path, which must end in
        # ".mlmodelc" and not exist yet (models/utils.py).
        compile_model(str(src), destination_path=str(dst))

    return compile_cached(package, digest, compile_to)


def optimization_hints(reshape_frequency: ReshapeFrequency) -> dict[str, Any]:
    """CompiledMLModel's `optimization_hints` (macOS 15+): `reshapeFrequency` tells Core ML
    whether input shapes change between predictions. Infrequent lets it specialise for the one
    shape the fixed decode shape uses; Frequent suits alternating T=1 and T=4 passes."""
    import coremltools as ct

    return {"reshapeFrequency": ct.ReshapeFrequency[reshape_frequency]}


# Input-shape changes on programs loaded with reshapeFrequency Infrequent, in this process. Apple:
# with Infrequent, Core ML re-optimises for each new shape (about 2 minutes per shape for a
# Phi-size stack in the seed log), so each one is a potential re-specialisation.
_shape_switches = 0


def shape_switches() -> int:
    return _shape_switches


def count_shape_switch(reshape_frequency: str, last: tuple | None,
                       feed: dict[str, np.ndarray]) -> tuple:
    """Count a switch when a program loaded with Infrequent gets new input shapes; returns the
    shapes to compare the next call with (the Core ML worker's proxy counts in the parent)."""
    global _shape_switches
    shapes = tuple(sorted((k, tuple(v.shape)) for k, v in feed.items()))
    if reshape_frequency == "Infrequent" and last is not None and shapes != last:
        _shape_switches += 1
    return shapes


# The bridge's lifetime rule. coremltools 9.0 wraps every array given to `predict` without
# copying it (PybindCompatibleArray, CoreMLPythonArray.mm: an MLMultiArray over the array's
# buffer with `deallocator:nil`, the numpy array kept in a `py::array` member). Core ML can keep
# that wrapper after `predict` returns: its MLE5 engine leaves the input ports bound and unbinds
# them about a second later on its own queue (com.apple.coreml.MLE5ExecutionStream.resetQueue),
# and the wrapper's destructor then does a Py_DECREF without the GIL. When that is the last
# reference, the array is freed off-thread: heap corruption or a SIGSEGV, at once or during a
# later, unrelated call. coremltools PRs #2827 and #2829 (both open) take the GIL there; #2827
# names this project's old pattern exactly: fresh fp16 arrays in a dict that dies when the call
# returns, swapped by `predict` for float32 temporaries that nobody but Core ML holds.
#
# So every array the bridge sees is one we made (float32, so coremltools swaps nothing), kept
# referenced, untouched, for LINGER_SECONDS after the call. A ring of recent feeds rather than
# persistent buffers reused every pass: #2827 also notes that Core ML keeps the buffer's raw
# pointer bound for that same window, so writing the next pass's values into the same buffer
# would race Core ML. Arrays that we only drop after the window make the last reference always
# ours, dropped with the GIL.
#
# A pass's pass-wide inputs (masks, RoPE tables) are the same for every shard: they are
# converted once per pass and that one set is lent to every shard (`lend` around the pass), so
# a 30-shard pass keeps one copy of them, not 30. The ring is bounded by bytes as well as by
# time: past `max_bytes` the oldest entries go early, but never before MIN_LINGER_SECONDS (twice
# the ~1 s Core ML was seen to hold inputs), so the bound gives way only to a pass rate that
# lends more than `max_bytes` within that floor.
#
# `write_state` values are not ringed: `State::writeState` (CoreMLPython.mm) copies the value
# into the state synchronously (`transferToMultiArray:` inside the
# `getMultiArrayForStateNamed:handler:` block), and the only other holder, the autoreleased
# MLFeatureValue that `convertValueToObjC` made, is released when our autorelease pool around
# the call pops (runtime/autorelease.py), on our thread, with the GIL.
LINGER_SECONDS = 10.0  # ten times the ~1 s Core ML was seen to keep inputs (#2827)
MIN_LINGER_SECONDS = 2.0
FEED_RING_BYTES = 64 << 20


def _nbytes(feed: dict[str, np.ndarray]) -> int:
    return sum(int(a.nbytes) for a in feed.values())


class FeedRing:
    """Arrays handed to Core ML, each kept alive (and never written) for LINGER_SECONDS, or
    MIN_LINGER_SECONDS once the ring holds more than `max_bytes`."""

    def __init__(self, seconds: float = LINGER_SECONDS, clock=time.monotonic,  # noqa: ANN001
                 max_bytes: int = FEED_RING_BYTES, min_seconds: float = MIN_LINGER_SECONDS):
        self.seconds, self.clock = seconds, clock
        self.max_bytes, self.min_seconds = max_bytes, min(min_seconds, seconds)
        self._kept: deque[list] = deque()  # [released at (inf: in a call), feed, bytes]
        self.nbytes = 0  # bytes of every array the ring holds now

    def _evict(self, now: float) -> None:
        while self._kept:
            age = now - self._kept[0][0]
            if age > self.seconds or (self.nbytes > self.max_bytes and age >= self.min_seconds):
                self.nbytes -= self._kept.popleft()[2]
            else:
                return

    @contextmanager
    def lend(self, feed: dict[str, np.ndarray]):  # noqa: ANN201
        """Hold `feed` during the native call (or the pass) and for the window after it
        returns (or fails)."""
        self._evict(self.clock())
        entry = [math.inf, dict(feed), _nbytes(feed)]  # not evicted while the call runs
        self._kept.append(entry)
        self.nbytes += entry[2]
        try:
            yield
        finally:
            entry[0] = self.clock()

    def __len__(self) -> int:
        return len(self._kept)

    def holds(self, array: np.ndarray) -> bool:
        return any(a is array for _, feed, _ in self._kept for a in feed.values())


# One ring for the process, not one per program: a program dropped right after a call (a probe's
# throwaway load) must not take the arrays Core ML may still hold with it.
FEEDS = FeedRing()


def input_array(value: Any) -> np.ndarray:
    """An input in the dtype its package declares: fp16 for every float input, int32 for an
    integer one (a slice-write build's kv_write_start; fp16 would round a slot above 2048)."""
    a = np.asarray(value)
    return a.astype(np.int32 if a.dtype.kind in "iu" else np.float16, copy=False)


def bridge_array(value: Any) -> np.ndarray:
    """A fresh array of an input as coremltools' bridge takes it (float32, int32 or float64:
    CoreMLPythonArray.mm dataTypeOf): float32 of its fp16 values, or int32."""
    a = input_array(value)
    return a.astype(np.float32) if a.dtype == np.float16 else np.array(a, copy=True)


def as_bridged(value: np.ndarray) -> np.ndarray:
    """`value` itself where the bridge takes it as it is (float32, C order, writable: a Core ML
    output handed on to the next program), else `bridge_array`'s fresh copy."""
    if value.dtype == np.float32 and value.flags.c_contiguous and value.flags.writeable:
        return value
    return bridge_array(value)


class CoreMLProgram:
    def __init__(self, model: Any, input_names: list[str], output_names: list[str],
                 state_names: list[str], reshape_frequency: ReshapeFrequency = "Infrequent"):
        self.model = model
        self.input_names, self.output_names, self.state_names = (
            input_names, output_names, state_names)
        self.reshape_frequency = reshape_frequency
        self._last_shapes: tuple | None = None
        self.feeds = FEEDS

    def _count_shape(self, feed: dict[str, np.ndarray]) -> None:
        self._last_shapes = count_shape_switch(self.reshape_frequency, self._last_shapes, feed)

    def make_state(self) -> Any:
        # CompiledMLModel.make_state() -> MLState, zero-filled (Apple: MLModel.makeState()).
        return self.model.make_state() if self.state_names else None

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None, *,
                lent: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        # Fresh float32 arrays of the fp16 values, kept alive by the feed ring (see
        # FeedRing): coremltools' predict would otherwise swap fp16 arrays for float32
        # temporaries (MLModel._update_float16_multiarray_input_to_float32) that only Core ML
        # still holds once the call returns. Core ML converts them to the fp16 the package
        # declares, so values are exactly the fp16 ones. `lent`: inputs already made by
        # `bridge_array` and held by the ring for the whole pass (`FeedRing.lend`), given as
        # they are (the pass-wide masks and RoPE tables, one set for every shard).
        feed = {k: bridge_array(v) for k, v in inputs.items()}
        return self.predict_bridged(feed, state, lent=lent)

    def predict_bridged(self, feed: dict[str, np.ndarray], state: Any = None, *,
                        lent: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """`predict` on arrays that are already as the bridge takes them and that no one
        writes again (a shard's output as the next shard's input): held by the ring, not
        copied."""
        whole = feed if not lent else {**lent, **feed}
        self._count_shape(whole)
        if self.state_names and state is None:
            raise AneSpecError("this program is stateful: pass a state from make_state()")
        with self.feeds.lend(feed):
            out = (self.model.predict(whole) if not self.state_names
                   else self.model.predict(whole, state=state))
        return {k: np.asarray(v) for k, v in out.items()}

    def read_state(self, state: Any, name: str) -> np.ndarray:
        # MLState.read_state(name) (models/model.py) -> State::readState (CoreMLPython.mm):
        # Utils::convertArrayValueToPython already returns a float32 copy of the fp16 state.
        # readState has no @autoreleasepool of its own: ours frees what Core ML autoreleases.
        with autorelease_pool():
            return np.asarray(state.read_state(name), dtype=np.float32)

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        # MLState.write_state (models/model.py) hands the value to State::writeState untouched
        # (no fp16 upcast, unlike predict), and the bridge accepts only int32, float32 and float64
        # arrays (CoreMLPythonArray.mm dataTypeOf; anything else is "value type not
        # convertible", CoreMLPythonUtils.mm convertValueToObjC). So float32, whole-state shape,
        # contiguous and writable; Core ML converts it to the state's fp16 (transferToMultiArray),
        # and fp16 -> fp32 -> fp16 is exact. The copy is synchronous and our pool releases the
        # bridge's wrapper before this returns (see FeedRing's note): the value is not ringed.
        if name not in self.state_names:
            raise AneSpecError(f"no state '{name}' (have {', '.join(self.state_names)})")
        value = np.require(value, dtype=np.float32, requirements=["C", "W"])
        with autorelease_pool():
            state.write_state(name, value)


class CoreMLBackend:
    name = "coreml"
    precision = None  # Core ML picks the arithmetic per compute unit

    def __init__(self, compute_units: str = "CPU_AND_NE",
                 reshape_frequency: ReshapeFrequency = "Infrequent"):
        self.compute_units = check_compute_units(compute_units)
        self.reshape_frequency = check_reshape_frequency(reshape_frequency)
        require_macos("the Core ML backend", "use --backend mil")

    def load(self, package: Path, *, digest: str | None = None,
             function: str = "main") -> CoreMLProgram:
        import coremltools as ct

        compiled = compile_package(package, digest)
        spec = read_spec(package)
        desc = function_description(spec, function)
        # CompiledMLModel(path, compute_units, function_name, optimization_hints)
        # (models/_compiled_model.py). A multifunction package's function is chosen by name
        # (MLModelConfiguration.functionName, macOS 15); a one-function package takes none.
        # Programs of one package's functions share a state when their state descriptions
        # match (a layer package's decode and prefill functions: static_checks checks it):
        # Anemll makes one state from its `prefill` function and predicts with it on `infer`
        # too (Anemll/Anemll tests/chat.py, create_unified_state).
        model = ct.models.CompiledMLModel(
            str(compiled), ct.ComputeUnit[self.compute_units],
            function_name=function if is_multifunction(spec) else None,
            optimization_hints=optimization_hints(self.reshape_frequency))
        return CoreMLProgram(model, [i.name for i in desc.input], [o.name for o in desc.output],
                             [s.name for s in desc.state], self.reshape_frequency)

    def describe(self) -> str:
        return f"Core ML ({self.compute_units}, reshapeFrequency {self.reshape_frequency})"
