"""Hostile clients: strict request bodies, and connections that never finish their headers.

The timeouts run on the server's real uvicorn settings (`server.uvicorn_config`) and its h11
protocol class over loopback, in front of a minimal ASGI app: what is under test is the HTTP
layer, not the model.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from pydantic import ValidationError

from ane_spec.daemon import server
from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.protocol import ChatCompletionRequest, CompletionRequest

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body,field", [
    ({"stream": "yes"}, "stream"),
    ({"stream": 1}, "stream"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 10.0}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"ane_spec": {"speculative": "true"}}, "ane_spec.speculative"),
    ({"stream_options": {"include_usage": "no"}}, "stream_options.include_usage"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
])
def test_request_fields_are_not_coerced(body: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": MESSAGES} | body)
    locs = {".".join(str(p) for p in e["loc"]) for e in info.value.errors()}
    assert any(loc == field or loc.startswith(field + ".") for loc in locs), locs


def test_well_typed_requests_still_pass() -> None:
    r = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "stream": True, "max_tokens": 5, "temperature": 1, "top_p": 0.5,
         "seed": 2**63, "stop": ["a", "b"], "ane_spec": {"speculative": False, "ngram_max": 3},
         "stream_options": {"include_usage": True}, "unknown_vendor_field": {"x": 1}})
    assert r.stream and r.temperature == 1.0 and r.stops == ("a", "b")
    assert CompletionRequest.model_validate({"prompt": [1, 2, 3]}).single_prompt() == [1, 2, 3]


def test_too_many_stop_strings_says_so() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "stop": ["s"] * 17})
    (error,) = info.value.errors()
    assert error["loc"] == ("stop",)
    assert error["msg"] == "Value error, at most 16 stop strings are allowed, got 17"
    assert CompletionRequest.model_validate({"prompt": "x", "stop": ["s"] * 16}).stops


# --- slow clients -----------------------------------------------------------------------------

async def ok_app(scope, receive, send) -> None:  # noqa: ANN001
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture
def port(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server, "HEADER_TIMEOUT_SECONDS", 0.6)
    monkeypatch.setattr(server, "KEEP_ALIVE_SECONDS", 0.6)
    config = ServeConfig(manifest=Path("unused"), port=0, log_level="critical",
                         access_log=False)
    srv = uvicorn.Server(server.uvicorn_config(
        ok_app, config, log_config={"version": 1, "disable_existing_loggers": False}))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive()
        time.sleep(0.01)
    yield srv.servers[0].sockets[0].getsockname()[1]
    srv.should_exit = True
    thread.join(10)


def closed_after(sock: socket.socket, dribble: bytes = b"", every: float = 0.15,
                 limit: float = 10.0) -> float:
    """Seconds until the server closes `sock`, sending `dribble` one byte per `every` s."""
    sock.settimeout(every)
    t0 = time.monotonic()
    sent = 0
    while time.monotonic() - t0 < limit:
        try:
            data = sock.recv(4096)
            if not data:
                return time.monotonic() - t0
        except socket.timeout:
            pass
        except ConnectionResetError:
            return time.monotonic() - t0
        if sent < len(dribble):
            try:
                sock.sendall(dribble[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - t0
            sent += 1
    raise AssertionError(f"still open after {limit} s")


REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def response(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while not data.endswith(b"\r\n\r\nok"):
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    return data


def test_silent_client_is_disconnected(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert 0.5 <= closed_after(sock) < 5


def test_dribbled_headers_are_cut_off(port: int) -> None:
    """Bytes keep arriving, but the headers never finish: the deadline still applies."""
    dribble = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", port)) as sock:
        assert 0.5 <= closed_after(sock, dribble) < 5


def test_idle_keep_alive_and_a_slow_second_request_are_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(REQUEST)
        assert response(sock).startswith(b"HTTP/1.1 200 OK")
        assert 0.5 <= closed_after(sock) < 5  # keep-alive timeout
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(REQUEST)
        assert response(sock).startswith(b"HTTP/1.1 200 OK")
        assert 0.5 <= closed_after(sock, b"GET / HTTP/1.1\r\nHost: " + b"y" * 200) < 5


def test_prompt_clients_are_served_on_one_connection(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for _ in range(3):
            sock.sendall(REQUEST[:10])
            time.sleep(0.1)
            sock.sendall(REQUEST[10:])
            assert response(sock).startswith(b"HTTP/1.1 200 OK")


def test_content_part_types_that_are_not_strings_are_refused() -> None:
    """Found by test_daemon's hypothesis fuzz: {'type': []} crashed the validator (a 500)."""
    for kind in ([], {}, 3, None):
        with pytest.raises(ValidationError, match="string 'type'"):
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": [{"type": kind, "text": "hi"}]}]})
