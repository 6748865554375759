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
import math
import re
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
    retry_after: int | None = None  # a 429 or 503's Retry-After

    @classmethod
    def of(cls, status: int, error: dict[str, Any],
           response: Response | None = None) -> "Failure":
        retry = response.headers.get("retry-after") if response is not None else None
        return cls(status, str(error.get("message", "error")), error.get("param"),
                   error.get("code"), int(retry) if retry and retry.isdigit() else None)


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


# The one JSON parser: every body, on every route (BodyGuard parses it before any route sees it;
# /v1's FastAPI models then read the same, already vetted, text). Beyond what json.loads checks:
MAX_JSON_DEPTH = 128     # nesting (a schema may nest 64 levels, inside a few of the request's)
MAX_INT_DIGITS = 64      # an integer's digits (a seed is 20; Python refuses 4,300 with a 500)
# Where a lone surrogate can come from: a \uD800-\uDFFF escape, or (json.loads decodes bytes
# with "surrogatepass") its raw UTF-8 form. Only bodies containing one are searched for one.
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_LONG_DIGITS = re.compile(rb"[0-9]{%d}" % (MAX_INT_DIGITS + 1))


class JSONLimitError(ValueError):
    """A body json.loads would take but this server refuses: the message says why."""


def _constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not a JSON number")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONLimitError(f"the number {text[:40]} is out of range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise JSONLimitError(f"an integer has {len(text.lstrip('-'))} digits; the limit is "
                             f"{MAX_INT_DIGITS}")
    return int(text)


def parse_json(raw: bytes) -> Any:
    """`raw` as JSON, or JSONLimitError / json.JSONDecodeError / UnicodeDecodeError: no NaN,
    Infinity or out-of-range numbers, integers of at most MAX_INT_DIGITS digits, nesting of at
    most MAX_JSON_DEPTH, and no lone surrogates in strings or keys (text that cannot be encoded
    back: it used to fail only when the answer was written, after generation). llama-server's
    parser (nlohmann::json) refuses the same."""
    hooks: dict[str, Any] = {"parse_constant": _constant, "parse_float": _float}
    if _LONG_DIGITS.search(raw):  # only then: a Python call per integer costs time
        hooks["parse_int"] = _int
    try:
        value = json.loads(raw, **hooks)
    except RecursionError:
        raise JSONLimitError(f"it is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # Python's own digit limit, past the hooks' (a float's exponent)
        if isinstance(exc, (json.JSONDecodeError, UnicodeDecodeError, JSONLimitError)):
            raise
        raise JSONLimitError(str(exc).split(";")[0]) from None
    _check_tree(value, surrogates=bool(_SURROGATE.search(raw)))
    return value


def _check_tree(value: Any, surrogates: bool) -> None:
    """Nesting depth (and, when the body may hold one, lone surrogates), without recursion."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
            if surrogates:
                for key in node:
                    _encodable(key)
        elif isinstance(node, list):
            children = node
        else:
            if surrogates and isinstance(node, str):
                _encodable(node)
            continue
        if depth > MAX_JSON_DEPTH:
            raise JSONLimitError(f"it is nested more than {MAX_JSON_DEPTH} levels deep")
        stack.extend((child, depth + 1) for child in children
                     if surrogates or isinstance(child, (dict, list)))


def _encodable(text: str) -> None:
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise JSONLimitError(f"a string holds a lone surrogate "
                                 f"(\\u{ord(text[exc.start]):04x}), which is not text") from None


def json_error(exc: Exception) -> str:
    """The one message for a body `parse_json` refuses."""
    detail = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
    return f"the body is not valid JSON: {detail}"


PARSED = "ane_spec.json"  # the scope key BodyGuard keeps the parsed body under


async def json_body(request: Request) -> Any:
    """The request's JSON, as BodyGuard parsed it (it has checked type, size and `parse_json`'s
    limits), or a 400."""
    if PARSED in request.scope:
        return request.scope[PARSED]
    try:
        return parse_json(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise Failure(400, json_error(exc)) from None


async def answer(generate: Generate, request: Request, body: Body, kind: str) -> dict[str, Any]:
    """The handler's JSON answer to a non-streamed request; a Failure for any error."""
    response = await generate(request, body, kind)
    data = json.loads(bytes(response.body))
    if response.status_code != 200:
        raise Failure.of(response.status_code, data.get("error", {}), response)
    return data


async def chunks(generate: Generate, request: Request, body: Body,
                 kind: str) -> AsyncIterator[dict[str, Any]]:
    """The handler's stream, chunk by chunk (its `[DONE]` dropped). A request refused before
    it started raises a Failure on creation; an error after that arrives as a chunk with an
    `error` key, as on /v1."""
    response = await generate(request, body, kind)
    if not isinstance(response, StreamingResponse):
        data = json.loads(bytes(response.body))
        raise Failure.of(response.status_code, data.get("error", {}), response)
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
