"""`serve(config)`: load the build, then run the app on uvicorn until interrupted.

Loading (manifest hashes, programs) happens before the port opens, so a bad build fails at
startup with a readable error; warm-up happens after, in the background, while /health reports
its progress. `BackgroundServer` runs the same thing in a thread (tests, the load test).

Slow clients cannot hold connections open: an idle keep-alive connection is closed after
KEEP_ALIVE_SECONDS (uvicorn's own timer), and a request's line and headers must arrive within
HEADER_TIMEOUT_SECONDS of the connection opening or of the previous response, which uvicorn has
no setting for (a client dribbling one header byte at a time would otherwise keep its
connection, and its slot, forever).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.engine import Engine, load_engine

log = logging.getLogger("ane_spec.daemon")

GRACEFUL_SHUTDOWN_SECONDS = 5
KEEP_ALIVE_SECONDS = 5
HEADER_TIMEOUT_SECONDS = 10


def _header_timeout_protocol() -> type:
    """uvicorn's h11 protocol with a deadline on each request's headers (see module doc)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # noqa: ANN001
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a whole request line and its headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            cycle = self.cycle
            super().on_response_complete()
            # Unless a pipelined request already started the next cycle, wait for one.
            if self.cycle is cycle and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(HEADER_TIMEOUT_SECONDS, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeaderTimeoutH11


def uvicorn_config(app, config: ServeConfig, *, log_config: dict | None = None):  # noqa: ANN001
    """The uvicorn settings every ane-spec server runs with, for any ASGI `app`."""
    import uvicorn

    kwargs = {} if log_config is None else {"log_config": log_config}
    return uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level,
        access_log=config.access_log, lifespan="on", http=_header_timeout_protocol(),
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS, **kwargs)


def _uvicorn_server(config: ServeConfig, engine: Engine, *, log_config: dict | None = None):
    try:
        import uvicorn
    except ImportError:
        from ane_spec.errors import AneSpecError

        raise AneSpecError("serving needs fastapi and uvicorn: pip install 'ane-spec[serve]'") \
            from None
    from ane_spec.daemon.app import create_app

    return uvicorn.Server(uvicorn_config(create_app(config, engine), config,
                                         log_config=log_config))


def serve(config: ServeConfig) -> int:
    """Run the daemon in the foreground until SIGINT/SIGTERM. Raises AneSpecError (readable,
    before binding) when the build cannot be loaded; returns 0 after a clean shutdown and 1 when
    the port could not be bound."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("ane_spec").setLevel(config.log_level.upper())
    if config.public:
        log.warning("serving on %s: reachable beyond this machine; every request needs the API "
                    "key", config.host)
    engine = load_engine(config)
    server = _uvicorn_server(config, engine)
    server.run()
    return 0 if server.started else 1


class BackgroundServer:
    """The daemon on a thread of this process, on `config.port` (0: a free port). Use as a
    context manager; `url` is e.g. http://127.0.0.1:53211. `engine`: one already made from
    `config` (default: `load_engine(config)`)."""

    def __init__(self, config: ServeConfig, *, quiet: bool = True, engine: Engine | None = None):
        self.config = config
        self.quiet = quiet
        self.engine: Engine | None = engine
        self.server = None
        self.thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        host = self.config.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        if self.engine is None:
            self.engine = load_engine(self.config)
        log_config = {"version": 1, "disable_existing_loggers": False} if self.quiet else None
        self.server = _uvicorn_server(self.config, self.engine, log_config=log_config)
        self.thread = threading.Thread(target=self.server.run, name="ane-spec-uvicorn",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during startup (port in use?)")
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in time")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.server is not None and self.thread is not None:
            self.server.should_exit = True
            self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
