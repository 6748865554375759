"""The residual scale decided beside the conversion: calibration on a second core.

A Phi-4-mini build spent 35 s calibrating (the fp32 reference over every layer, residual_scale.py)
before it converted its first weight, although the conversion of a shard's weights does not
depend on the decision: the factor 2^k is folded into the converted weights afterwards
(`fold_into_layer` scales their fp16 part). So the build starts the calibration in a helper
thread, converts the first shard's weights meanwhile (and, with no previous build to reuse
from, hashes the file), and waits for k only where it needs it: before folding, before a
shard's program, and before a package of the previous build could be reused (fingerprints
include k).

A thread, not a process: the reference's work is torch matmuls and numpy dequantization, which
release the GIL, as does the conversion's numpy (one build measured the calibration thread and
the conversion together at the CPU seconds of the two apart); a thread needs no interpreter
started (importing torch alone takes longer than a small model's whole calibration), no second
copy of the tokenizer, and it cannot outlive the build or be killed apart from it, so a killed
build has no calibration process to leave behind and a failed one no child to end. Its memory
counts in the build's own peak RSS.

Threads: while the building thread converts, torch computes the calibration on one thread. An
OpenMP team of two sharing a core with the conversion spends its time at barriers waiting for
the member that is not running (on this 2-core machine under load, a 2-thread calibration of
Qwen2.5-Coder-0.5B took 43.6 CPU seconds, a 1-thread one 11.1), and the calibration holds its
core (`weights.core_taken`), so the conversion's requantization runs on the others. Once the
building thread waits for k, the calibration takes the thread count torch had (`checkpoint`,
between layers).

The decision is the serial one: the same function (`residual_scale.calibrate`) on the same
inputs. MKL gives each row of a matmul the same bits on one thread or two (checked on every
matmul shape of Phi-4-mini and Qwen2.5-Coder-0.5B, and by tests/test_scale_aside.py, which
compares an aside build with a 2-thread serial one: same calibration record, same packages).
A BLAS that split a dot product across threads could move a maximum by an ulp; k changes only
if the peak sits that close to a power of two times 65,504 / 8.

Messages from the calibration are queued and said by the building thread between its own steps,
so the build's progress callback is only ever called from the thread that called `build`.
A failure in the calibration (a BuildError: corrupt weights, a reference that is not finite) is
raised in the building thread when it asks for the decision; a build that fails or is
interrupted first stops the calibration at its next checkpoint, and waits for its thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait

from ane_spec.manifests.schema import ResidualScale
from ane_spec.model.activation_range import ActivationRanges, CalibrationStopped
from ane_spec.model.gguf_file import GGUFModel
from ane_spec.shards.residual_scale import calibrate, parse_residual_scale, record
from ane_spec.shards.weights import core_taken

Progress = Callable[[str], None]

# Below this many parameters the calibration runs before the conversion, as it always did: it
# takes a second or less there (SmolLM2-135M, the synthetic test models), and the serial order
# keeps small builds' progress simple. Qwen2.5-Coder-0.5B's takes ~6 s on one thread (measured
# on every token), a synthetic Phi-4-mini's ~12 (stopped after 40 tokens; 25 on all 224).
ASIDE_MIN_PARAMETERS = 200_000_000


class PendingScale:
    """The residual scale of a build, being decided. `result()` waits for it."""

    def __init__(self, model: GGUFModel, setting: str, say: Progress, *, aside: bool):
        self._model = model
        self._setting = parse_residual_scale(setting)
        self._say = say
        self._messages: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._waiting = threading.Event()   # the building thread has nothing else to do
        self._future: Future[ActivationRanges | None] = Future()
        self._decided: ResidualScale | None = None
        self.waited = 0.0   # seconds the building thread spent waiting for the decision
        self.aside = aside and self._setting != "off"
        if self.aside:
            say("calibrating activations beside the conversion (second core)")
            self._thread: threading.Thread | None = threading.Thread(
                target=self._calibrate, name="calibrate-activations", daemon=True)
            self._thread.start()
        else:
            self._thread = None

    @property
    def known(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._decided is not None or not self.aside or self._future.done()

    def relay(self) -> None:
        """Say the calibration's queued progress messages (in the caller's thread)."""
        while True:
            try:
                self._say(self._messages.get_nowait())
            except queue.Empty:
                return

    def result(self) -> ResidualScale:
        """The decision: waits for the calibration (saying its progress meanwhile), or runs it
        here if it was not started aside. Raises what the calibration raised."""
        if self._decided is None:
            if self.aside:
                started = time.monotonic()
                self._waiting.set()
                while not self._future.done():
                    self.relay()
                    wait([self._future], timeout=0.2)
                self.relay()
                self.waited += time.monotonic() - started
                ranges = self._future.result()
            else:
                ranges = calibrate(self._model, self._setting, self._say)
            self._decided = record(self._model, self._setting, ranges)
        return self._decided

    def close(self) -> None:
        """Stop a calibration still running (the build ended without it) and wait for its
        thread, which ends at its next layer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __enter__(self) -> PendingScale:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _calibrate(self) -> None:
        import torch

        # torch's thread count is per thread once set (OpenMP's nthreads ICV), and a new
        # thread starts from the count last set in the process: what this one restores.
        full = torch.get_num_threads()
        torch.set_num_threads(1)

        def checkpoint() -> None:
            if self._stop.is_set():
                raise CalibrationStopped()
            if self._waiting.is_set() and torch.get_num_threads() != full:
                torch.set_num_threads(full)   # the building thread's core is free now

        try:
            with core_taken():
                ranges = calibrate(self._model, self._setting, self._messages.put, checkpoint)
        except BaseException as exc:  # noqa: BLE001 - raised in the building thread
            self._future.set_exception(exc)
        else:
            self._future.set_result(ranges)
        finally:
            torch.set_num_threads(full)


def start(model: GGUFModel, setting: str, say: Progress, aside: bool | None = None
          ) -> PendingScale:
    """The build's residual scale, decided beside the conversion where that pays (`aside`
    None: models of ASIDE_MIN_PARAMETERS or more), else when first asked for."""
    if aside is None:
        aside = model.parameter_count >= ASIDE_MIN_PARAMETERS
    return PendingScale(model, setting, say, aside=aside)
