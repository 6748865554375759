"""A real daemon on loopback for the client suites: started, and waited on until /health says
it is ready."""

from __future__ import annotations

import time

import httpx

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.server import BackgroundServer


def started(config: ServeConfig) -> BackgroundServer:
    srv = BackgroundServer(config).start()
    deadline = time.monotonic() + 60
    while httpx.get(f"{srv.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the server did not become ready"
        time.sleep(0.02)
    return srv
