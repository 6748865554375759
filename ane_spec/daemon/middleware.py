"""The daemon's ASGI middlewares (pure ASGI: they must not break streaming or disconnect
detection): the Host check, the Origin check, the API key, the request body's type, size and
timer, and CORS. Their refusals are in the shape of the path's protocol (Ollama's under /api/).
"""

from __future__ import annotations

import hmac
import ipaddress

import anyio
from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ane_spec.daemon.config import ServeConfig, host_name
from ane_spec.daemon.engine import Engine
from ane_spec.daemon.http_errors import endpoint_of, error_for
from ane_spec.daemon.path_aliases import PathAliases
from ane_spec.daemon.relay import PARSED, json_error, parse_json

# Bodies past this size are parsed on a worker thread (the event loop keeps answering /health).
PARSE_ON_THREAD_BYTES = 64 << 10

# Answered without the API key: liveness probes, and llama-server's public /props.
OPEN_PATHS = frozenset({"/health", "/props"})
CORS_METHODS = ["GET", "POST", "OPTIONS"]
CORS_HEADERS = ["Authorization", "Content-Type", "Accept", "OpenAI-Organization",
                "OpenAI-Project", "X-Stainless-Lang", "X-Stainless-Package-Version",
                "X-Stainless-OS", "X-Stainless-Arch", "X-Stainless-Runtime",
                "X-Stainless-Runtime-Version", "X-Stainless-Retry-Count", "X-Stainless-Timeout"]


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
        response = error_for(
            scope["path"], 401, "missing or invalid API key: send the header "
            "'Authorization: Bearer <key>'", "authentication_error", code="invalid_api_key",
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
                    response = error_for(
                        scope["path"], 403, f"the Host header {host[:100]!r} does not name "
                        "this server; add the name with --allowed-hosts if it should",
                        "permission_error", code="host_not_allowed")
                    return await response(scope, receive, send)
                break
        await self.app(scope, receive, send)


class OriginCheck:
    """Cross-site requests, judged by `Origin` as Ollama judges them (gin-contrib/cors in its
    server/routes.go): a browser names the page's origin on every cross-origin request and on
    every POST (the Fetch standard), so a request whose Origin is neither this server itself
    nor one of --allowed-origins is refused with 403, whatever its method, type or body. One
    without Origin comes from no web page (curl, SDKs, editors, litellm). Ollama also lets in,
    by default, pages on any localhost port and app://, file://, tauri:// and vscode-webview://
    origins (OLLAMA_ORIGINS adds more); here only --allowed-origins do (`*` for any), since
    CORS is off by default."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...], engine: Engine):
        self.app, self.engine = app, engine
        self.any = "*" in allowed
        self.allowed = frozenset(o.lower().rstrip("/") for o in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        origins, host = [], ""
        for name, value in scope["headers"]:
            if name == b"origin":
                origins.append(value.decode("latin-1"))
            elif name == b"host":
                host = value.decode("latin-1").lower()
        same = {f"http://{host}", f"https://{host}"}
        foreign = next((o for o in origins if o.lower().rstrip("/") not in self.allowed
                        and o.lower() not in same), None)
        if foreign is None:
            return await self.app(scope, receive, send)
        self.engine.metrics.request(endpoint_of(scope["path"]), "rejected_origin")
        response = error_for(
            scope["path"], 403, f"requests from the web page {foreign[:100]!r} are not "
            "allowed; start the server with --allowed-origins to let that origin in",
            "permission_error", code="origin_not_allowed")
        await response(scope, receive, send)


class BodyGuard:
    """Every request body: JSON and present on routes that change state (POST and the other
    methods that carry one), at most `limit` bytes (413, by Content-Length before reading
    anything and by counting otherwise), and all of it within `seconds` of the headers (408: a
    client trickling one byte at a time cannot hold a connection). The accepted body is
    replayed to the app.

    JSON by Content-Type: `application/json` (or `+json`), or no Content-Type at all, which is
    what litellm's Ollama providers send and Ollama reads as JSON. A form or a text/plain body
    (what a web page can send without a CORS preflight) gets 415: the Origin check refuses
    cross-site pages already, and this keeps out browsers that send no Origin. Methods that
    carry no body here (TRACE, ...) reach the router, which answers 405. The body is parsed
    here, once, by `relay.parse_json` (its limits: digits, depth, surrogates, NaN): the one
    parser every route reads."""

    def __init__(self, app: ASGIApp, limit: int, seconds: float, engine: Engine):
        self.app, self.limit, self.seconds, self.engine = app, limit, seconds, engine

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      message: str, code: str) -> None:
        self.engine.metrics.request(endpoint_of(scope["path"]), "rejected_invalid")
        await error_for(scope["path"], status, message, code=code)(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        changes_state = scope["method"] in BODY_METHODS
        if changes_state and not is_json(headers.get(b"content-type", b"application/json")):
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
        if changes_state and b"content-type" not in headers:  # read as JSON, downstream too
            scope = dict(scope, headers=[*scope["headers"], (b"content-type",
                                                              b"application/json")])
        if changes_state and not body:
            return await self._refuse(scope, receive, send, 400, f"{scope['method']} "
                                      f"{scope['path']} takes a JSON body ({{}} for none)",
                                      "missing_body")
        if changes_state:  # every route's one JSON parser, with its limits (relay.parse_json)
            try:
                if len(body) > PARSE_ON_THREAD_BYTES:
                    scope[PARSED] = await anyio.to_thread.run_sync(parse_json, body)
                else:
                    scope[PARSED] = parse_json(body)
            except (ValueError, UnicodeDecodeError) as exc:
                return await self._refuse(scope, receive, send, 400, json_error(exc),
                                          "invalid_json")
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


# The methods whose body this server reads: POST for every route that takes one, and the other
# methods that carry a body, should a route take one.
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


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


def install_middleware(app: FastAPI, config: ServeConfig, engine: Engine) -> None:
    # Added innermost first: auth runs before the body is even read, and CORS (when allowed)
    # before auth, so a browser's preflight (which carries no credentials) gets its answer and
    # every error response carries the headers a page needs to read it. Before those, the
    # Origin check refuses pages that were not let in; the Host check comes first of all.
    app.add_middleware(BodyGuard, limit=config.max_body_bytes, seconds=config.body_timeout,
                       engine=engine)
    app.add_middleware(BearerAuth, api_key=config.api_key, engine=engine)
    if config.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=CORS_METHODS, allow_headers=CORS_HEADERS,
                           allow_credentials=False, max_age=600)
    app.add_middleware(OriginCheck, allowed=config.allowed_origins, engine=engine)
    allowed_hosts = config.allowed_host_names
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=allowed_hosts, engine=engine)
    app.add_middleware(PathAliases)
