"""How a generation request ends, streamed or not: its text collected or streamed as it comes,
then one `finish()` that turns the worker's last event and the tool calls read from the whole
text into what the client is told (an error, or the result with its finish_reason, tool calls,
usage, the ane_spec extension and logprobs), and counts the request's outcome.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request
from starlette.responses import JSONResponse, Response

from ane_spec.daemon.engine import Engine, Job
from ane_spec.daemon.http_errors import error_response, error_type
from ane_spec.daemon.prepare import Plan
from ane_spec.daemon.protocol import (
    Envelope, dumps, error_body, finish_reason, logprobs_body, usage,
)
from ane_spec.daemon.tools import ToolCallParser, check_calls
from ane_spec.decode.session import GenerationResult

log = logging.getLogger("ane_spec.daemon")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class Ending:
    """How a generation request ends, the same whether it streams: an error (status, message,
    code), and/or the result with OpenAI's finish_reason, tool calls, usage, the ane_spec
    extension and logprobs."""

    error: tuple[int, str, str | None] | None = None
    result: GenerationResult | None = None
    calls: list[dict[str, Any]] | None = None
    reason: str | None = None
    use: dict[str, int] | None = None
    ext: dict[str, Any] | None = None
    logprobs: dict[str, Any] | None = None


def logprobs_of(engine: Engine, plan: Plan, result: GenerationResult) -> dict[str, Any] | None:
    if result.logprobs is None:
        return None
    return logprobs_body(plan.item.endpoint, result.logprobs, result.tokens,
                         engine.tokenizer.token_bytes)


def finish(engine: Engine, job: Job, plan: Plan, final: tuple[str, Any],
           parser: ToolCallParser | None) -> Ending:
    """The end of every generation request, streamed or not: what the client is told, from
    the worker's last event and the tool calls `parser` has read from the whole text; the
    request's outcome is counted here."""
    metrics = engine.metrics
    kind = job.item.endpoint
    event, payload = final
    if event == "error":
        status, message = payload
        metrics.request(kind, "failed" if status >= 500 else "rejected_invalid")
        return Ending(error=(status, message, None))
    if payload is None or payload.finish_reason == "cancelled":
        metrics.request(kind, "cancelled")
        if engine.stopping:
            return Ending(error=(503, "the server is shutting down", None))
        return Ending(error=(499, "the client closed the request", "cancelled"))
    result: GenerationResult = payload
    # Every call that began, the last one possibly cut off by max_tokens (its arguments
    # truncated, as OpenAI returns it); only whole calls can be judged.
    calls = parser.calls if parser is not None else []
    problem = _check_output(plan, result, parser.whole_calls if parser else None)
    ending = Ending(result=result, calls=calls or None,
                    reason=finish_reason(result.finish_reason, bool(calls)),
                    use=usage(result.prompt_tokens, len(result.tokens)),
                    ext=extension(engine, job, result),
                    logprobs=logprobs_of(engine, plan, result))
    if problem:
        metrics.request(kind, "failed")
        return replace(ending, error=(500 if problem[0] else 400, problem[1],
                                      "invalid_output"))
    metrics.request(kind, "completed")
    return ending


async def _parse(parser: ToolCallParser, text: str, *, last: bool
                 ) -> tuple[str, list[dict[str, Any]]]:
    """The parser's content and call deltas for the next piece of text (and what it held back,
    when `last`), computed in a worker thread: the parsers are linear in their input, but a
    long reply (a tool call's arguments, a run of whitespace) still costs milliseconds, and the
    event loop serves every other client and /health meanwhile. One request's pieces are
    parsed in order, each awaited before the next."""
    def run() -> tuple[str, list[dict[str, Any]]]:
        content, deltas = parser.feed(text)
        return (content + parser.finish() if last else content), deltas

    return await asyncio.to_thread(run)


async def collect(engine: Engine, request: Request, job: Job, plan: Plan,
                  envelope: Envelope) -> Response:
    watcher = asyncio.create_task(_watch_disconnect(request, engine, job))
    try:
        while True:
            final = await job.events.get()
            if final[0] != "text":
                break
    finally:
        watcher.cancel()
    parser = plan.tool_format.parser() if plan.tools else None
    content = None
    if parser is not None and final[0] == "done" and final[1] is not None:
        content, _ = await _parse(parser, final[1].text, last=True)
    ending = finish(engine, job, plan, final, parser)
    if ending.error is not None:
        status, message, code = ending.error
        return error_response(status, message, error_type(status), code=code)
    result = ending.result
    return JSONResponse(envelope.response(
        result.text if parser is None else content or None, ending.reason, ending.use,
        ending.ext, tool_calls=ending.calls, logprobs=ending.logprobs))


async def stream(engine: Engine, job: Job, plan: Plan, envelope: Envelope,
                 include_usage: bool) -> AsyncIterator[str]:
    finished = False
    parser = plan.tool_format.parser() if plan.tools else None
    try:
        if job.item.endpoint == "chat":
            yield sse(envelope.chunk(first=True))
        final = None
        while final is None:
            events = [await job.events.get()]
            while not job.events.empty():
                events.append(job.events.get_nowait())
            text = []
            for event in events:
                if event[0] == "text":
                    text.append(event[1])
                else:
                    final = event
            piece = "".join(text)
            deltas: list[dict[str, Any]] = []
            if parser is not None:
                piece, deltas = await _parse(parser, piece, last=final is not None)
            if piece or deltas:
                yield sse(envelope.chunk(piece or None, tool_calls=deltas or None))
        ending = finish(engine, job, plan, final, parser)
        if ending.error is not None:  # with a result, its text has left already
            status, message, code = ending.error
            yield sse(error_body(message, error_type(status), code=code))
        if ending.result is not None:
            yield sse(envelope.chunk(None, ending.reason, ext=ending.ext,
                                     logprobs=ending.logprobs))
            if include_usage:
                yield sse(envelope.usage_chunk(ending.use))
        finished = True
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # the client went away (the response task was cancelled)
            engine.cancel(job)
            engine.metrics.request(job.item.endpoint, "cancelled")


def _check_output(plan: Plan, result: GenerationResult,
                  calls: list[dict[str, Any]] | None = None) -> tuple[bool, str] | None:
    """A JSON output that left the grammar complete is validated against its schema before it
    leaves, and tool calls against the tools given; (is_server_fault, message) when it fails.
    Output cut by max_tokens or the context ends with finish_reason "length" and is not judged,
    as OpenAI does."""
    if calls and plan.tools:
        problem = check_calls(calls, plan.tools)
        if problem:
            log.error("refusing the model's tool calls: %s", problem)
            return True, f"{problem}: a bug in ane-spec"
    if plan.schema is None or result.finish_reason in ("length", "context", "cancelled"):
        return None
    import json

    import jsonschema

    try:
        value = json.loads(result.text) if result.grammar_complete else None
    except json.JSONDecodeError:
        value = None
    if value is None:
        if plan.item.options.stop:
            return False, ("a stop string ended the output before the JSON was complete; drop "
                           "`stop` when asking for JSON")
        return True, "the constrained output is not complete JSON: a bug in ane-spec"
    try:
        jsonschema.validate(value, plan.schema)
    except jsonschema.ValidationError as exc:
        return True, f"the constrained output does not match the schema ({exc.message})"
    except jsonschema.SchemaError:
        return None  # the grammar engine accepted a schema jsonschema cannot check
    return None


def extension(engine: Engine, job: Job, result) -> dict[str, Any]:  # noqa: ANN001
    item = job.item
    ttft = None if job.first_text is None else round(job.first_text - job.created, 4)
    return {"decode_shape": engine.pipeline.decode_shape,
            "speculative": item.options.speculative, "guard": item.options.guard,
            "ngram_min": item.ngram_min, "ngram_max": item.ngram_max,
            "fill_drafts": engine.fill_drafts,
            "guard_margin": engine.session.guard_margin if engine.session else None,
            "queue_seconds": round(job.queue_seconds, 4), "time_to_first_token_seconds": ttft,
            "stop_word": result.stop_word, "stats": result.stats.to_dict()} | (
                {"stopped_by": "request_timeout"} if result.time_limited else {})


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


async def _watch_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Non-streaming requests: cancel the job when the client disconnects while it waits."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.cancel(job)
            return

