"""The HTTP app: every route, middleware and error handler of the daemon, put together.

Each part lives in its own module, by what it is: `middleware` (Host check, API key, body
guard, CORS), `http_errors` (OpenAI's error shape and the handlers), `prepare` (a request turned
into the engine's work item), `finish` (how a generation ends, streamed or not), the routes
(`openai_api`; `service_api` for /health, /metrics, /props, /tokenize, /slots) and the protocol
adapters over `generate` (`llama_server_api`, `ollama_api`, `responses_api`).

Every handler is async and cheap: tokenization runs in a thread, generation in the engine's
worker, so the event loop always answers /health and /metrics. Every failure a request can
cause maps to a 4xx with OpenAI's error shape; a 500 means a bug, and even then only that
request fails.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI

from ane_spec import __version__
from ane_spec.daemon import (
    llama_server_api, ollama_api, openai_api, responses_api, service_api,
)
from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.engine import Engine
from ane_spec.daemon.http_errors import install_error_handlers
from ane_spec.daemon.middleware import install_middleware
from ane_spec.daemon.prepare import PREPARE_THREADS


def create_app(config: ServeConfig, engine: Engine) -> FastAPI:
    # /tokenize and /detokenize (a megabyte of text, a million pieces to render) run on threads,
    # at most HEAVY_THREADS at once: Python threads share one GIL, so more of them would only
    # slow the event loop's turn at it (and with it /health) without finishing sooner. Request
    # preparation has its own limiter (prepare.PREPARE_THREADS), so that a /tokenize flood does
    # not hold generation requests; it never waits on the grammar compiler while holding one.
    heavy: dict[str, anyio.CapacityLimiter] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heavy["limiter"] = anyio.CapacityLimiter(service_api.HEAVY_THREADS)
        app.state.prepare_limiter = anyio.CapacityLimiter(PREPARE_THREADS)
        engine.grammars.queue.configure(config.grammar_queue, config.grammar_wait)
        engine.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(engine.stop)

    app = FastAPI(title="ane-spec", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None,
                  description="OpenAI-compatible server for a speculative-decoding Phi-4-mini "
                              "build. Extensions: the `ane_spec` request and response field.")
    app.state.engine = engine
    install_middleware(app, config, engine)
    install_error_handlers(app, engine.metrics)

    generate = openai_api.make_generate(config, engine)
    app.include_router(service_api.router(config, engine, heavy))
    app.include_router(openai_api.router(engine, generate))
    # The other protocols: thin adapters over `generate` (see relay.py).
    app.include_router(llama_server_api.router(engine, generate))
    app.include_router(ollama_api.router(engine, generate))
    app.include_router(responses_api.router(engine, generate))
    return app
