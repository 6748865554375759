"""The daemon's error responses, in OpenAI's error shape (Ollama's under /api/): the helpers
every route uses, and the handlers that turn FastAPI's and Starlette's own failures
(validation, 404/405, an unhandled exception) into that shape. A 500 means a bug, and even then only that request fails.
"""

from __future__ import annotations

import logging
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from ane_spec.daemon.metrics import Metrics
from ane_spec.daemon.protocol import (
    ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest, FunctionSpec,
    ResponseFormat, SpeculationOptions, StreamOptions, TextPart, TokenizeRequest, Tool,
    error_body,
)

log = logging.getLogger("ane_spec.daemon")

ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def is_ollama(path: str) -> bool:
    """Ollama's routes, whose clients read errors as Ollama writes them."""
    return path == "/api" or path.startswith("/api/")


def error_for(path: str, status: int, message: str, type_: str = "invalid_request_error",
              param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
    """An error in the shape of the protocol `path` belongs to: Ollama's `{"error": "..."}`
    under /api/ (what its clients, the ollama library, litellm and LangChain, read), OpenAI's
    everywhere else."""
    if is_ollama(path):
        return JSONResponse({"error": message}, status_code=status, headers=headers)
    return error_response(status, message, type_, param, code, headers)


def endpoint_of(path: str) -> str:
    return ENDPOINTS.get(path, "other")


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


_FIELDS = frozenset().union(*(m.model_fields for m in (
    ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, SpeculationOptions,
    StreamOptions, Tool, FunctionSpec, ResponseFormat, TokenizeRequest, DetokenizeRequest)))


def _param_path(error: dict) -> list[str]:
    """A validation error's location as the request's field path: ["messages", "0", "role"],
    without pydantic's union-branch tags ("str", "list[TextPart]", ...)."""
    loc = [p for p in error.get("loc", ()) if p != "body"]
    if error.get("type") == "extra_forbidden":
        return [str(p) for p in loc]
    path = []
    for p in loc:
        if not (isinstance(p, int) or p in _FIELDS):
            break
        path.append(str(p))
    return path


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.request(endpoint_of(request.url.path), "rejected_invalid")
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        loc = _param_path(first)
        msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        param = ".".join(loc) or None
        others = {".".join(_param_path(e)) for e in errors[1:]} - {param, ""}
        if first.get("type") == "json_invalid":
            ctx = first.get("ctx") or {}
            msg = f"the body is not valid JSON: {ctx.get('error', 'decode error')}"
            param = None
        elif not loc and ": " in msg:  # our model validators say "param: problem"
            param = msg.split(": ", 1)[0]
        elif first.get("type") in ("model_attributes_type", "dict_type") and not loc:
            msg = "the request body must be a JSON object (send Content-Type: application/json)"
        more = f" (also invalid: {', '.join(sorted(others))})" if others else ""
        text = f"{param}: {msg}" if param and not msg.startswith(f"{param}:") else msg
        return error_for(request.url.path, 400, text + more, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if endpoint_of(request.url.path) != "other":
            metrics.request(endpoint_of(request.url.path), "rejected_invalid")
        return error_for(request.url.path, exc.status_code, str(exc.detail), code=code,
                         headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        metrics.request(endpoint_of(request.url.path), "failed")
        return error_for(request.url.path, 500, f"internal server error "
                         f"({type(exc).__name__})", "server_error", code="internal_error")
