"""The residual scale decided beside the build: the calibration in its own process, and the
shards made meanwhile at the k the build can assume.

A Phi-4-mini build spent 35 s calibrating (the fp32 reference over every layer) before it
converted its first weight. Then a helper thread calibrated while the first shard converted,
and the build waited for it before that shard's package (2-4 s on this machine): a thread could
not share the stretches where the build makes packages (calibration_process.py says why).

Now a child process calibrates (calibration_process.py), from the start of the build to its
decision, holding one core (`weights.core_taken`: the conversion's requantization runs on the
others meanwhile). The build does not wait for it either: it folds its shards at the k it can
assume (scale_decision.assumed_log2: 2^0 under `auto` for every architecture but those whose
streams are expected past fp16, or `2^K`'s own K), writes the embeddings at it, and asks for
the decision where it must: before reusing a package of a previous build (fingerprints hold k),
before the LM head, and before the manifest. A decision that differs from the assumption makes
the shards and the embeddings made at it again (build.py says so in its progress), so a model
that needs the fold is built as the serial order builds it either way. With no assumption to
make (Gemma under `auto`) the build waits for the decision before its first package.

The decision is the serial one: the same function (`scale_decision.calibrate`) on the same
inputs. MKL gives each row of a matmul the same bits on one thread or two (checked on every
matmul shape of Phi-4-mini and Qwen2.5-Coder-0.5B, and by tests/test_scale_aside.py, which
compares a build calibrated in the child with a 2-thread serial one: same calibration record,
same packages). A BLAS that split a dot product across threads could move a maximum by an ulp;
k changes only if the peak sits that close to a power of two times 65,504 / 8.

The child's progress lines are said by the building thread between its own steps, so the
build's progress callback is only ever called from the thread that called `build`. A failure
of the calibration itself (a corrupt tensor, a reference that is not finite) fails the build
with its line when the decision is asked for; a child that crashed or was killed is replaced by
the calibration in the build's own process. A build that fails or is interrupted kills the
child; one that is killed closes the child's pipe, and the child stops at its next checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from ane_spec.errors import BuildError
from ane_spec.manifests.schema import ResidualScale
from ane_spec.model.activation_range import ActivationRanges
from ane_spec.model.gguf_file import GGUFModel
from ane_spec.shards.calibration_process import CalibrationChild, CalibrationFailed
from ane_spec.shards.residual_scale import record
from ane_spec.shards.scale_decision import assumed_log2, calibrate, parse_residual_scale
from ane_spec.shards.weights import core_taken

Progress = Callable[[str], None]

# Below this many parameters the calibration runs before the conversion, in the build's
# process: it takes a second or less there (SmolLM2-135M, the synthetic test models), and the
# serial order keeps small builds' progress simple. Qwen2.5-Coder-0.5B's takes ~6 s on one
# thread (measured on every token), a synthetic Phi-4-mini's ~6 (stopped after 40 tokens).
ASIDE_MIN_PARAMETERS = 200_000_000
# How often the building thread says the child's progress while it waits for the decision.
RELAY_SECONDS = 0.1
# A child whose CPU time has not moved for this long while the build waits is stuck, not slow:
# it never sleeps or waits on anything but a pipe the build drains. The one way known to get
# there is a fork taken while another thread of the caller held a native lock (the build forks
# before starting threads of its own): the child is killed and the build calibrates itself.
STALLED_SECONDS = 30.0


class PendingScale:
    """The residual scale of a build, being decided. `result()` waits for it."""

    def __init__(self, model: GGUFModel, setting: str, say: Progress,
                 child: CalibrationChild | None):
        self._model = model
        self._setting = parse_residual_scale(setting)
        self._say = say
        self._decided: ResidualScale | None = None
        self.waited = 0.0   # seconds the building thread spent waiting for the decision
        self._child = child
        self.aside = child is not None
        # The k shards are folded at before the decision (None: wait for it).
        self.assumed = (assumed_log2(self._setting, model.config.arch) if self.aside
                        else None)
        if self.aside:
            say("calibrating activations in a child process, beside the build"
                + (f" (shards folded at 2^{self.assumed} until it decides)"
                   if self.assumed is not None else ""))

    @property
    def known(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._decided is not None or self._child is None or self._child.done()

    def relay(self) -> None:
        """Say the child's queued progress messages (in the caller's thread)."""
        if self._child is not None:
            for message in self._child.messages():
                self._say(message)

    @contextlib.contextmanager
    def converting(self) -> Iterator[None]:
        """Around the build's weight conversion: while the child calibrates, it holds a core
        and the requantization runs on the others."""
        if self._child is None or self.known:
            yield
            return
        with core_taken():
            yield

    def result(self) -> ResidualScale:
        """The decision: waits for the child (saying its progress meanwhile), or calibrates
        here. Raises the calibration's BuildError."""
        if self._decided is None:
            ranges = self._from_child() if self.aside else calibrate(
                self._model, self._setting, self._say)
            self._decided = record(self._model, self._setting, ranges)
        return self._decided

    def _from_child(self) -> ActivationRanges | None:
        child = self._child
        assert child is not None
        started = last_change = time.monotonic()
        last_cpu = child.cpu_seconds()
        while not child.done():
            self.relay()
            time.sleep(RELAY_SECONDS)
            cpu, now = child.cpu_seconds(), time.monotonic()
            if cpu is None or cpu != last_cpu:
                last_cpu, last_change = cpu, now
            elif now - last_change > STALLED_SECONDS:
                child.abandon(f"it made no progress for {STALLED_SECONDS:g} s")
                break
        self.relay()
        self.waited += time.monotonic() - started
        try:
            ranges = child.result()
        except CalibrationFailed as exc:
            raise BuildError(str(exc)) from None
        finally:
            self.relay()
        if ranges is None:
            self._say(f"calibrating activations here (the calibration process is unusable: "
                      f"{child.why_not})")
            ranges = calibrate(self._model, self._setting, self._say)
        return ranges

    def close(self) -> None:
        """Kill a child still running (the build ended without its decision)."""
        if self._child is not None:
            self._child.close()

    def __enter__(self) -> PendingScale:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start(model: GGUFModel, setting: str, say: Progress, aside: bool | None = None
          ) -> PendingScale:
    """The build's residual scale, decided by a child process where that pays (`aside` None:
    models of ASIDE_MIN_PARAMETERS or more), else in this process when first asked for."""
    child = None
    if parse_residual_scale(setting) != "off":
        if aside is None:
            aside = model.parameter_count >= ASIDE_MIN_PARAMETERS
        if aside:
            child = CalibrationChild(model, setting)
    return PendingScale(model, setting, say, child)
