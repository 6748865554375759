"""The HTTP surface: OpenAI-compatible routes, health, metrics, auth and limits.

Every handler is async and cheap: tokenization runs in a thread, generation in the engine's
worker, so the event loop always answers /health and /metrics. Every failure a request can
cause maps to a 4xx with OpenAI's error shape; a 500 means a bug, and even then only that
request fails.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ane_spec import __version__
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE
from ane_spec.daemon.config import ServeConfig, host_name
from ane_spec.daemon.draft_scopes import scope_of
from ane_spec.daemon import llama_server_api, ollama_api, responses_api
from ane_spec.daemon.engine import Engine, Job, NotReady, QueueFull, SlotAction, WorkItem
from ane_spec.daemon.metrics import CONTENT_TYPE
from ane_spec.daemon.path_aliases import PathAliases
from ane_spec.daemon.protocol import (
    RANDOM_SEED, SEED_MAX, ChatCompletionRequest, ChatMessage, CompletionRequest,
    DetokenizeRequest, Envelope, FunctionSpec, ResponseFormat, SpeculationOptions, StreamOptions,
    TextPart, TokenizeRequest, Tool, dumps, error_body, finish_reason, logprobs_body, usage,
)
from ane_spec.daemon.tool_formats import (
    PHI4, TemplateInput, ToolFormat, tool_format_of, tool_tag_ids,
)
from ane_spec.daemon.tools import (
    ToolCallParser, check_calls,
)
from ane_spec.decode.grammar import Grammar, GrammarError
from ane_spec.decode.grammar_limits import check_schema
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import GenerateOptions, GenerationResult, NeedsLogits, needs_logits
from ane_spec.errors import AneSpecError

log = logging.getLogger("ane_spec.daemon")

# Answered without the API key: liveness probes, and llama-server's public /props.
OPEN_PATHS = frozenset({"/health", "/props"})
CORS_METHODS = ["GET", "POST", "OPTIONS"]
CORS_HEADERS = ["Authorization", "Content-Type", "Accept", "OpenAI-Organization",
                "OpenAI-Project", "X-Stainless-Lang", "X-Stainless-Package-Version",
                "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
                "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count", "X-Stainless-Timeout"]
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SLOT_ACTIONS = ("save", "restore", "erase")
HEAVY_THREADS = 2


class SlotActionBody(BaseModel):
    """POST /slots/{id}?action=save|restore|erase (llama-server's shape)."""

    model_config = ConfigDict(extra="forbid")
    filename: str | None = None


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status,
                        headers=headers)


def endpoint_of(path: str) -> str:
    return ENDPOINTS.get(path, "other")


# --- ASGI middlewares (pure ASGI: they must not break streaming or disconnect detection) ------

class BearerAuth:
    """With an API key, every path but /health needs `Authorization: Bearer <key>`; the token
    is compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str | None, engine: Engine):
        self.app, self.engine = app, engine
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.key is None or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                if scheme.lower() == b"bearer":
                    given = token.strip()
                break
        if hmac.compare_digest(given, self.key):
            return await self.app(scope, receive, send)
        self.engine.metrics.request(endpoint_of(scope["path"]), "rejected_unauthorized")
        response = error_response(
            401, "missing or invalid API key: send the header 'Authorization: Bearer <key>'",
            "authentication_error", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class HostCheck:
    """DNS rebinding: a web page whose name is made to resolve to 127.0.0.1 reaches the server
    as same-origin, with its own name in `Host`. Only Host values naming this server pass (see
    `ServeConfig.allowed_host_names`); a request without one cannot come from a browser.
    Ollama's allowedHostsMiddleware (server/routes.go) does this for loopback binds, and also
    lets private IPs and *.local/*.internal names in; llama-server has no such check."""

    def __init__(self, app: ASGIApp, allowed: frozenset[str], engine: Engine):
        self.app, self.allowed, self.engine = app, allowed, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope["headers"]:
            if name == b"host":
                host = value.decode("latin-1")
                if not host_allowed(host, self.allowed):
                    self.engine.metrics.request(endpoint_of(scope["path"]), "rejected_host")
                    response = error_response(
                        403, f"the Host header {host[:100]!r} does not name this server; "
                             "add the name with --allowed-hosts if it should",
                        "permission_error", code="host_not_allowed")
                    return await response(scope, receive, send)
                break
        await self.app(scope, receive, send)


class BodyGuard:
    """Every request body: JSON (by Content-Type, and present) on routes that change state, at
    most `limit` bytes (413, by Content-Length before reading anything and by counting
    otherwise), and all of it within `seconds` of the headers (408: a client trickling one byte
    at a time cannot hold a connection). The accepted body is replayed to the app.

    Requiring `application/json` keeps cross-site pages out: a browser sends that type only
    after a CORS preflight, which this server answers only for --allowed-origins, while a
    form or a plain `fetch` (text/plain, no preflight) would otherwise act on the API."""

    def __init__(self, app: ASGIApp, limit: int, seconds: float, engine: Engine):
        self.app, self.limit, self.seconds, self.engine = app, limit, seconds, engine

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str, code: str) -> None:
        self.engine.metrics.request(endpoint_of(scope["path"]), "rejected_invalid")
        await error_response(status, message, code=code)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        changes_state = scope["method"] not in SAFE_METHODS
        if changes_state and not is_json(headers.get(b"content-type", b"")):
            return await self._refuse(
                scope, receive, send, 415, f"{scope['method']} {scope['path']} takes a JSON "
                "body: send Content-Type: application/json", "unsupported_media_type")
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.limit:
            return await self._refuse(scope, receive, send, 413, f"the request body is "
                                      f"{declared} bytes; the limit is {self.limit}",
                                      "request_too_large")
        chunks, size = [], 0
        with anyio.move_on_after(self.seconds) as timer:
            while True:
                message = await receive()
                if message["type"] != "http.request":  # disconnected before the body arrived
                    return
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.limit:
                    return await self._refuse(scope, receive, send, 413, "the request body is "
                                              f"more than {self.limit} bytes; the limit is "
                                              f"{self.limit}", "request_too_large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if timer.cancelled_caught:
            return await self._refuse(scope, receive, send, 408, f"the request body did not "
                                      f"arrive within {self.seconds:g} s", "request_timeout")
        body = b"".join(chunks)
        if changes_state and not body:
            return await self._refuse(scope, receive, send, 400, f"{scope['method']} "
                                      f"{scope['path']} takes a JSON body ({{}} for none)",
                                      "missing_body")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def is_json(content_type: bytes) -> bool:
    """application/json or application/*+json, parameters aside (FastAPI's own test)."""
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/")
                                            and media.endswith(b"+json"))


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a Host header ("localhost:8000", "[::1]:8000") names an allowed host or a
    loopback address (an IP literal: a page cannot rebind a name to reach it)."""
    name = host_name(host)
    if name in allowed:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --- request preparation (runs in a worker thread: tokenization may take a while) ----------------

@dataclass(frozen=True)
class Plan:
    """A validated request: the engine's work item and what the response does with its text."""

    item: WorkItem
    tools: list[Tool] | None = None  # parse output into calls to these, in this format:
    tool_format: ToolFormat = PHI4
    schema: dict[str, Any] | None = None  # the output must be JSON valid against it


@dataclass(frozen=True)
class Constraint:
    """A request's grammar, the parameter that asked for it (named in errors), and the schema
    its JSON output is validated against."""

    grammar: Grammar
    param: str
    schema: dict[str, Any] | None = None


def prepare(engine: Engine, body: ChatCompletionRequest | CompletionRequest, kind: str,
            scope: str | None = None) -> Plan:
    tok, config, ctx = engine.tokenizer, engine.config, engine.context
    vocab = engine.pipeline.config.vocab_size
    uses_tools = kind == "chat" and body.uses_tools
    fmt = tool_format_of(tok.data.chat_template, tok.markup_ids, tok.id_of)
    if uses_tools and fmt is None:
        raise BadRequest(f"tools: this model's chat template ({engine.pipeline.config.arch}) "
                         "has no tool-call format this server knows (Phi-4-mini's "
                         "<|tool_call|>, Llama 3's JSON calls, Qwen's <tool_call> tags)", "tools")
    # A template without a known format still renders earlier calls somehow: as Phi-4-mini's.
    fmt = fmt or PHI4
    if kind == "chat":
        where = "messages"
        try:
            given = fmt.template_input(body.messages, body.tools if uses_tools else None,
                                       engine.grammars.limits)
        except (ValueError, GrammarError) as exc:
            raise BadRequest(str(exc), "messages") from None
        prompt = _chat_prompt(tok, given, config.special_in_content, tool_tag_ids(fmt, tok.id_of))
    else:
        where = "prompt"
        source = body.single_prompt()
        if isinstance(source, str):
            prompt = tok.encode(source, special=True, add_special=True)
        else:
            prompt = list(source)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise BadRequest(f"token ids {bad[:5]} are outside the vocabulary "
                                 f"0..{vocab - 1}", "prompt")
    n = len(prompt)
    if n == 0:
        raise BadRequest("the prompt is empty", where)
    room = ctx - n
    if room < 1:
        raise BadRequest(f"this model's context window is {ctx} tokens and the prompt has {n}, "
                         "which leaves no room to generate", where, "context_length_exceeded")
    # Like llama-server, a cap beyond the room left is lowered to it: generation then ends with
    # finish_reason "length" when the context fills.
    max_tokens = min(body.requested_max_tokens() or ctx, room)

    sampling = _sampling(engine, body)
    constraint = _constraint(engine, body, kind, fmt if uses_tools else None)
    if constraint is not None and sampling.ignore_eos:
        raise BadRequest("ignore_eos: cannot be combined with a grammar, a response_format or "
                         "tools (the grammar decides where the output ends)", "ignore_eos")

    ext = body.ane_spec or SpeculationOptions()
    lo = config.ngram_min if ext.ngram_min is None else ext.ngram_min
    hi = config.ngram_max if ext.ngram_max is None else ext.ngram_max
    if ext.ngram_max is None:
        hi = max(hi, lo)
    if ext.ngram_min is None:
        lo = min(lo, hi)
    if hi < lo:
        raise BadRequest(f"ane_spec.ngram_max ({hi}) must be >= ane_spec.ngram_min ({lo})",
                         "ane_spec.ngram_max")
    options = GenerateOptions(
        max_tokens=max_tokens, stop=body.stops, sampling=sampling,
        speculative=config.speculative if ext.speculative is None else ext.speculative,
        guard=config.guard if ext.guard is None else ext.guard,
        grammar=None if constraint is None else constraint.grammar,
        logprobs=body.top_n, special_text=uses_tools)
    refusal = needs_logits(options) if engine.pipeline.head_argmax else None
    if refusal is not None:
        if refusal.param == "grammar":  # the parameter that asked for it
            refusal = NeedsLogits(constraint.param)
        raise BadRequest(str(refusal), refusal.param)
    return Plan(WorkItem(prompt, options, lo, hi, kind, scope),
                tools=body.tools if uses_tools else None, tool_format=fmt,
                schema=None if constraint is None else constraint.schema)


def _chat_prompt(tok, given: TemplateInput, special_in_content: bool,  # noqa: ANN001
                 not_in_text: Iterable[int] = ()) -> list[int]:
    """The chat's prompt tokens. Only the template's markup may produce special tokens; with
    --special-in-content the whole prompt is parsed for them, as llama-server does."""
    from ane_spec.model.chat import render_chat, render_chat_pieces

    messages = given.messages
    kw = dict(template=tok.data.chat_template, tools=given.tools, extra=given.extra,
              eos_token=_token_text(tok, tok.eos_token_id, "<|endoftext|>"),
              bos_token=_token_text(tok, tok.bos_token_id, "<|endoftext|>"),
              add_bos=tok.data.add_bos_token)
    try:
        if special_in_content:
            return tok.encode(render_chat(messages, **kw), special=True, add_special=True)
        return tok.encode_pieces(render_chat_pieces(messages, **kw), add_special=True,
                                 not_in_text=not_in_text)
    except AneSpecError as exc:
        raise BadRequest(str(exc), "messages") from None


def _sampling(engine: Engine, body: ChatCompletionRequest | CompletionRequest) -> SamplingParams:
    try:
        bias = body.logit_bias_pairs(engine.pipeline.config.vocab_size)
    except ValueError as exc:
        raise BadRequest(str(exc).removeprefix("logit_bias: "), "logit_bias") from None
    last_n = 64 if body.repeat_last_n is None else body.repeat_last_n
    # llama.cpp: seed -1 draws a random seed, as no seed does.
    seed = None if body.seed in (None, RANDOM_SEED) else body.seed & SEED_MAX
    # top_p 0: llama.cpp's top-p keeps min_keep = 1 token, the most likely after the
    # processors, which is what greedy decoding picks; decoding it greedily keeps it exact.
    greedy = body.top_p == 0
    return SamplingParams(
        temperature=0.0 if greedy else body.temperature or 0.0,
        top_p=1.0 if body.top_p is None or greedy else body.top_p,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        repeat_penalty=1.0 if body.repeat_penalty is None else body.repeat_penalty,
        repeat_last_n=engine.context if last_n == -1 else last_n,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0, logit_bias=bias,
        ignore_eos=bool(body.ignore_eos), seed=seed)


def _constraint(engine: Engine, body: ChatCompletionRequest | CompletionRequest, kind: str,
                tool_format: ToolFormat | None) -> Constraint | None:
    uses_tools = tool_format is not None
    fmt = body.response_format if kind == "chat" else None
    schema: dict[str, Any] | None = None
    if uses_tools:
        param, what = "tools", "the tools' parameters"
    elif fmt is not None and fmt.type != "text":
        param = what = "response_format"
        schema = fmt.enforced_schema
        schema = {"type": "object"} if schema is None else schema  # json_object: any object
    elif body.json_schema is not None:
        param = what = "json_schema"
        schema = body.json_schema
    elif body.grammar is not None:
        param = what = "grammar"
    else:
        return None
    compiler = engine.grammars
    try:
        if uses_tools:
            for i, t in enumerate(body.tools):
                if t.function.parameters is not None:
                    check_schema(t.function.parameters,
                                 f"tools[{i}].function.parameters", compiler.limits)
            grammar = compiler.compile("lark", tool_format.grammar(
                body.tools, body.tool_choice, body.parallel_tool_calls), what)
        elif schema is not None:
            grammar = compiler.compile("json_schema", schema, what)
        else:
            grammar = compiler.compile("gbnf", body.grammar, what)
        return Constraint(grammar, param, schema)
    except GrammarError as exc:
        raise BadRequest(str(exc), param) from None


def _token_text(tok, token_id: int | None, fallback: str) -> str:  # noqa: ANN001
    return fallback if token_id is None else tok.token_text(token_id)


def extension(engine: Engine, job: Job, result) -> dict[str, Any]:  # noqa: ANN001
    item = job.item
    ttft = None if job.first_text is None else round(job.first_text - job.created, 4)
    return {"decode_shape": engine.pipeline.decode_shape,
            "speculative": item.options.speculative, "guard": item.options.guard,
            "ngram_min": item.ngram_min, "ngram_max": item.ngram_max,
            "fill_drafts": engine.fill_drafts,
            "guard_margin": engine.session.guard_margin if engine.session else None,
            "queue_seconds": round(job.queue_seconds, 4), "time_to_first_token_seconds": ttft,
            "stop_word": result.stop_word, "stats": result.stats.to_dict()}


def sse(obj: Any) -> str:
    return f"data: {dumps(obj)}\n\n"


# --- the app ----------------------------------------------------------------------------------

def create_app(config: ServeConfig, engine: Engine) -> FastAPI:
    # /tokenize and /detokenize (a megabyte of text, a million pieces to render) run on threads,
    # at most HEAVY_THREADS at once: Python threads share one GIL, so more of them would only
    # slow the event loop's turn at it (and with it /health) without finishing sooner. Request
    # preparation has anyio's own limiter: it may wait on the grammar compiler, and must not
    # hold these slots while it does.
    heavy: dict[str, anyio.CapacityLimiter] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        heavy["limiter"] = anyio.CapacityLimiter(HEAVY_THREADS)
        engine.start()
        try:
            yield
        finally:
            await anyio.to_thread.run_sync(engine.stop)

    async def off_loop(fn, *args):  # noqa: ANN001, ANN202
        return await anyio.to_thread.run_sync(fn, *args, limiter=heavy["limiter"])

    app = FastAPI(title="ane-spec", version=__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None,
                  description="OpenAI-compatible server for a speculative-decoding Phi-4-mini "
                              "build. Extensions: the `ane_spec` request and response field.")
    app.state.engine = engine
    metrics = engine.metrics

    # Added innermost first: auth runs before the body is even read, and CORS (when allowed)
    # before auth, so a browser's preflight (which carries no credentials) gets its answer and
    # every error response carries the headers a page needs to read it. The Host check comes
    # first of all.
    app.add_middleware(BodyGuard, limit=config.max_body_bytes, seconds=config.body_timeout,
                       engine=engine)
    app.add_middleware(BearerAuth, api_key=config.api_key, engine=engine)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=CORS_METHODS, allow_headers=CORS_HEADERS,
                           allow_credentials=False, max_age=600)
    allowed_hosts = config.allowed_host_names
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts, engine=engine)
    app.add_middleware(PathAliases)

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
        return error_response(400, text + more, param=param, code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if endpoint_of(request.url.path) != "other":
            metrics.request(endpoint_of(request.url.path), "rejected_invalid")
        return error_response(exc.status_code, str(exc.detail), code=code,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        metrics.request(endpoint_of(request.url.path), "failed")
        return error_response(500, f"internal server error ({type(exc).__name__})",
                              "server_error", code="internal_error")

    @app.get("/health")
    async def health() -> JSONResponse:
        """llama-server's convention: 503 {"status": "loading"} until the model can answer
        (probes that only check the code must not see it ready early), 200 {"status": "ok"}."""
        body = engine.health()
        status = {"ready": "ok", "warming": "loading"}.get(body["status"], body["status"])
        return JSONResponse(body | {"status": status},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return PlainTextResponse(metrics.render(engine.gauges), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        m = engine.pipeline.manifest
        return {"id": engine.model_id, "object": "model", "created": _created(m.created),
                "owned_by": "ane-spec", "context_window": engine.context}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id != engine.model_id:
            return error_response(404, f"the model '{model_id}' does not exist; this server "
                                       f"serves '{engine.model_id}'", param="model",
                                  code="model_not_found")
        return JSONResponse(model_card())

    @app.get("/props")
    async def props() -> dict[str, Any]:
        tok = engine.tokenizer
        return {
            "default_generation_settings": {
                "n_ctx": engine.context, "speculative": config.speculative,
                "params": {"n_predict": -1, "seed": RANDOM_SEED, "temperature": 0.0,
                           "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_last_n": 64,
                           "repeat_penalty": 1.0, "presence_penalty": 0.0,
                           "frequency_penalty": 0.0, "ignore_eos": False, "stop": [],
                           "samplers": ["penalties", "temperature", "top_k", "top_p",
                                        "min_p"]}},
            "total_slots": engine.kv_slots, "model_path": engine.model_id,
            "model_alias": engine.model_id,
            "chat_template": tok.data.chat_template or PHI4_MINI_CHAT_TEMPLATE,
            "bos_token": _token_text(tok, tok.bos_token_id, ""),
            "eos_token": _token_text(tok, tok.eos_token_id, ""),
            "modalities": {"vision": False, "audio": False},
            "build_info": f"ane-spec {__version__}", "status": engine.status}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        tok = engine.tokenizer

        def run() -> bytes:
            ids = tok.encode(body.content, special=True, add_special=body.add_special)
            if not body.with_pieces:
                return _json_list("tokens", ids)
            return _json_list("tokens", [{"id": t, "piece": _piece(tok.token_bytes(t))}
                                         for t in ids])

        return Response(await off_loop(run), media_type="application/json")

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        tok = engine.tokenizer
        vocab = tok.vocab_size

        def run() -> Response:
            bad = [t for t in body.tokens if not 0 <= t < vocab]
            if bad:
                return error_response(400, f"tokens: ids {bad[:5]} are outside the vocabulary "
                                           f"0..{vocab - 1}", param="tokens",
                                      code="invalid_value")
            return Response(_json_bytes({"content": tok.decode(body.tokens)}),
                            media_type="application/json")

        return await off_loop(run)

    @app.post("/v1/embeddings")
    @app.post("/embeddings")
    async def embeddings() -> Response:
        return error_response(
            501, "embeddings are not supported: this server runs a generative Phi-4-mini "
                 "build whose shards return next-token logits, not pooled embeddings",
            "not_implemented_error", code="not_implemented")

    @app.get("/slots")
    async def slots() -> Response:
        if engine.status != "ready" or engine.slots is None:
            return error_response(503, str(engine.not_ready()), "server_error",
                                  code="unavailable")
        return JSONResponse(engine.slots_snapshot())

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str,
                          body: SlotActionBody | None = None) -> Response:
        if action not in SLOT_ACTIONS:
            return error_response(400, f"action must be one of {', '.join(SLOT_ACTIONS)}, got "
                                       f"{action!r}", param="action")
        if action == "restore" and not (body and body.filename):
            return error_response(400, "restore needs a filename: {\"filename\": \"NAME\"}",
                                  param="filename")
        try:
            job = engine.submit(SlotAction(action, slot_id, body.filename if body else None),
                                asyncio.get_running_loop())
        except NotReady as exc:
            return error_response(503, str(exc), "server_error", code="unavailable")
        except QueueFull as exc:
            return error_response(429, str(exc), "rate_limit_error", code="queue_full",
                                  headers={"Retry-After": "1"})
        event, payload = await job.events.get()
        if event == "error":
            status, message = payload
            return error_response(status, message, "server_error" if status >= 500
                                  else "invalid_request_error")
        if payload is None:
            return error_response(503, "the server is shutting down", "server_error")
        return JSONResponse(payload)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await generate(request, body, "chat")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await generate(request, body, "completions")

    async def generate(request: Request, body: ChatCompletionRequest | CompletionRequest,
                       kind: str) -> Response:
        try:
            if engine.status != "ready":
                raise engine.not_ready()
            scope = scope_of(config.draft_memory_mode, request.headers.get("authorization"),
                             body.user)
            plan = await anyio.to_thread.run_sync(prepare, engine, body, kind, scope)
            job = engine.submit(plan.item, asyncio.get_running_loop())
        except BadRequest as exc:
            metrics.request(kind, "rejected_invalid")
            return error_response(400, exc.message, param=exc.param, code=exc.code)
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
            return StreamingResponse(stream(job, plan, envelope, body.include_usage),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        return await collect(request, job, plan, envelope)

    def logprobs_of(plan: Plan, result: GenerationResult) -> dict[str, Any] | None:
        if result.logprobs is None:
            return None
        return logprobs_body(plan.item.endpoint, result.logprobs, result.tokens,
                             engine.tokenizer.token_bytes)

    def finish(job: Job, plan: Plan, final: tuple[str, Any],
               parser: ToolCallParser | None) -> Ending:
        """The end of every generation request, streamed or not: what the client is told, from
        the worker's last event and the tool calls `parser` has read from the whole text; the
        request's outcome is counted here."""
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
                        ext=extension(engine, job, result), logprobs=logprobs_of(plan, result))
        if problem:
            metrics.request(kind, "failed")
            return replace(ending, error=(500 if problem[0] else 400, problem[1],
                                          "invalid_output"))
        metrics.request(kind, "completed")
        return ending

    async def collect(request: Request, job: Job, plan: Plan, envelope: Envelope) -> Response:
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
            content, _ = parser.feed(final[1].text)
            content += parser.finish()
        ending = finish(job, plan, final, parser)
        if ending.error is not None:
            status, message, code = ending.error
            return error_response(status, message, error_type(status), code=code)
        result = ending.result
        return JSONResponse(envelope.response(
            result.text if parser is None else content or None, ending.reason, ending.use,
            ending.ext, tool_calls=ending.calls, logprobs=ending.logprobs))

    async def stream(job: Job, plan: Plan, envelope: Envelope,
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
                    piece, deltas = parser.feed(piece)
                    if final is not None:
                        piece += parser.finish()
                if piece or deltas:
                    yield sse(envelope.chunk(piece or None, tool_calls=deltas or None))
            ending = finish(job, plan, final, parser)
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
                metrics.request(job.item.endpoint, "cancelled")

    # The other protocols: thin adapters over `generate` (see relay.py).
    app.include_router(llama_server_api.router(engine, generate))
    app.include_router(ollama_api.router(engine, generate))
    app.include_router(responses_api.router(engine, generate))

    return app


_FIELDS = frozenset().union(*(m.model_fields for m in (
    ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, SpeculationOptions,
    StreamOptions, Tool, FunctionSpec, ResponseFormat, TokenizeRequest, DetokenizeRequest)))


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


def error_type(status: int) -> str:
    return "server_error" if status >= 500 else "invalid_request_error"


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


def _json_bytes(obj: Any) -> bytes:
    """What JSONResponse would send, rendered wherever the caller runs (a worker thread)."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _json_list(key: str, items: list[Any], chunk: int = 4096) -> bytes:
    """`_json_bytes({key: items})`, encoded a slice at a time: json.dumps holds the GIL for
    the whole call, and one call over a million items would stall the event loop for it."""
    parts = [_json_bytes(items[i:i + chunk])[1:-1] for i in range(0, len(items), chunk)]
    return b'{"%s":[%s]}' % (key.encode(), b",".join(parts))


def _piece(data: bytes) -> str | list[int]:
    """llama-server's token piece: text when it is valid UTF-8, else its bytes."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


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


async def _watch_disconnect(request: Request, engine: Engine, job: Job) -> None:
    """Non-streaming requests: cancel the job when the client disconnects while it waits."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.cancel(job)
            return


def _created(stamp: str) -> int:
    from datetime import datetime

    try:
        return int(datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0
