"""What the pipeline needs from an execution engine, and the engines there are.

A backend loads one `.mlpackage` (a layer shard or the LM head) into a `LoadedProgram`, which makes
fresh states and runs predictions. Core ML (macOS) and the MIL interpreter (anywhere) implement
it; nothing above this module knows which one it is talking to.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.runtime.decode_shape import DecodeShape, DecodeShapePolicy

BackendName = Literal["mil", "coreml"]
Precision = Literal["fp32", "fp16"]


class BackendUnavailable(AneSpecError):
    """The requested backend cannot run on this machine (e.g. Core ML off macOS)."""


@runtime_checkable
class LoadedProgram(Protocol):
    input_names: list[str]
    output_names: list[str]
    state_names: list[str]

    def make_state(self) -> Any:
        """A fresh (zeroed) state for one conversation; None for stateless programs."""

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None) -> dict[str, np.ndarray]:
        """Run once; updates `state` in place. Inputs are fp16 arrays as the manifest declares."""

    def read_state(self, state: Any, name: str) -> np.ndarray:
        """A copy of one state tensor, for debugging and the block gate."""

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        """Overwrite one state tensor (converted to its declared dtype), e.g. to copy a cache."""


class Backend(Protocol):
    name: BackendName
    precision: Precision | None  # None where the hardware decides (Core ML)

    def load(self, package: Path, *, digest: str | None = None,
             function: str = "main") -> LoadedProgram:
        """`digest`: the package's content hash as the manifest records it, if known (Core ML
        keys its compiled-model cache by it; otherwise it hashes the package). `function`: which
        of a multifunction package's functions (a layer package's `prefill`; Core ML's default,
        `main`, otherwise). Programs of one package's functions may share one state."""

    def describe(self) -> str:
        ...


def start_backend(backend: Backend) -> None:
    """Load what `backend` defers to its worker process (Core ML), now; nothing otherwise."""
    start = getattr(backend, "start", None)
    if start is not None:
        start()


def make_backend(name: BackendName, *, precision: Precision = "fp32",
                 compute_units: str = "CPU_AND_NE", decode_shape: DecodeShape = "fixed") -> Backend:
    shape = DecodeShapePolicy(decode_shape)
    if name == "mil":
        from ane_spec.runtime.mil_backend import MILBackend

        return MILBackend(precision)
    if name == "coreml":
        # Core ML's calls hold the GIL and can kill the process: they run in a worker process,
        # behind this proxy (runtime/coreml_worker.py).
        from ane_spec.runtime.coreml_worker import CoreMLWorkerBackend

        return CoreMLWorkerBackend(compute_units=compute_units,
                                   reshape_frequency=shape.reshape_frequency)
    raise AneSpecError(f"unknown backend '{name}' (choose mil or coreml)")


def default_backend_name() -> BackendName:
    """Core ML where it can run; the interpreter elsewhere."""
    return "coreml" if os.uname().sysname == "Darwin" else "mil"
