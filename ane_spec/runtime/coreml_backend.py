"""Core ML as a backend (macOS only): packages compiled once into kept `.mlmodelc` folders.

coremltools' runtime is imported inside the functions, never at module import, so this module
loads anywhere; everything that needs Core ML first calls `require_macos`. Calls follow
coremltools 9.0's source: models/utils.py `compile_model`, models/_compiled_model.py
`CompiledMLModel`, models/model.py `MLState`.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.runtime.backend import BackendUnavailable

COMPUTE_UNITS = ("ALL", "CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE")  # coremltools.ComputeUnit names


def check_compute_units(name: str) -> str:
    if name not in COMPUTE_UNITS:
        raise AneSpecError(f"unknown compute units '{name}' (choose one of "
                           f"{', '.join(COMPUTE_UNITS)})")
    return name


def require_macos(what: str) -> None:
    if sys.platform != "darwin":
        raise BackendUnavailable(f"{what} needs macOS (Core ML cannot compile, run or plan "
                                 f"models on {sys.platform}); use --backend mil")
    try:  # the native bridge every runtime call goes through (models/model.py imports it)
        from coremltools import libcoremlpython  # noqa: F401
    except ImportError as exc:
        raise BackendUnavailable(f"{what} needs coremltools' native Core ML bridge, which "
                                 f"failed to load ({exc}); use --backend mil") from None


def compile_package(package: Path) -> Path:
    """`x.mlpackage` -> `x.mlmodelc` next to it, compiled only when missing or older."""
    require_macos("compiling a Core ML package")
    from coremltools.models.utils import compile_model

    package = Path(package)
    compiled = package.with_suffix(".mlmodelc")
    newest = max(p.stat().st_mtime for p in [package, *package.rglob("*")])
    if compiled.is_dir() and compiled.stat().st_mtime > newest:
        return compiled
    # compile_model(model_path, destination_path) moves Core ML's output to destination_path,
    # which must end in ".mlmodelc" (models/utils.py); a temp sibling makes the swap atomic.
    tmp = compiled.with_name(f".{compiled.stem}.{os.getpid()}.mlmodelc")
    shutil.rmtree(tmp, ignore_errors=True)
    started = time.time()
    try:
        compile_model(str(package), destination_path=str(tmp))
        shutil.rmtree(compiled, ignore_errors=True)
        os.replace(tmp, compiled)
        os.utime(compiled, (started, started))  # a package edited mid-compile stays newer
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return compiled


class CoreMLProgram:
    def __init__(self, model: Any, input_names: list[str], output_names: list[str],
                 state_names: list[str]):
        self.model = model
        self.input_names, self.output_names, self.state_names = (
            input_names, output_names, state_names)

    def make_state(self) -> Any:
        # CompiledMLModel.make_state() -> MLState, zero-filled (Apple: MLModel.makeState()).
        return self.model.make_state() if self.state_names else None

    def predict(self, inputs: dict[str, np.ndarray], state: Any = None) -> dict[str, np.ndarray]:
        # A fresh dict: CompiledMLModel.predict upcasts fp16 arrays to fp32 in the dict it is
        # given (MLModel._update_float16_multiarray_input_to_float32); Core ML then converts
        # them to the fp16 the package declares, so values are exactly these fp16 ones.
        feed = {k: np.ascontiguousarray(v, dtype=np.float16) for k, v in inputs.items()}
        if not self.state_names:
            out = self.model.predict(feed)
        elif state is None:
            raise AneSpecError("this program is stateful: pass a state from make_state()")
        else:
            out = self.model.predict(feed, state=state)
        return {k: np.asarray(v) for k, v in out.items()}

    def read_state(self, state: Any, name: str) -> np.ndarray:
        # MLState.read_state(name) -> numpy array (models/model.py; test_api_examples.py).
        return np.array(state.read_state(name), dtype=np.float32)

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        # MLState.write_state(name, value) (models/model.py, coremltools 9): states are fp16.
        state.write_state(name, np.ascontiguousarray(value, dtype=np.float16))


class CoreMLBackend:
    name = "coreml"
    precision = None  # Core ML picks the arithmetic per compute unit

    def __init__(self, compute_units: str = "CPU_AND_NE"):
        self.compute_units = check_compute_units(compute_units)
        require_macos("the Core ML backend")

    def load(self, package: Path) -> CoreMLProgram:
        import coremltools as ct

        compiled = compile_package(package)
        desc = ct.models.MLModel(str(package), skip_model_load=True).get_spec().description
        if desc.state and int(platform.mac_ver()[0].split(".")[0]) < 15:  # MLModel.make_state
            raise BackendUnavailable("stateful programs need macOS 15 or later; "
                                     "use --backend mil")
        # CompiledMLModel(path: str, compute_units: ct.ComputeUnit) (models/_compiled_model.py)
        model = ct.models.CompiledMLModel(str(compiled), ct.ComputeUnit[self.compute_units])
        return CoreMLProgram(model, [i.name for i in desc.input], [o.name for o in desc.output],
                             [s.name for s in desc.state])

    def describe(self) -> str:
        return f"Core ML ({self.compute_units})"
