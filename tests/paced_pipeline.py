"""A test-side wrapper that makes a real pipeline slow or holds its warm-up, for daemon tests of
queueing, client disconnects and the warming window. Installed from the test through
`BackgroundServer(config, engine=Engine(config, PacedPipeline(...)))`: production code has no
knob for it."""

from __future__ import annotations

import threading
from typing import Any

from ane_spec.runtime.pipeline import ShardPipeline


class PacedPipeline:
    """`pipeline`, waiting `pass_delay` seconds before every decoding pass, and with `warm_gate`
    holding the first warm-up step (every shard run) until the test sets it."""

    def __init__(self, pipeline: ShardPipeline, *, pass_delay: float = 0.0,
                 warm_gate: threading.Event | None = None):
        self._pipeline, self._delay, self._gate = pipeline, pass_delay, warm_gate
        self._pause = threading.Event()  # never set: wait() is an interruptible sleep

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipeline, name)

    def run(self, *args: Any, **kw: Any):  # noqa: ANN201 - ShardPipeline.run's
        if self._delay:
            self._pause.wait(self._delay)
        return self._pipeline.run(*args, **kw)

    def run_shards(self, *args: Any, **kw: Any):  # noqa: ANN201 - ShardPipeline.run_shards'
        if self._gate is not None:
            self._gate.wait()
        return self._pipeline.run_shards(*args, **kw)
