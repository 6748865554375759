"""What the protocol adapters (llama-server's native API, Ollama's, OpenAI's Responses) share:
they turn their request into one OpenAI-shaped request, run it through the very handler that
serves /v1/chat/completions or /v1/completions (so decoding, grammars, tools, slots, limits and
metrics live once), and turn its answer back into their own wire format.

The handler's answer is read as data: a JSON body, or the parsed chunks of its event stream.
Dropping the stream (the adapter's client went away) closes the handler's stream, which cancels
the generation as a dropped /v1 stream does.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse

from ane_spec.daemon.protocol import ChatCompletionRequest, CompletionRequest

Body = ChatCompletionRequest | CompletionRequest
Generate = Callable[[Request, Body, str], Awaitable[Response]]
Model = TypeVar("Model", bound=BaseModel)


@dataclass(frozen=True)
class Failure(Exception):
    """A refused or failed request: the status, and OpenAI's error fields."""

    status: int
    message: str
    param: str | None = None
    code: str | None = None

    @classmethod
    def of(cls, status: int, error: dict[str, Any]) -> "Failure":
        return cls(status, str(error.get("message", "error")), error.get("param"),
                   error.get("code"))


def validated(model: type[Model], data: Any) -> Model:
    """`model.model_validate(data)`, a validation error raised as a 400 naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        if where and not message.startswith(f"{where}:"):
            message = f"{where}: {message}"
        raise Failure(400, message, where or None, "invalid_value") from None


async def json_body(request: Request) -> Any:
    """The request's JSON (BodyGuard has checked its type and size), or a 400."""
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise Failure(400, f"the body is not valid JSON: {exc}") from None


async def answer(generate: Generate, request: Request, body: Body, kind: str) -> dict[str, Any]:
    """The handler's JSON answer to a non-streamed request; a Failure for any error."""
    response = await generate(request, body, kind)
    data = json.loads(bytes(response.body))
    if response.status_code != 200:
        raise Failure.of(response.status_code, data.get("error", {}))
    return data


async def chunks(generate: Generate, request: Request, body: Body,
                 kind: str) -> AsyncIterator[dict[str, Any]]:
    """The handler's stream, chunk by chunk (its `[DONE]` dropped). A request refused before
    it started raises a Failure on creation; an error after that arrives as a chunk with an
    `error` key, as on /v1."""
    response = await generate(request, body, kind)
    if not isinstance(response, StreamingResponse):
        data = json.loads(bytes(response.body))
        raise Failure.of(response.status_code, data.get("error", {}))
    return _events(response.body_iterator)


async def _events(source: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    try:
        async for event in source:
            text = event.decode() if isinstance(event, bytes) else event
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
    finally:
        await source.aclose()  # type: ignore[attr-defined]


def ndjson(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n"
