"""The doctor's Core ML checks, run in a worker process that a native crash cannot take down with
the report.

A libc++ abort or a segfault inside Core ML kills the process it happens in; Python cannot catch
it. So the doctor runs its Core ML checks (compute plans, device lists, and the pipelines whose
own Core ML worker it starts) in one worker process, through the package's one mechanism for
native code (`ane_spec.worker_process`: spawn, never fork; a death noticed and reported; a fresh
worker on the next call), one check per call, in the doctor's order. If the worker dies during
a check, that check reads `crashed: signal N during <check>` and the next Core ML check starts a
fresh worker. A Core ML worker that dies under a check's pipeline reads the same way. One worker
for all checks, rather than one per check, because loading a Phi-size build and specialising it
costs minutes, and the checks after `cold-jit` rely on the build being loaded and warm, as it is
in `serve`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ane_spec.worker_process import Channel, WorkerDied, WorkerProcess


@dataclass(frozen=True)
class WorkerSpec:
    """What the worker needs to rebuild the doctor's run: plain values, pickled to the child."""

    manifest: str | None
    decode_shape: str
    gguf: str | None
    work: str
    strict: bool = False  # --strict: the residency check wants every op on the ANE
    draft: str | None = None  # --draft-model's build folder
    draft_units: str | None = None


class _Checks:
    """Child side: the doctor's run, rebuilt once per worker; `run(i)` runs check i."""

    def __init__(self, channel: Channel, spec: WorkerSpec, checks: list):
        from ane_spec.manifests.store import load_manifest
        from ane_spec.probes.doctor import DoctorRun

        # The parent verified the build's hashes once; the child only reads it.
        build = None if spec.manifest is None else load_manifest(spec.manifest, verify=False)
        self.checks = checks
        self.run_state = DoctorRun(build, Path(spec.work), spec.decode_shape, spec.gguf,
                                   channel.progress, strict=spec.strict, draft=spec.draft,
                                   draft_units=spec.draft_units)

    def run(self, index: int) -> dict[str, Any]:
        from ane_spec.probes.doctor import run_one

        return vars(run_one(self.checks[index][1], self.run_state))


def _make(spec: WorkerSpec, checks: list, channel: Channel) -> _Checks:
    return _Checks(channel, spec, checks)


def crashed(name: str, exc: WorkerDied) -> dict[str, Any]:
    """The verdict fields of a check during which a worker process died."""
    how = f"signal {exc.details['signal']}" if "signal" in exc.details else exc.how
    return {"status": "failed", "summary": f"crashed: {how} during {name}",
            "details": dict(exc.details) | {"worker": exc.worker, "during": exc.during}}


class CheckWorker:
    """Parent side: runs checks by index in a worker process, restarting it after a crash."""

    def __init__(self, spec: WorkerSpec, checks: list, progress) -> None:  # noqa: ANN001
        self.checks = checks
        self.worker = WorkerProcess("doctor worker", functools.partial(_make, spec, checks),
                                    progress=progress)

    def run(self, index: int) -> dict[str, Any]:
        """The verdict fields of check `index`, or a failed verdict naming how the child died."""
        name = self.checks[index][0]
        try:
            return self.worker.call("run", index, during=name)
        except WorkerDied as exc:
            return crashed(name, exc)

    def close(self) -> None:
        self.worker.close()
