"""The MIL interpreter as a backend: runs the shipped packages with numpy, on any OS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError, ManifestError, untrusted
from ane_spec.runtime.backend import Precision
from ane_spec.runtime.mil_interpreter import Kernels, MILInterpreter, SharedConsts


class MILProgram:
    def __init__(self, interp: MILInterpreter):
        self.interp = interp
        self.input_names = interp.input_names
        self.output_names = interp.output_names
        self.state_names = interp.state_names

    def make_state(self) -> dict[str, np.ndarray] | None:
        return self.interp.make_state() if self.state_names else None

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None) -> dict[str, np.ndarray]:
        return self.interp.predict(inputs, state)

    def read_state(self, state: dict[str, np.ndarray], name: str) -> np.ndarray:
        return np.array(state[name], dtype=np.float32)

    def write_state(self, state: dict[str, np.ndarray], name: str, value: np.ndarray) -> None:
        state[name][...] = value


class MILBackend:
    name = "mil"

    def __init__(self, precision: Precision = "fp32", kernels: Kernels = "row"):
        self.precision: Precision = precision
        self.kernels: Kernels = kernels
        # A layer package's decode and prefill functions share their weights: loaded as two
        # programs, they hold each (float32, folded) weight once.
        self.shared = SharedConsts()

    def load(self, package: Path, *, digest: str | None = None,
             function: str = "main") -> MILProgram:
        # digest keys Core ML's compiled-model cache; the interpreter compiles nothing.
        try:
            interp = MILInterpreter.from_package(package, precision=self.precision,
                                                 function=function, kernels=self.kernels,
                                                 shared=self.shared)
        except AneSpecError:
            raise
        except Exception as exc:  # noqa: BLE001: coremltools' parsers raise whatever they meet
            # (protobuf DecodeError, ValueError from the blob reader, RuntimeError from the
            # package's JSON): a package whose hash matched but cannot be read is a bad artifact.
            raise ManifestError(f"{package}: the package cannot be read ({type(exc).__name__}: "
                                f"{untrusted(str(exc), 160)}); rebuild it") from None
        return MILProgram(interp)

    def describe(self) -> str:
        kernels = ", batched kernels" if self.kernels == "batched" else ""
        return f"MIL interpreter ({self.precision}{kernels})"
