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
- A pipeline pass is one call (`run_pass`: every shard, then the head), and the head's logits
  stay in the worker (`RemoteRows`): the argmax of the rows greedy decoding reads (row 0, then
  each row whose draft the row before chose) comes back with the reply, computed there by
  `fp16_argmax.argmax` on the same row; any other row's argmax, or a row itself (through shared
  memory), is one more call when read. The NaN rule is the pipeline's: a row is refused when it
  is read, never before. So a greedy pass costs one round trip and moves no logits.
- States live in the worker; the parent holds handles (`WorkerState`), dropped there when the
  handle is collected.
- A worker that dies fails the call with `WorkerDied` (naming how and during what, the shard's
  file included); the next call starts a fresh worker and loads the same packages again. States
  made in the dead worker are gone: using one raises `StateLost`, so a caller must make new
  ones (the daemon drops its KV slots and says so).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import weakref
from pathlib import Path
from typing import Any

import numpy as np

from ane_spec.errors import AneSpecError
from ane_spec.peak_memory import current_rss_bytes
from ane_spec.runtime.coreml_backend import (
    FEEDS, as_bridged, bridge_array, count_shape_switch, input_array,
)
from ane_spec.runtime.decode_shape import ReshapeFrequency
from ane_spec.runtime.fp16_argmax import NonFiniteLogits, argmax
from ane_spec.runtime.hidden_layout import head_token_major, repeat_row
from ane_spec.runtime.state_rows import first_rows
from ane_spec.worker_process import (
    ArraySpec, Channel, Outputs, WorkerDied, WorkerProcess, Written, view,
)

__all__ = ["CoreMLWorkerBackend", "StateLost", "WorkerDied"]


class StateLost(AneSpecError):
    """A state that lived in a Core ML worker that has died since."""


class CoreMLFailure(AneSpecError):
    """Core ML refused or failed a call (its own error text, with the program it was for): a
    server-side fault, never the client's."""


class _StepFailed(AneSpecError):
    """Core ML's own error at one program of a pass (`run_pass`): the parent names it."""

    def __init__(self, step: int, kind: str, text: str):
        super().__init__(step, kind, text)
        self.step, self.kind, self.text = step, kind, text


# --- the child -------------------------------------------------------------------------------

class _Handler:
    """Runs in the worker: the real CoreMLBackend, its programs and their states."""

    def __init__(self, channel: Channel, compute_units: str, reshape_frequency: str):
        from ane_spec.runtime.coreml_backend import CoreMLBackend

        self.channel = channel
        self.backend = CoreMLBackend(compute_units, reshape_frequency)  # type: ignore[arg-type]
        self.programs: dict[int, Any] = {}
        self.states: dict[int, tuple[int, Any]] = {}
        self.heads: dict[int, tuple[dict[str, np.ndarray], HeadRows]] = {}
        self._scratch: np.ndarray | None = None

    def load(self, pid: int, package: str, digest: str | None, function: str = "main") -> None:
        self.programs[pid] = self.backend.load(Path(package), digest=digest, function=function)

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

    def run_pass(self, shards: list[tuple[int, int | None]], dropped: list[int],
                 heads: list[int], hid: int, dropped_heads: list[int], rows: HeadRows,
                 chain: list[int], head_row: tuple[int, int] | None = None, *,
                 arrays: dict[str, np.ndarray]) -> list[int | None]:
        """One pass in one call: `arrays["x"]` through the shards (pid, state id) in order, each
        with the other arrays as its inputs, then the head's packages (pids, in vocabulary
        order: one unless the head was split over --max-head-mb; none for a prefill chunk that
        is not the prompt's last). `head_row` (row, width): the head runs on that one row of
        the shards' output, repeated `width` times (a prefill chunk's last token). The head's
        prediction is kept here under `hid` until the parent drops it; its rows cross when read
        (`head_row`, `head_argmax`). Returned: the argmax of the rows greedy decoding reads
        (`_chain`)."""
        self.drop_states(dropped)
        for old in dropped_heads if not heads else ():
            self.heads.pop(old, None)
        inputs = dict(arrays)
        hidden = inputs.pop("x")
        # The pass-wide inputs (masks, RoPE tables) are converted once for the pass and that
        # one set is lent to every shard (coreml_backend.FeedRing); each shard's output goes
        # on as the next one's input as Core ML returned it (float32 of fp16 values).
        shared = {k: bridge_array(v) for k, v in inputs.items()}
        hidden = bridge_array(hidden)
        step = 0
        try:
            with FEEDS.lend(shared):
                for step, (pid, sid) in enumerate(shards):
                    state = None if sid is None else self.states[sid][1]
                    hidden = self.programs[pid].predict_bridged(
                        {"x": as_bridged(hidden)}, state, lent=shared)["hidden"]
            step = len(shards)
            if not heads:
                return []
            if head_row is not None:
                hidden = repeat_row(hidden, *head_row, rows.layout)
            return self.predict_head(heads, hid, dropped_heads, rows, chain, step,
                                     arrays={"x": hidden})
        except AneSpecError:
            raise
        except Exception as exc:  # noqa: BLE001 - Core ML's own: the parent names the program
            raise _StepFailed(step, type(exc).__name__, str(exc).strip()) from None

    def predict_head(self, pids: list[int], hid: int, dropped: list[int], rows: HeadRows,
                     chain: list[int], first_step: int, *,
                     arrays: dict[str, np.ndarray]) -> list[int | None]:
        """Every head package on the same hidden states; their outputs (named by chunk index in
        the whole head) merged into what one package would have returned."""
        for old in dropped:
            self.heads.pop(old, None)
        merged: dict[str, np.ndarray] = {}
        for n, pid in enumerate(pids):
            try:
                merged.update(self.programs[pid].predict(arrays, None))
            except AneSpecError:
                raise
            except Exception as exc:  # noqa: BLE001 - Core ML's own: the parent names it
                raise _StepFailed(first_step + n, type(exc).__name__, str(exc).strip()) from None
        self.heads[hid] = (merged, rows)
        return self._chain(hid, chain)

    def _chain(self, hid: int, tokens: list[int]) -> list[int | None]:
        """The argmax of row 0, then of each next row while the row before chose the token that
        follows it in `tokens` (a greedy verifier reads row i + 1 only when draft i + 1 is
        accepted): None for a non-finite row, which ends the chain. Rows past it are read on
        demand; the parent raises for a None row only when that row is read."""
        known: list[int | None] = []
        for r in range(len(tokens)):
            try:
                best = self.head_argmax(hid, r)
            except NonFiniteLogits:
                known.append(None)
                break
            known.append(best)
            if r + 1 >= len(tokens) or best != tokens[r + 1]:
                break
        return known

    def _gather(self, hid: int, r: int, out: np.ndarray | None) -> np.ndarray:
        """Row r of a kept head prediction: the same strided copy per chunk, into a row of the
        head's own dtype, that the in-process pipeline makes (`ShardPipeline._read_head`), into
        `out` where given, else into this worker's reused scratch row."""
        outputs, rows = self.heads[hid]
        views = [rows.token_major(outputs[name]) for name in rows.names]
        shape, dtype = (rows.chunks[-1][1],), views[0].dtype
        if out is None:
            if self._scratch is None or self._scratch.shape != shape \
                    or self._scratch.dtype != dtype:
                self._scratch = np.empty(shape, dtype)
            out = self._scratch
        for (start, end), v in zip(rows.chunks, views):
            out[start:end] = v[r]
        return out

    def head_row(self, hid: int, r: int) -> Written | Outputs:
        """Row r, gathered straight into the call's output slab (no copy through this heap)."""
        outputs, rows = self.heads[hid]
        dtype = outputs[rows.names[0]].dtype
        spec = ArraySpec("row", dtype.str, (rows.chunks[-1][1],), 0, False)
        buf = self.channel.output(dtype.itemsize * spec.shape[0])
        if buf is None:
            return Outputs(None, {"row": self._gather(hid, r, np.empty(spec.shape, dtype))})
        self._gather(hid, r, view(buf, spec))
        return Written(None, [spec])

    def head_argmax(self, hid: int, r: int) -> int:
        """Row r's argmax, by the same function on the same values as the caller would use
        (`fp16_argmax.argmax`, which refuses a non-finite row): only the index crosses."""
        return argmax(self._gather(hid, r, None))

    def _reply(self, name: str, value: np.ndarray) -> Written | Outputs:
        """`value` back through the call's output slab, C order, written there directly."""
        spec = ArraySpec(name, value.dtype.str, tuple(value.shape), 0, False)
        buf = self.channel.output(value.nbytes)
        if buf is None:
            return Outputs(None, {name: value})
        np.copyto(view(buf, spec), value)
        return Written(None, [spec])

    def read_state(self, pid: int, sid: int, name: str) -> Written | Outputs:
        return self._reply("state", self.programs[pid].read_state(self.states[sid][1], name))

    def write_state(self, pid: int, sid: int, name: str, *,
                    arrays: dict[str, np.ndarray]) -> None:
        self.programs[pid].write_state(self.states[sid][1], name, arrays["value"])

    def read_rows(self, pid: int, sid: int, name: str, n: int, axis: int | None,
                  dtype: str) -> Written | Outputs:
        """The first n rows along `axis` of a state (all of it for None), cast to `dtype`
        here: a capture of n tokens moves n rows of fp16, not the whole float32 state."""
        full = self.programs[pid].read_state(self.states[sid][1], name)
        rows = full if axis is None else full[first_rows(full.ndim, axis, n)]
        shape = tuple(rows.shape)
        spec = ArraySpec("rows", np.dtype(dtype).str, shape, 0, False)
        buf = self.channel.output(np.dtype(dtype).itemsize * math.prod(shape))
        if buf is None:
            return Outputs(None, {"rows": rows.astype(dtype)})
        np.copyto(view(buf, spec), rows, casting="unsafe")
        return Written(None, [spec])

    def resident_bytes(self) -> int:
        """This process's resident memory now: the states live here, and so would whatever
        Core ML autoreleases around a read or write that no pool frees."""
        return current_rss_bytes()

    def write_rows(self, pid: int, sid: int, name: str, n: int, axis: int | None,
                   shape: tuple[int, ...], *, arrays: dict[str, np.ndarray] | None = None
                   ) -> None:
        """Rows 0..n-1 along `axis` from `arrays["rows"]` (none: n must be 0), zeros past
        them: the whole state is made here, so only the rows cross."""
        full = np.zeros(shape, dtype=np.float32)
        if arrays is not None:
            full[first_rows(len(shape), axis, n) if axis is not None else ...] = arrays["rows"]
        self.programs[pid].write_state(self.states[sid][1], name, full)

@dataclasses.dataclass(frozen=True)
class HeadRows:
    """How a head prediction's rows are read: its logits outputs in vocabulary order, their
    [start, end) ranges, the hidden layout (BCT1: [1, V_i, T, 1]; else [1, V_i, 1, T]), and the
    head's own (build.head_layout: vocab-last heads emit [1, T, V_i])."""

    names: tuple[str, ...]
    chunks: tuple[tuple[int, int], ...]
    layout: str
    head_layout: str = "channels"

    def token_major(self, x: np.ndarray) -> np.ndarray:
        return head_token_major(x, self.layout, self.head_layout)


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

def _require_worker(backend: CoreMLWorkerBackend, generation: int, what: str,
                    remedy: str) -> None:
    """StateLost unless the worker `generation` is the running one. Checked before the call:
    once a death has been noticed, the next call would start a fresh worker, which has never
    heard of the id (a KeyError there, reported as a Core ML failure)."""
    worker = backend.worker
    if not worker.runs(generation):
        raise StateLost(f"{what} lived in a Core ML worker that has died since "
                        f"({worker.health()['last_death'] or 'it was closed'}); {remedy}")


class WorkerState:
    """A state living in the worker: a handle, valid while the worker that made it lives."""

    def __init__(self, program: WorkerProgram, sid: int, generation: int):
        self.program, self.sid, self.generation = program, sid, generation


class WorkerProgram:
    def __init__(self, backend: CoreMLWorkerBackend, pid: int, package: Path,
                 digest: str | None, label: str, input_names: list[str],
                 output_names: list[str], state_names: list[str], function: str = "main",
                 state_shapes: dict[str, tuple[int, ...]] | None = None):
        self.backend, self.pid, self.package, self.digest = backend, pid, package, digest
        self.state_shapes = state_shapes or {}
        self.label, self.function = label, function
        self.input_names, self.output_names, self.state_names = (
            input_names, output_names, state_names)
        self._last_shapes: tuple | None = None

    def _state_id(self, state: Any) -> int | None:
        if state is None:
            return None
        if not isinstance(state, WorkerState) or state.program.backend is not self.backend:
            raise AneSpecError("a state from another model's Core ML worker")
        _require_worker(self.backend, state.generation, "this KV state", "make a new one")
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
        arrays = {k: input_array(v) for k, v in inputs.items()}
        self._last_shapes = count_shape_switch(self.backend.reshape_frequency,
                                               self._last_shapes, arrays)
        dropped, self.backend._dropped[:] = list(self.backend._dropped), []
        _, out = self.backend._call("predict", self.pid, sid, dropped, arrays=arrays,
                                    during=f"predict on {self.label}")
        return out

    def read_state(self, state: Any, name: str) -> np.ndarray:
        """A float32 copy of the whole state, through shared memory."""
        sid = self._state_id(state)
        _, out = self.backend._call("read_state", self.pid, sid, name,
                                    during=f"read_state {name} of {self.label}")
        return np.array(out["state"], order="C")  # ours: the slab is free for the next call

    def write_state(self, state: Any, name: str, value: np.ndarray) -> None:
        if name not in self.state_names:
            raise AneSpecError(f"no state '{name}' (have {', '.join(self.state_names)})")
        sid = self._state_id(state)
        self.backend._call("write_state", self.pid, sid, name,
                           arrays={"value": np.asarray(value)},
                           during=f"write_state {name} of {self.label}")

    def read_rows(self, state: Any, name: str, n: int, axis: int | None,
                  dtype: np.dtype) -> np.ndarray:
        """Rows 0..n-1 along `axis` of a state, sliced and cast to `dtype` in the worker and
        returned through shared memory (state_rows.read_rows)."""
        sid = self._state_id(state)
        _, out = self.backend._call("read_rows", self.pid, sid, name, int(n), axis,
                                    np.dtype(dtype).str,
                                    during=f"read_state {name} of {self.label}",
                                    reply_bytes=self._row_bytes(name, n, axis, dtype))
        return np.array(out["rows"], order="C")  # ours: the slab is free for the next call

    def write_rows(self, state: Any, name: str, rows: np.ndarray | None, n: int,
                   axis: int | None, shape: tuple[int, ...]) -> None:
        """State_rows.write_rows in the worker: only `rows` cross; the zeros are made there."""
        if name not in self.state_names:
            raise AneSpecError(f"no state '{name}' (have {', '.join(self.state_names)})")
        sid = self._state_id(state)
        self.backend._call("write_rows", self.pid, sid, name, int(n), axis, tuple(shape),
                           arrays=None if rows is None else {"rows": np.asarray(rows)},
                           during=f"write_state {name} of {self.label}")

    def _row_bytes(self, name: str, n: int, axis: int | None, dtype: np.dtype) -> int:
        shape = self.state_shapes.get(name)
        if shape is None:
            return 0
        if axis is not None:
            shape = tuple(n if i == axis else d for i, d in enumerate(shape))
        return math.prod(shape) * np.dtype(dtype).itemsize


class RemoteRows:
    """One head prediction kept in the worker (until this is collected): `read_row(r)` brings
    row r ([V], the head's dtype, the values Core ML returned) across through shared memory;
    `argmax(r)` brings only its argmax, computed there by `fp16_argmax.argmax` on the same row,
    so greedy decoding moves no logits across at all. Either raises NonFiniteLogits for a row
    that is not all finite."""

    def __init__(self, program: WorkerProgram, hid: int, generation: int,
                 known: list[int | None]):
        self.program, self.hid, self.generation = program, hid, generation
        self.known = dict(enumerate(known))  # argmax already computed (None: not finite)

    def _call(self, method: str, r: int, what: str) -> Any:
        backend = self.program.backend
        _require_worker(backend, self.generation, "this pass's logits", "run the pass again")
        return backend._call(method, self.hid, int(r),
                             during=f"reading {what} of row {r} of {self.program.label}")

    def read_row(self, r: int) -> np.ndarray:
        return self._call("head_row", r, "the logits")[1]["row"]

    def argmax(self, r: int) -> int:
        if r in self.known:
            best = self.known[r]
            if best is None:
                raise NonFiniteLogits()
            return best
        return self._call("head_argmax", r, "the argmax")


class CoreMLWorkerBackend:
    """Core ML in a worker process: the `Backend` the pipeline sees on macOS."""

    name = "coreml"
    precision = None  # Core ML picks the arithmetic per compute unit

    def __init__(self, compute_units: str = "CPU_AND_NE",
                 reshape_frequency: ReshapeFrequency = "Infrequent"):
        from ane_spec.runtime.coreml_backend import (
            check_compute_units, check_reshape_frequency, require_macos)

        self.compute_units = check_compute_units(compute_units)
        self.reshape_frequency = check_reshape_frequency(reshape_frequency)
        require_macos("the Core ML backend", "use --backend mil")
        self.programs: list[WorkerProgram] = []
        self._ids = 0
        self._id_lock = threading.Lock()
        self._dropped: list[int] = []
        self._dropped_heads: list[int] = []  # head predictions kept in the worker, now unread
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

    def load(self, package: Path, *, digest: str | None = None,
             function: str = "main") -> WorkerProgram:
        from ane_spec.package_spec import function_description, read_spec

        package = Path(package)
        if not package.is_dir():
            raise AneSpecError(f"{package}: not an .mlpackage folder")
        # The package's description is read from its spec, with no native work (coremltools'
        # MLModel with skip_model_load reads the protobuf only).
        desc = function_description(read_spec(package), function)
        where = f"{package.name} ({package})" if function == "main" else (
            f"{package.name} function {function} ({package})")
        program = WorkerProgram(self, self._next_id(), package, digest, where,
                                [i.name for i in desc.input], [o.name for o in desc.output],
                                [s.name for s in desc.state], function,
                                {s.name: tuple(int(d) for d in s.type.stateType.arrayType.shape)
                                 for s in desc.state})
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
        self._dropped_heads[:] = []
        for program in self.programs:
            self._load(program)
        self._loaded_generation = worker.generation

    def _load(self, program: WorkerProgram) -> None:
        self._call("load", program.pid, str(program.package), program.digest, program.function,
                   during=f"load of {program.label}")

    def _kept(self, head: WorkerProgram, hid: int, known: list[int | None]) -> RemoteRows:
        remote = RemoteRows(head, hid, self.worker.generation, known)
        weakref.finalize(remote, self._dropped_heads.append, hid)
        return remote

    def run_pass(self, shards: list[WorkerProgram], states: list[Any], hidden: np.ndarray,
                 inputs: dict[str, np.ndarray], heads: list[WorkerProgram], rows: HeadRows,
                 chain: list[int], *, head_row: tuple[int, int] | None = None
                 ) -> RemoteRows | None:
        """`hidden` through every shard (with `inputs`, and its state) and the head's packages,
        in one call to the worker: the hidden states between programs never cross, and neither
        do the logits (`RemoteRows`). The same predictions, in the same order, on the
        same values as one call per program. No heads (a prefill chunk before the prompt's
        last): the layers only, and None. `head_row` (row, width): the head reads that row
        of the shards' output, repeated (`repeat_row`)."""
        arrays = {k: input_array(v) for k, v in {"x": hidden, **inputs}.items()}
        calls = []
        for program, state in zip(shards, states):
            if program.state_names and state is None:
                raise AneSpecError("this program is stateful: pass a state from make_state()")
            calls.append((program.pid, program._state_id(state)))
            program._last_shapes = count_shape_switch(self.reshape_frequency,
                                                      program._last_shapes, arrays)
        # The head's input is the shards' output: a prefill chunk's one row, repeated, where
        # `head_row` says so (the shards' output has the input's shape).
        head_x = {"x": arrays["x"] if head_row is None or not heads
                  else repeat_row(arrays["x"], *head_row, rows.layout)}
        for head in heads:
            head._last_shapes = count_shape_switch(self.reshape_frequency, head._last_shapes,
                                                   head_x)
        hid = self._next_id()
        dropped, self._dropped[:] = list(self._dropped), []
        dropped_heads, self._dropped_heads[:] = list(self._dropped_heads), []
        labels = [p.label for p in [*shards, *heads]]
        try:
            known = self._call("run_pass", calls, dropped, [h.pid for h in heads], hid,
                               dropped_heads, rows,
                               list(chain), head_row, arrays=arrays,
                               during=f"predict on {', then '.join(labels)}")
        except _StepFailed as exc:  # as one call per program would have said it
            raise CoreMLFailure(f"Core ML failed during predict on {labels[exc.step]}: "
                                f"{exc.kind}: {exc.text}") from None
        return self._kept(heads[0], hid, known) if heads else None

    def _call(self, method: str, *args: Any, during: str,
              arrays: dict[str, np.ndarray] | None = None, reply_bytes: int = 0) -> Any:
        try:
            return self.worker.call(method, *args, during=during, arrays=arrays,
                                    reply_bytes=reply_bytes)
        except (WorkerDied, AneSpecError):
            raise
        except Exception as exc:  # noqa: BLE001 - Core ML's own errors (RuntimeError, ...)
            raise CoreMLFailure(f"Core ML failed during {during}: {type(exc).__name__}: "
                                f"{str(exc).strip()}") from exc

    def resident_bytes(self) -> int:
        """The worker's resident memory now, in bytes (the doctor's `state-reads` leak check
        watches it there, where Core ML's copies would pile up, not in the caller)."""
        return self._call("resident_bytes", during="reading the Core ML worker's resident memory")

    def health(self) -> dict[str, Any]:
        return self.worker.health() | {"programs": len(self.programs)}

    def close(self) -> None:
        self.worker.close()

    def describe(self) -> str:
        return f"Core ML ({self.compute_units}, reshapeFrequency {self.reshape_frequency})"
