"""The Core ML backend the pipeline sees: a proxy whose programs run in one worker process.

Every call into Core ML's native bridge holds the GIL for its whole length (coremltools 9.0:
`predict`, the model's load, `read_state`, `write_state` are plain pybind `.def`s) and some of
them can kill the process (a silent ANE compile failure, coremltools #2758, kills it at the
first prediction). So `make_backend("coreml")` gives this proxy, and the real `CoreMLBackend`
runs in a worker process (`ane_spec.worker_process`), one per loaded model: every program the
proxy loads lives in that one worker.

- `load` only registers the package and reads its description (inputs, outputs, states) from
  the package's spec, which is no native work; the worker starts and loads every registered
  package on `start()` (the pipeline calls it, or the daemon's warm-up does, so the server
  answers /health while Core ML loads) or on the first call.
- Per-pass arrays go through shared memory; outputs come back as views of it, in the values
  and dtype Core ML returns (float32), laid out so that one row of a [1, V, T, 1] head output is
  contiguous.
- States live in the worker; the parent holds handles (`WorkerState`), dropped there when the
  handle is collected.
- A worker that dies fails the call with `WorkerDied` (naming how and during what, the shard's
  file included); the next call starts a fresh worker and loads the same packages again. States
  made in the dead worker are gone: using one raises `StateLost`, so a caller must make new
  ones (the daemon drops its KV slots and says so).
"""

from __future__ import annotations

import functools
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.runtime.coreml_backend import count_shape_switch
from ane_spec.runtime.decode_shape import RESHAPE_FREQUENCIES, ReshapeFrequency
from ane_spec.worker_process import Channel, Outputs, WorkerDied, WorkerProcess

__all__ = ["CoreMLWorkerBackend", "StateLost", "WorkerDied"]


class StateLost(AneSpecError):
    """A state that lived in a Core ML worker that has died since."""


class CoreMLFailure(AneSpecError):
    """Core ML refused or failed a call (its own error text, with the program it was for): a
    server-side fault, never the client's."""


# --- the child -------------------------------------------------------------------------------

class _Handler:
    """Runs in the worker: the real CoreMLBackend, its programs and their states."""

    def __init__(self, channel: Channel, compute_units: str, reshape_frequency: str):
        from ane_spec.runtime.coreml_backend import CoreMLBackend

        self.channel = channel
        self.backend = CoreMLBackend(compute_units, reshape_frequency)  # type: ignore[arg-type]
        self.programs: dict[int, Any] = {}
        self.states: dict[int, tuple[int, Any]] = {}

    def load(self, pid: int, package: str, sha256: str | None) -> None:
        self.programs[pid] = self.backend.load(Path(package), sha256=sha256)

    def make_state(self, pid: int, sid: int) -> None:
        self.states[sid] = (pid, self.programs[pid].make_state())

    def drop_states(self, sids: list[int]) -> None:
        for sid in sids:
            self.states.pop(sid, None)

    def predict(self, pid: int, sid: int | None, dropped: list[int], *,
                arrays: dict[str, np.ndarray]) -> Outputs:
        self.drop_states(dropped)
        state = None if sid is None else self.states[sid][1]
        return Outputs(None, self.programs[pid].predict(arrays, state))

    def read_state(self, pid: int, sid: int, name: str) -> np.ndarray:
        return self.programs[pid].read_state(self.states[sid][1], name)

    def write_state(self, pid: int, sid: int, name: str, value: np.ndarray) -> None:
        self.programs[pid].write_state(self.states[sid][1], name, value)


def _weak(method: Any) -> Any:
    """`method`, called only while its object lives (the worker must not keep it alive)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        target = ref()
        if target is not None:
            target(*args)

    return call


def _make_handler(compute_units: str, reshape_frequency: str, channel: Channel) -> _Handler:
    return _Handler(channel, compute_units, reshape_frequency)


# --- the parent ------------------------------------------------------------------------------

class WorkerState:
    """A state living in the worker: a handle, valid while the worker that made it lives."""

    def __init__(self, program: WorkerProgram, sid: int, generation: int):
        self.program, self.sid, self.generation = program, sid, generation


class WorkerProgram:
    def __init__(self, backend: CoreMLWorkerBackend, pid: int, package: Path,
                 sha256: str | None, label: str, input_names: list[str],
                 output_names: list[str], state_names: list[str]):
        self.backend, self.pid, self.package, self.sha256 = backend, pid, package, sha256
        self.label = label
        self.input_names, self.output_names, self.state_names = (
            input_names, output_names, state_names)
        self._last_shapes: tuple | None = None

    def _state_id(self, state: Any) -> int | None:
        if state is None:
            return None
        if not isinstance(state, WorkerState) or state.program.backend is not self.backend:
            raise AneSpecError("a state from another model's Core ML worker")
        if state.generation != self.backend.worker.generation:
            raise StateLost(f"this KV state lived in a Core ML worker that has died since "
                            f"({self.backend.worker.health()['last_death']}); make a new one")
        return state.sid

    def make_state(self) -> WorkerState | None:
        if not self.state_names:
            return None
        sid = self.backend._next_id()
        self.backend._call("make_state", self.pid, sid, during=f"make_state of {self.label}")
        state = WorkerState(self, sid, self.backend.worker.generation)
        weakref.finalize(state, self.backend._dropped.append, sid)
        return state

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None) -> dict[str, np.ndarray]:
        if self.state_names and state is None:
            raise AneSpecError("this program is stateful: pass a state from make_state()")
        sid = self._state_id(state)
        # The values Core ML runs on are the fp16 ones the package declares, whatever the
        # caller's dtype (the in-worker program casts as the in-process one does); sending fp16
        # halves the bytes of an fp32 hidden state and keeps every value.
        arrays = {k: np.asarray(v, dtype=np.float16) for k, v in inputs.items()}
        self._last_shapes = count_shape_switch(self.backend.reshape_frequency,
                                               self._last_shapes, arrays)
        dropped, self.backend._dropped[:] = list(self.backend._dropped), []
        _, out = self.backend._call("predict", self.pid, sid, dropped, arrays=arrays,
                                    during=f"predict on {self.label}")
        return out

    def read_state(self, state: Any, name: str) -> np.ndarray:
        sid = self._state_id(state)
        return self.backend._call("read_state", self.pid, sid, name,
                                  during=f"read_state {name} of {self.label}")

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        if name not in self.state_names:
            raise AneSpecError(f"no state '{name}' (have {', '.join(self.state_names)})")
        sid = self._state_id(state)
        self.backend._call("write_state", self.pid, sid, name, np.asarray(value),
                           during=f"write_state {name} of {self.label}")


class CoreMLWorkerBackend:
    """Core ML in a worker process: the `Backend` the pipeline sees on macOS."""

    name = "coreml"
    precision = None  # Core ML picks the arithmetic per compute unit

    def __init__(self, compute_units: str = "CPU_AND_NE",
                 reshape_frequency: ReshapeFrequency = "Infrequent"):
        from ane_spec.runtime.coreml_backend import check_compute_units, require_macos

        self.compute_units = check_compute_units(compute_units)
        if reshape_frequency not in RESHAPE_FREQUENCIES:
            raise AneSpecError(f"unknown reshape frequency '{reshape_frequency}' (choose "
                               f"{' or '.join(RESHAPE_FREQUENCIES)})")
        self.reshape_frequency: ReshapeFrequency = reshape_frequency
        require_macos("the Core ML backend", "use --backend mil")
        self.programs: list[WorkerProgram] = []
        self._ids = 0
        self._id_lock = threading.Lock()
        self._dropped: list[int] = []
        self._loaded_generation = 0
        self.worker = WorkerProcess(
            "Core ML worker",
            functools.partial(_make_handler, self.compute_units, self.reshape_frequency),
            on_start=_weak(self._load_all))
        # The worker ends with its backend (a pipeline dropped, a test done), not at exit only.
        weakref.finalize(self, self.worker.close)

    def _next_id(self) -> int:
        with self._id_lock:
            self._ids += 1
            return self._ids

    def load(self, package: Path, *, sha256: str | None = None) -> WorkerProgram:
        import coremltools as ct

        package = Path(package)
        if not package.is_dir():
            raise AneSpecError(f"{package}: not an .mlpackage folder")
        # The package's description is read from its spec, with no native work (coremltools'
        # MLModel with skip_model_load reads the protobuf only).
        desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
        program = WorkerProgram(self, self._next_id(), package, sha256,
                                f"{package.name} ({package})", [i.name for i in desc.input],
                                [o.name for o in desc.output], [s.name for s in desc.state])
        self.programs.append(program)
        if self.worker.alive:  # loaded after start: load it now as well
            self._load(program)
        return program

    def start(self) -> None:
        """Start the worker and load every registered package in it (compiling each on first
        use: minutes at Phi size). The caller waits in a pipe read, with the GIL released."""
        self.worker.start()

    def _load_all(self, worker: WorkerProcess) -> None:
        self._dropped[:] = []
        for program in self.programs:
            self._load(program)
        self._loaded_generation = worker.generation

    def _load(self, program: WorkerProgram) -> None:
        self._call("load", program.pid, str(program.package), program.sha256,
                   during=f"load of {program.label}")

    def _call(self, method: str, *args: Any, during: str,
              arrays: dict[str, np.ndarray] | None = None) -> Any:
        try:
            return self.worker.call(method, *args, during=during, arrays=arrays)
        except (WorkerDied, AneSpecError):
            raise
        except Exception as exc:  # noqa: BLE001 - Core ML's own errors (RuntimeError, ...)
            raise CoreMLFailure(f"Core ML failed during {during}: {type(exc).__name__}: "
                                f"{str(exc).strip()}") from exc

    def health(self) -> dict[str, Any]:
        return self.worker.health() | {"programs": len(self.programs)}

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> str:
        return f"Core ML ({self.compute_units}, reshapeFrequency {self.reshape_frequency})"
