"""Ollama's API (docs/api.md in ollama/ollama), for the chat apps and editor plug-ins that speak
it: `GET /api/version`, `/api/tags`, `POST /api/show`, `/api/chat`, `/api/generate`. A thin
adapter: each chat or generate request becomes one /v1 request (see relay.py), and the answer
goes back as Ollama's JSON, or as its NDJSON stream (the default, as in Ollama).

Mapped: `options` (num_predict, temperature, top_k, top_p, min_p, seed, stop, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty; mirostat and the other llama.cpp samplers
as on /v1: accepted at their neutral value, refused by name otherwise; and llama.cpp's
`logit_bias`, which Ollama lacks), `format` ("json" or a
JSON schema), `tools` (calls come back with `arguments` as an object, as Ollama sends them),
`raw` on /api/generate (the prompt as it is, no chat template). Accepted and ignored: the model
name (this server serves one model), `keep_alive` (the model stays loaded), and the options
that tune Ollama's runner (num_ctx, num_gpu, num_thread, ...).

Departures: `temperature` defaults to 0 (greedy, the exact speculative path) where Ollama's
models default to 0.8; images, `suffix`, `context`, `think` and `logprobs` are refused with a
400 naming them; a tool call cut off by num_predict is dropped (Ollama's arguments are an object,
which a truncated call cannot be).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse, Response, StreamingResponse

from ane_spec import __version__
from ane_spec.daemon.engine import Engine
from ane_spec.daemon.protocol import ChatCompletionRequest, CompletionRequest
from ane_spec.daemon.relay import (
    Body, Failure, Generate, answer, chunks, json_body, ndjson, validated,
)

OLLAMA_VERSION = "0.12.0"  # the API version this adapter follows
NDJSON = "application/x-ndjson"
# options passed to the /v1 request under the same name
SAME_NAME = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
             "repeat_last_n", "presence_penalty", "frequency_penalty", "mirostat",
             "mirostat_tau", "mirostat_eta", "typical_p", "tfs_z",
             "logit_bias")  # not Ollama's: llama.cpp's, as on /v1


class Options(BaseModel):
    model_config = ConfigDict(extra="allow")

    num_predict: int | None = Field(None, ge=-2)  # -1: no limit, -2: fill the context


class OllamaFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: dict[str, Any] = {}


class OllamaToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    function: OllamaFunction


class OllamaMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | None = ""
    images: list[Any] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ShowBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    name: str | None = None  # the older name of the field


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    keep_alive: str | int | float | None = None
    think: bool | str | None = None
    logprobs: bool | None = None


class ChatBody(_Common):
    messages: list[OllamaMessage] = []
    tools: list[dict[str, Any]] | None = None


class GenerateBody(_Common):
    prompt: str = ""
    system: str | None = None
    template: str | None = None
    raw: bool = False
    suffix: str | None = None
    context: list[int] | None = None
    images: list[Any] | None = None


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def error(status: int, message: str) -> JSONResponse:
    """Ollama's error shape: {"error": "message"}."""
    return JSONResponse({"error": message}, status_code=status)


def _refuse_unsupported(body: _Common, fields: dict[str, Any]) -> None:
    for name, why in fields.items():
        if why:
            raise Failure(400, f"{name}: {why}", name)
    if body.think not in (None, False):
        raise Failure(400, "think: this model does not think (no reasoning output)", "think")
    if body.logprobs:
        raise Failure(400, "logprobs: not supported on the Ollama API; use /v1", "logprobs")


def _generation_fields(body: _Common, kind: str) -> dict[str, Any]:
    """The /v1 fields for options, format and stream."""
    out: dict[str, Any] = {"stream": body.stream}
    if body.stream:
        out["stream_options"] = {"include_usage": True}  # the totals of the last line
    options = body.options.model_dump() if body.options else {}
    for name in SAME_NAME:
        if options.get(name) is not None:
            out[name] = options[name]
    n = options.get("num_predict")
    if n == 0:
        raise Failure(400, "options.num_predict: must be at least 1, or -1 for no limit",
                      "options.num_predict")
    out["max_tokens"] = -1 if n is None or n < 0 else n  # Ollama's default: no limit
    schema: dict[str, Any] | None = None
    if body.format == "json":
        schema = {"type": "object"}
    elif isinstance(body.format, dict):
        schema = body.format
    elif body.format not in (None, ""):
        raise Failure(400, f"format: must be \"json\" or a JSON schema, not {body.format!r}",
                      "format")
    if schema is not None:
        out |= {"json_schema": schema} if kind == "completions" else {"response_format": {
            "type": "json_schema", "json_schema": {"name": "format", "schema": schema}}}
    return out


def _openai_messages(messages: list[OllamaMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        if m.images:
            raise Failure(400, f"messages[{i}].images: image inputs are not supported: this "
                               "model reads text only", "images")
        message: dict[str, Any] = {"role": m.role, "content": m.content or ""}
        if m.tool_calls:
            message["tool_calls"] = [{
                "id": f"call_{i}_{k}", "type": "function", "function": {
                    "name": c.function.name, "arguments": json.dumps(c.function.arguments)}}
                for k, c in enumerate(m.tool_calls)]
        if m.role == "tool" and m.tool_name:
            message["name"] = m.tool_name
        out.append(message)
    return out


def _calls(openai_calls: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """OpenAI's tool calls as Ollama's, arguments parsed; a call whose arguments are not a
    whole JSON object (cut off by num_predict) is dropped."""
    out = []
    for call in openai_calls or ():
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except json.JSONDecodeError:
            continue
        if isinstance(arguments, dict):
            out.append({"function": {"name": call["function"]["name"],
                                     "arguments": arguments}})
    return out


def _totals(use: dict[str, int], ext: dict[str, Any], started: float) -> dict[str, Any]:
    stats = ext["stats"]
    return {"total_duration": int((time.monotonic() - started) * 1e9), "load_duration": 0,
            "prompt_eval_count": use["prompt_tokens"],
            "prompt_eval_duration": int(stats["prefill_seconds"] * 1e9),
            "eval_count": use["completion_tokens"],
            "eval_duration": int(stats["decode_seconds"] * 1e9)}


def _done_reason(finish_reason: str | None) -> str:
    return "length" if finish_reason == "length" else "stop"


def router(engine: Engine, generate: Generate) -> APIRouter:
    api = APIRouter()

    def name() -> str:
        return f"{engine.model_id}:latest"

    def details() -> dict[str, Any]:
        return {"parent_model": "", "format": "ane-spec", "family": "phi3",
                "families": ["phi3"], "parameter_size": "", "quantization_level": "Q8_0"}

    @api.get("/api/version")
    async def version() -> dict[str, Any]:
        return {"version": OLLAMA_VERSION, "ane_spec": __version__}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        m = engine.pipeline.manifest
        return {"models": [{"name": name(), "model": name(), "modified_at": m.created,
                            "size": 0, "digest": "", "details": details()}]}

    @api.get("/api/ps")
    async def running() -> dict[str, Any]:
        return {"models": [{"name": name(), "model": name(), "size": 0, "digest": "",
                            "details": details(), "expires_at": "9999-12-31T23:59:59Z",
                            "size_vram": 0, "context_length": engine.context}]}

    @api.post("/api/show")
    async def show(request: Request) -> Response:
        try:
            body = validated(ShowBody, await json_body(request))
        except Failure as exc:
            return error(exc.status, exc.message)
        asked = body.model or body.name
        if asked not in (engine.model_id, name()):
            return error(404, f"model '{asked}' not found")
        tok = engine.tokenizer
        return JSONResponse({
            "modelfile": f"FROM {engine.model_id}\n", "parameters": "temperature 0",
            "template": tok.data.chat_template or "", "details": details(),
            "model_info": {"general.architecture": "phi3",
                           "phi3.context_length": engine.context},
            "capabilities": ["completion", "tools"], "modified_at":
                engine.pipeline.manifest.created})

    @api.post("/api/embed")
    @api.post("/api/embeddings")
    async def embed() -> Response:
        return error(501, "embeddings are not supported: this server runs a generative "
                          "Phi-4-mini build whose shards return next-token logits")

    @api.post("/api/chat")
    async def chat(request: Request) -> Response:
        started = time.monotonic()
        try:
            body = validated(ChatBody, await json_body(request))
            _refuse_unsupported(body, {})
            if not body.messages:  # Ollama: load (or, with keep_alive 0, unload) the model
                reason = "unload" if body.keep_alive in (0, "0", "0s") else "load"
                return JSONResponse({"model": body.model or name(), "created_at": now(),
                                     "message": {"role": "assistant", "content": ""},
                                     "done_reason": reason, "done": True})
            fields = _generation_fields(body, "chat") | {
                "messages": _openai_messages(body.messages)}
            if body.tools:
                fields["tools"] = body.tools
            inner = validated(ChatCompletionRequest, fields)
            return await run(request, inner, "chat", body, started)
        except Failure as exc:
            return error(exc.status, exc.message)

    @api.post("/api/generate")
    async def generate_(request: Request) -> Response:
        started = time.monotonic()
        try:
            body = validated(GenerateBody, await json_body(request))
            _refuse_unsupported(body, {
                "images": body.images and "image inputs are not supported: this model reads "
                                          "text only",
                "suffix": body.suffix and "this model has no fill-in-the-middle tokens",
                "context": body.context and "not supported: send the conversation to "
                                            "/api/chat instead",
                "template": body.template and "a template other than the model's is not "
                                              "supported (use raw: true)"})
            if not body.prompt:
                return JSONResponse({"model": body.model or name(), "created_at": now(),
                                     "response": "", "done": True, "done_reason": "load"})
            if body.raw:
                inner: Body = validated(CompletionRequest, _generation_fields(
                    body, "completions") | {"prompt": body.prompt})
                return await run(request, inner, "completions", body, started)
            messages = ([{"role": "system", "content": body.system}] if body.system else []) \
                + [{"role": "user", "content": body.prompt}]
            inner = validated(ChatCompletionRequest, _generation_fields(body, "chat") | {
                "messages": messages})
            return await run(request, inner, "chat", body, started)
        except Failure as exc:
            return error(exc.status, exc.message)

    async def run(request: Request, inner: Body, kind: str, body: _Common,
                  started: float) -> Response:
        model = body.model or name()
        key = "message" if isinstance(body, ChatBody) else "response"

        def piece(text: str, calls: list[dict[str, Any]] | None = None) -> Any:
            if key == "response":
                return text
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = calls
            return message

        if not body.stream:
            data = await answer(generate, request, inner, kind)
            choice = data["choices"][0]
            text = choice["message"]["content"] if kind == "chat" else choice["text"]
            calls = _calls(choice["message"].get("tool_calls")) if kind == "chat" else None
            return JSONResponse({"model": model, "created_at": now(),
                                 key: piece(text or "", calls), "done": True,
                                 "done_reason": _done_reason(choice["finish_reason"])}
                                | _totals(data["usage"], data["ane_spec"], started))
        events = await chunks(generate, request, inner, kind)

        async def lines() -> AsyncIterator[str]:
            reason, ext, calls = None, None, {}
            async for chunk in events:
                if "error" in chunk:
                    yield ndjson({"error": chunk["error"].get("message", "error")})
                    return
                if chunk.get("usage"):
                    if calls:
                        done_calls = _calls([calls[i] for i in sorted(calls)])
                        if done_calls:
                            yield ndjson({"model": model, "created_at": now(),
                                          key: piece("", done_calls), "done": False})
                    yield ndjson({"model": model, "created_at": now(), key: piece(""),
                                  "done": True, "done_reason": _done_reason(reason)}
                                 | _totals(chunk["usage"], ext, started))
                    continue
                choice = chunk["choices"][0]
                reason = choice.get("finish_reason") or reason
                ext = chunk.get("ane_spec") or ext
                delta = choice.get("delta", {}) if kind == "chat" else {"content": choice["text"]}
                for d in delta.get("tool_calls") or ():
                    call = calls.setdefault(d["index"], {"function": {"name": "",
                                                                      "arguments": ""}})
                    fn = d.get("function", {})
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
                if delta.get("content"):
                    yield ndjson({"model": model, "created_at": now(),
                                  key: piece(delta["content"]), "done": False})

        return StreamingResponse(lines(), media_type=NDJSON)

    return api
