"""Ollama's API (docs/api.md in ollama/ollama), for the chat apps and editor plug-ins that speak
it: `GET /` and `HEAD /` ("Ollama is running", which Ollama's Go client probes), `GET
/api/version`, `/api/tags`, `/api/ps`, `POST /api/show`, `/api/chat`, `/api/generate`. A thin
adapter: each chat or generate request becomes one /v1 request (see relay.py), and the answer
goes back as Ollama's JSON, or as its NDJSON stream (the default, as in Ollama). Every error
under /api/ is in Ollama's shape, `{"error": "message"}` (the middlewares' too).

Mapped: `options` (num_predict, temperature, top_k, top_p, min_p, seed, stop, repeat_penalty,
repeat_last_n, presence_penalty, frequency_penalty; mirostat and the other llama.cpp samplers
as on /v1: accepted at their neutral value, refused by name otherwise; and llama.cpp's
`logit_bias`, which Ollama lacks), each typed as Ollama's Go struct types it (api/types.go,
`Options.FromMap`: an integer option takes any JSON number, truncated, a float one any number,
and nothing else: `"5"` or `true` is a 400 naming the option), `format` ("json" or a JSON
schema), `tools` (calls come back with `arguments` as an object, as Ollama sends them), `raw` on
/api/generate (the prompt as it is, no chat template), `suffix` on /api/generate (a
fill-in-the-middle prompt, for vocabularies with FIM tokens: see fim.py). `num_predict` means
what it means to Ollama: a positive limit, -1 no limit and -2 fill the context (both: up to the
context here); 0, other negative numbers and counts past an int64 are a 400. `keep_alive` is
read as Ollama's `api.Duration` reads it (a number of seconds, negative for ever, or a Go
duration string such as "5m" or "-1s"; anything else is the 400 Ollama answers, with Go's
message); with no messages (no prompt on /api/generate) a zero one answers `done_reason:
"unload"`, and the model otherwise stays loaded whatever it says. Accepted and ignored: the
model name (this server serves one model), and the options that tune Ollama's runner (num_ctx,
num_gpu, num_thread, ...) or that it no longer knows. The model listings (/api/tags, /api/show,
/api/ps) give the build's real family, parameter count, file type and context window, read
from its manifest.

Departures: `temperature` defaults to 0 (greedy, the exact speculative path) where Ollama's
models default to 0.8; images, `context`, `think` and `logprobs` are refused with a 400 naming
them; a mistyped option is a 400 (Ollama answers 500); `suffix` makes a FIM prompt with `raw`
too (Ollama ignores it there); a tool call cut off by num_predict is dropped (Ollama's
arguments are an object, which a truncated call cannot be).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ane_spec import __version__
from ane_spec.daemon.engine import Engine
from ane_spec.daemon.fim import fim_tokens
from ane_spec.daemon.go_duration import parse_duration
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
# Ollama's options by the Go kind of their field (api/types.go: Options and the Runner it
# embeds). mirostat, mirostat_tau, mirostat_eta and tfs_z were fields of older Ollamas (typed
# as they were there); an option Ollama does not know is ignored, as Ollama ignores it.
INT_OPTIONS = frozenset({"num_keep", "seed", "num_predict", "top_k", "repeat_last_n", "num_ctx",
                         "num_batch", "num_gpu", "main_gpu", "num_thread", "draft_num_predict",
                         "mirostat"})
FLOAT_OPTIONS = frozenset({"top_p", "min_p", "typical_p", "temperature", "repeat_penalty",
                           "presence_penalty", "frequency_penalty", "mirostat_tau",
                           "mirostat_eta", "tfs_z"})
BOOL_OPTIONS = frozenset({"use_mmap"})
STRINGS_OPTIONS = frozenset({"stop"})
# /v1 parameter names as the Ollama request names them, for its error messages.
OLLAMA_NAMES = {"response_format": "format", "json_schema": "format",
                "max_tokens": "options.num_predict"} | {n: f"options.{n}" for n in SAME_NAME}


def typed_options(raw: dict[str, Any] | None) -> dict[str, Any]:
    """`options` typed as Ollama's `Options.FromMap` types them: JSON numbers are float64 in Go,
    so an integer option takes any number and truncates it (Go's int64(x)), a float option any
    number; a string, a bool or anything else where a number belongs is refused, as is a stop
    list holding anything but strings. null leaves an option unset."""
    out: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        if value is None:
            continue
        # a JSON number Go can hold in a float64 (Go's decoder refuses 1e999 and NaN)
        number = isinstance(value, int) and not isinstance(value, bool) and \
            abs(value) < 2**1023 or isinstance(value, float) and math.isfinite(value)
        if key in INT_OPTIONS:
            if not number:
                raise Failure(400, f'option "{key}" must be of type integer', f"options.{key}")
            out[key] = int(value)
        elif key in FLOAT_OPTIONS:
            if not number:
                raise Failure(400, f'option "{key}" must be of type float32', f"options.{key}")
            out[key] = float(value)
        elif key in BOOL_OPTIONS:
            if not isinstance(value, bool):
                raise Failure(400, f'option "{key}" must be of type boolean', f"options.{key}")
            out[key] = value
        elif key in STRINGS_OPTIONS:
            if not isinstance(value, list):
                raise Failure(400, f'option "{key}" must be of type array', f"options.{key}")
            if not all(isinstance(v, str) for v in value):
                raise Failure(400, f'option "{key}" must be of an array of strings',
                              f"options.{key}")
            out[key] = value
        elif key == "logit_bias":  # llama.cpp's, checked by the /v1 request
            out[key] = value
    return out


def keep_alive_ns(value: Any) -> int | None:
    """`keep_alive` as Ollama's api.Duration.UnmarshalJSON reads it, in nanoseconds (None: not
    given; negative: for ever): a JSON number is seconds (negative: for ever), a string a Go
    duration (negative: for ever), and anything else a 400, as Ollama answers."""
    if value is None:  # JSON null leaves Go's *Duration nil
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        kind = {bool: "bool", list: "[]interface {}", dict: "map[string]interface {}"}.get(
            type(value), type(value).__name__)
        raise Failure(400, f"keep_alive: Unsupported type: '{kind}'", "keep_alive")
    if isinstance(value, str):
        try:
            return parse_duration(value)
        except ValueError as exc:
            raise Failure(400, f"keep_alive: {exc}", "keep_alive") from None
    if value < 0:
        return -1
    try:
        return int(float(value) * 1e9)  # Go: time.Duration(t * float64(time.Second))
    except (OverflowError, ValueError):  # past what a float64 holds: Go's decoder refuses it
        raise Failure(400, "keep_alive: a number past what a float64 holds", "keep_alive") \
            from None


def _unloads(body: "_Common") -> bool:
    """Ollama expires the model for a request with nothing to generate and a zero keep_alive."""
    return keep_alive_ns(body.keep_alive) == 0


def ollama_message(exc: Failure) -> str:
    """A /v1 refusal's message, naming the parameter as the Ollama request names it."""
    head = (exc.param or exc.message.split(":", 1)[0]).split(".")[0]
    ours = OLLAMA_NAMES.get(head)
    if ours is None or not exc.message.startswith(head):
        return exc.message
    return ours + exc.message[len(head):]


def human_number(n: int) -> str:
    """Ollama's format.HumanNumber: 3.8B, 494.03M, 135M, 4K."""
    for unit, size, decimals in (("B", 10**9, 1), ("M", 10**6, 2)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.{decimals}f}{unit}"
    return f"{n / 1000:.0f}K" if n >= 1000 else str(n)


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
    options: dict[str, Any] | None = None
    keep_alive: Any = None  # checked by keep_alive_ns, as Ollama's api.Duration reads it
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
    keep_alive_ns(body.keep_alive)  # Ollama binds it with the body: a bad one is a 400 first
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
    options = typed_options(body.options)
    for name in SAME_NAME:
        if options.get(name) is not None:
            out[name] = options[name]
    n = options.get("num_predict")
    if n is not None and not (0 < n < 2**63 or n in (-1, -2)):
        raise Failure(400, f"options.num_predict: {n} is not a number of tokens: use at least "
                           "1, -1 for no limit or -2 to fill the context", "options.num_predict")
    # Ollama's default, -1 and -2 (fill the context): no limit but the context
    out["max_tokens"] = -1 if n is None or n < 0 else n
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

    manifest = engine.pipeline.manifest
    family = manifest.model.arch  # GGUF's general.architecture, as Ollama's details give it
    tok = engine.tokenizer
    fim = fim_tokens(tok)

    def details() -> dict[str, Any]:
        count = manifest.source.parameters
        return {"parent_model": "", "format": "ane-spec", "family": family,
                "families": [family],
                "parameter_size": "" if count is None else human_number(count),
                "quantization_level": manifest.source.file_type or ""}

    def model_info() -> dict[str, Any]:
        """Ollama's model_info keys for what the manifest knows. The context length is the
        build's window, not the GGUF's trained one: clients (Continue, litellm) size their
        prompts by it."""
        c = manifest.model
        info: dict[str, Any] = {
            "general.architecture": family, "general.name": manifest.name,
            f"{family}.context_length": engine.context,
            f"{family}.embedding_length": c.hidden_size, f"{family}.block_count": c.num_layers,
            f"{family}.feed_forward_length": c.ffn_size,
            f"{family}.attention.head_count": c.num_heads,
            f"{family}.attention.head_count_kv": c.num_kv_heads,
            f"{family}.rope.freq_base": c.rope_freq_base}
        if manifest.source.parameters is not None:
            info["general.parameter_count"] = manifest.source.parameters
        return info

    def capabilities() -> list[str]:
        from ane_spec.daemon.tool_formats import can_call_tools

        caps = ["completion"]
        if can_call_tools(tok.data.chat_template, tok.markup_ids, tok.id_of):
            caps.append("tools")
        if fim is not None:
            caps.append("insert")
        return caps

    @api.api_route("/", methods=["GET", "HEAD"])
    async def root() -> Response:
        """Ollama's liveness answer, which its Go client (`ollama ps`, `Client.Heartbeat`)
        and apps probing for an Ollama server read."""
        return PlainTextResponse("Ollama is running")

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
        if not asked:  # Ollama's ShowHandler, word for word
            return error(400, "model is required")
        if asked not in (engine.model_id, name()):
            return error(404, f"model '{asked}' not found")
        return JSONResponse({
            "modelfile": f"FROM {engine.model_id}\n", "parameters": "temperature 0",
            "template": tok.data.chat_template or "", "details": details(),
            "model_info": model_info(), "capabilities": capabilities(),
            "modified_at": manifest.created})

    @api.post("/api/embed")
    @api.post("/api/embeddings")
    async def embed() -> Response:
        return error(501, "embeddings are not supported: this server runs a generative "
                          f"{family} build ({engine.model_id}) whose shards return next-token "
                          "logits")

    @api.post("/api/chat")
    async def chat(request: Request) -> Response:
        started = time.monotonic()
        try:
            body = validated(ChatBody, await json_body(request))
            _refuse_unsupported(body, {})
            if not body.messages:  # Ollama: load (or, with keep_alive 0, unload) the model
                reason = "unload" if _unloads(body) else "load"
                return JSONResponse({"model": body.model or name(), "created_at": now(),
                                     "message": {"role": "assistant", "content": ""},
                                     "done_reason": reason, "done": True})
            fields = _generation_fields(body, "chat") | {
                "messages": _openai_messages(body.messages)}
            if body.tools:
                if "tools" not in capabilities():  # Ollama's capability check, in its words
                    raise Failure(400, f"{body.model or name()} does not support tools (its "
                                       "chat template has no tool-call format)", "tools")
                fields["tools"] = body.tools
            inner = validated(ChatCompletionRequest, fields)
            return await run(request, inner, "chat", body, started)
        except Failure as exc:
            return error(exc.status, ollama_message(exc))

    @api.post("/api/generate")
    async def generate_(request: Request) -> Response:
        started = time.monotonic()
        try:
            body = validated(GenerateBody, await json_body(request))
            _refuse_unsupported(body, {
                "images": body.images and "image inputs are not supported: this model reads "
                                          "text only",
                "context": body.context and "not supported: send the conversation to "
                                            "/api/chat instead",
                "template": body.template and "a template other than the model's is not "
                                              "supported (use raw: true)"})
            if body.suffix and fim is None:  # Ollama's capability check, in its words
                raise Failure(400, f"{body.model or name()} does not support insert (its "
                                   "vocabulary has no fill-in-the-middle tokens)", "suffix")
            kind = "completions" if body.raw or body.suffix else "chat"
            fields = _generation_fields(body, kind)  # options are checked before a load
            if not body.prompt:  # Ollama: load (or, with keep_alive 0, unload) the model
                return JSONResponse({"model": body.model or name(), "created_at": now(),
                                     "response": "", "done": True,
                                     "done_reason": "unload" if _unloads(body) else "load"})
            if kind == "completions":  # raw, or a fill-in-the-middle prompt (no template)
                inner: Body = validated(CompletionRequest, fields | {
                    "prompt": body.prompt, "suffix": body.suffix or None})
                return await run(request, inner, "completions", body, started)
            messages = ([{"role": "system", "content": body.system}] if body.system else []) \
                + [{"role": "user", "content": body.prompt}]
            inner = validated(ChatCompletionRequest, fields | {"messages": messages})
            return await run(request, inner, "chat", body, started)
        except Failure as exc:
            return error(exc.status, ollama_message(exc))

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
