"""OpenAI's /v1 routes: chat completions, completions and the model list. `generate` is the one
path every generation request takes, whatever protocol it came in by: the other adapters
(llama-server's, Ollama's, Responses) call it with the request they built (see relay.py).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.draft_scopes import scope_of
from ane_spec.daemon.engine import Engine, NotReady, QueueFull
from ane_spec.daemon.finish import SSE_HEADERS, collect, stream
from ane_spec.daemon.http_errors import BadRequest, error_response, error_type
from ane_spec.daemon.prepare import Unavailable, prepare_request
from ane_spec.daemon.protocol import ChatCompletionRequest, CompletionRequest, Envelope
from ane_spec.daemon.relay import Generate


def make_generate(config: ServeConfig, engine: Engine) -> Generate:
    metrics = engine.metrics

    async def generate(request: Request, body: ChatCompletionRequest | CompletionRequest,
                       kind: str) -> Response:
        try:
            if engine.status != "ready":
                raise engine.not_ready()
            scope = scope_of(config.draft_memory_mode, request.headers.get("authorization"),
                             body.user)
            plan = await prepare_request(request, engine, body, kind, scope)
            job = engine.submit(plan.item, asyncio.get_running_loop())
        except BadRequest as exc:
            metrics.request(kind, "rejected_invalid")
            return error_response(400, exc.message, param=exc.param, code=exc.code)
        except Unavailable as exc:
            metrics.request(kind, "cancelled" if exc.status == 499 else "rejected_queue_full")
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return error_response(exc.status, exc.message, "rate_limit_error" if exc.status == 429
                                  else error_type(exc.status), code=exc.code, headers=headers)
        except NotReady as exc:
            metrics.request(kind, "rejected_warming")
            headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
            return error_response(503, str(exc), "server_error",
                                  code="warming_up" if exc.retry_after else "unavailable",
                                  headers=headers)
        except QueueFull as exc:
            metrics.request(kind, "rejected_queue_full")
            return error_response(429, str(exc), "rate_limit_error", code="queue_full",
                                  headers={"Retry-After": "1"})
        envelope = Envelope(kind, engine.model_id)
        if body.stream:
            return StreamingResponse(stream(engine, job, plan, envelope, body.include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await collect(engine, request, job, plan, envelope)

    return generate


def router(engine: Engine, generate: Generate) -> APIRouter:
    api = APIRouter()

    def model_card() -> dict[str, Any]:
        m = engine.pipeline.manifest
        return {"id": engine.model_id, "object": "model", "created": _created(m.created),
                "owned_by": "ane-spec", "context_window": engine.context}

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != engine.model_id:
            return error_response(404, f"the model '{model_id}' does not exist; this server "
                                       f"serves '{engine.model_id}'", param="model",
                                  code="model_not_found")
        return JSONResponse(model_card())

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body, "chat")

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body, "completions")

    return api


def _created(stamp: str) -> int:
    from datetime import datetime

    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0
