"""The draft model in its own process, so its passes run beside the target's.

`DraftProcess` is a `ModelDrafter` whose model runs in a worker process (ane_spec.worker_process:
spawn, pipe, shared memory, death noticed). With the MIL interpreter that is the only way the two
models compute at once: in one process they would take turns on the GIL. The parent keeps
nothing of the model: calls carry the committed tokens appended since the last call, the child
holds the history, the states and the pipeline.

Two calls run in the background (a thread waits on the pipe, which releases the GIL, while the
caller goes on with the target): `reset` (the draft prefills the prompt while the target
prefills it) and `predraft_async` (the draft looks past a block while the target verifies it).
Every other call first waits for the one in flight.

A draft that fails (its process dies, an error in it) never fails the request: the drafter
falls silent (no model drafts) until the next request, which starts a fresh process; output is
unaffected, since drafts never decide a token. `health()` reports it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from ane_spec.decode.model_drafter import ModelDrafter, PipelineDraftModel, Proposal
from ane_spec.decode.sampling import SamplingParams
from ane_spec.worker_process import Channel, Outputs, WorkerProcess

log = logging.getLogger("ane_spec.draft")


class DraftSpec(BaseModel):
    """Everything the child needs to open the draft model (sent to it once, pickled)."""

    model_config = ConfigDict(frozen=True)

    manifest: Path
    backend: str = "mil"
    precision: str = "fp32"
    compute_units: str = "CPU_AND_NE"
    decode_shape: str = "mixed"
    prefill: str = "auto"
    verify: bool = True
    states: int = 1
    limit_vocab: int | None = None
    blas_threads: int | None = 1  # the child's BLAS/OpenMP threads (None: the library's own)


def open_draft_pipeline(spec: DraftSpec):  # noqa: ANN201
    """The draft model's pipeline, as the spec says (in whichever process calls it)."""
    from ane_spec.manifests.store import load_manifest
    from ane_spec.runtime.backend import make_backend
    from ane_spec.runtime.pipeline import ShardPipeline

    loaded = load_manifest(spec.manifest, verify=spec.verify)
    backend = make_backend(spec.backend, precision=spec.precision,  # type: ignore[arg-type]
                           compute_units=spec.compute_units,
                           decode_shape=spec.decode_shape)  # type: ignore[arg-type]
    return ShardPipeline(loaded, backend, spec.decode_shape,  # type: ignore[arg-type]
                         prefill_mode=spec.prefill)  # type: ignore[arg-type]


class _DraftHandler:
    """The child's side: a ModelDrafter over the draft pipeline."""

    def __init__(self, channel: Channel, spec: DraftSpec):
        self.pipeline = open_draft_pipeline(spec)
        self.model = PipelineDraftModel(self.pipeline)
        self.drafter = ModelDrafter(self.model, states=spec.states, limit_vocab=spec.limit_vocab)

    def reset(self, prompt: list[int], sampling: dict | None, seed: int | None) -> int:
        params = None if sampling is None else SamplingParams(**sampling)
        self.drafter.reset(prompt, params, seed)
        return self.drafter.prefill()

    def propose(self, appended: list[int], k: int, p_min: float) -> Any:
        self.drafter.append(appended)
        prop = self.drafter.propose(k, p_min=p_min)
        value = (prop.tokens, prop.passes, prop.seconds)
        if prop.q is None or not prop.tokens:
            return value
        return Outputs(value, {"q": np.stack(prop.q)})

    def predraft(self, appended: list[int], block: list[int], passes: int) -> int:
        self.drafter.append(appended)
        return self.drafter.predraft(block, passes)

    def finish(self, appended: list[int]) -> None:
        self.drafter.append(appended)
        self.drafter.finish()

    def measure(self, reps: int) -> float:
        """Median seconds of a T=1 pass on a scratch state (after one warm-up)."""
        state = self.pipeline.new_state()
        times = []
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            self.pipeline.run([0], rep, state)
            if rep:
                times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    def info(self) -> dict[str, Any]:
        p = self.pipeline
        return {"vocab_size": p.config.vocab_size, "max_seq": p.max_seq,
                "backend": p.backend.describe(), "decode_shape": p.decode_shape,
                "prefill_t": p.prefill_t}


def _handler(spec: DraftSpec, channel: Channel) -> _DraftHandler:
    return _DraftHandler(channel, spec)


_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


class _DraftWorker(WorkerProcess):
    """A worker whose BLAS/OpenMP thread count is set at every (re)start: the libraries read it
    from the environment once, when the child imports them."""

    def __init__(self, spec: DraftSpec):
        super().__init__("draft model", partial(_handler, spec))
        self.threads = spec.blas_threads

    def start(self) -> None:
        if self.threads is None or self.alive:
            return super().start()
        saved = {v: os.environ.get(v) for v in _THREAD_VARS}
        os.environ.update({v: str(self.threads) for v in _THREAD_VARS})
        try:
            super().start()
        finally:
            for v, value in saved.items():
                if value is None:
                    os.environ.pop(v, None)
                else:
                    os.environ[v] = value


class DraftProcess:
    """A ModelDrafter in a worker process (module docstring); the same calls as ModelDrafter,
    plus `predraft_async`, `measure_pass`, `start`, `close` and `health`."""

    def __init__(self, spec: DraftSpec):
        self.spec = spec
        self.worker = _DraftWorker(spec)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ane-spec-draft")
        self._inflight: Future | None = None
        self._appended: list[int] = []
        self.silent = False
        self.failures = 0
        self.last_failure: str | None = None
        self._info: dict[str, Any] | None = None

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> dict[str, Any]:
        """Start the process and load the draft model (at the server's warm-up)."""
        self.worker.start()
        self._info = self.worker.call("info")
        return self._info

    @property
    def info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self.worker.call("info")
        return self._info

    def close(self) -> None:
        self._wait()
        self._executor.shutdown(wait=True)
        self.worker.close()

    def health(self) -> dict[str, Any]:
        return self.worker.health() | {"failures": self.failures,
                                       "last_failure": self.last_failure,
                                       "silent": self.silent}

    def measure_pass(self, reps: int = 3) -> float:
        self._wait()
        return float(self.worker.call("measure", reps))

    # --- the drafter ----------------------------------------------------------------------------

    def _wait(self) -> None:
        """Let the call in flight finish (its failure silences the drafter)."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        try:
            inflight.result()
        except Exception as exc:  # noqa: BLE001 - drafts are optional: see the module docstring
            self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        self.silent = True
        self.failures += 1
        self.last_failure = f"{type(exc).__name__}: {exc}"
        log.warning("the draft model failed (%s); no model drafts until the next request",
                    self.last_failure)

    def _take(self) -> list[int]:
        out, self._appended = self._appended, []
        return out

    def _background(self, method: str, *args: Any) -> None:
        self._wait()
        if self.silent:
            return
        self._inflight = self._executor.submit(self.worker.call, method, *args)

    def reset(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None,
              seed: int | None = None) -> None:
        self._wait()
        self.silent = False
        self._appended = []
        params = None if sampling is None else sampling.model_dump()
        self._background("reset", [int(t) for t in prompt_tokens], params, seed)

    def append(self, tokens: Sequence[int]) -> None:
        self._appended.extend(int(t) for t in tokens)

    def finish(self, *args: Any, **kwargs: Any) -> None:
        self._wait()
        if self.silent:
            return
        try:
            self.worker.call("finish", self._take())
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)

    def draft(self, k: int, *, fill: bool = False) -> list[int]:
        return self.propose(k).tokens

    def propose(self, k: int, *, p_min: float = 0.0) -> Proposal:
        t0 = time.perf_counter()
        self._wait()
        if self.silent:
            return Proposal([], "model")
        try:
            reply = self.worker.call("propose", self._take(), k, p_min)
        except Exception as exc:  # noqa: BLE001
            self._failed(exc)
            return Proposal([], "model", seconds=time.perf_counter() - t0)
        q = None
        if isinstance(reply, tuple) and len(reply) == 2 and isinstance(reply[1], dict):
            (tokens, passes, _), arrays = reply
            q = [np.array(row) for row in arrays["q"]]
        else:
            tokens, passes, _ = reply
        return Proposal(list(tokens), "model", q, passes, time.perf_counter() - t0)

    def predraft_async(self, block: Sequence[int], passes: int) -> None:
        self._background("predraft", self._take(), [int(t) for t in block], passes)

    def prefill(self) -> int:
        return 0  # `reset` prefills in the child
