"""The daemon's operations on real uvicorn servers: queueing, client disconnects, warm-up, auth,
unsafe configs, the foreground `serve` process and the macOS LaunchAgent.

Slow generations come from a test-side pipeline wrapper (tests/paced_pipeline.py: a wait before
every pass); nothing here asserts on durations, waits are bounded polls of /health and /metrics.
"""

from __future__ import annotations

import contextlib
import json
import os
import plistlib
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import ValidationError

from ane_spec.daemon.config import ServeConfig, ServeConfigError
from ane_spec.daemon.engine import Engine, load_pipeline
from ane_spec.daemon.launchd import LABEL, install_launch_agent, serve_arguments
from ane_spec.daemon.server import BackgroundServer, serve
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.model.chat import render_chat
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build
from tests.paced_pipeline import PacedPipeline

S = 128
PASS_DELAY = 0.1  # seconds before every pass on the slow server
LONG = 100        # max_tokens of a generation meant to be interrupted (>= 25 passes)
STORY = [{"role": "user", "content": "tell me a long story"}]
OTHER = [{"role": "user", "content": "something else"}]


@pytest.fixture(scope="module")
def artifacts(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("daemon-ops") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S))
    return out


def config(artifacts: Path, **kw) -> ServeConfig:
    return ServeConfig(**{"manifest": artifacts, "port": 0, "backend": "mil", "precision": "fp32",
                          "log_level": "warning", "access_log": False, **kw})


def paced_server(cfg: ServeConfig, **pacing) -> BackgroundServer:
    """A real server whose pipeline is wrapped from the test side (see PacedPipeline)."""
    return BackgroundServer(cfg, engine=Engine(cfg, PacedPipeline(load_pipeline(cfg), **pacing)))


@contextlib.contextmanager
def _released(gate: threading.Event):
    """Whatever the test asserts, let the held warm-up finish so the server can stop."""
    try:
        yield
    finally:
        gate.set()


def poll(url: str, predicate, what: str, timeout: float = 30.0):
    """GET url (JSON, or Prometheus text parsed to a dict) until predicate holds."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url, timeout=10)
        value = r.json() if url.endswith("/health") else metrics_dict(r.text)
        if predicate(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}: {value}")
        time.sleep(0.02)


def metrics_dict(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def ready(url: str) -> dict:
    return poll(f"{url}/health", lambda h: h["status"] == "ok", "readiness", 60)


@pytest.fixture(scope="module")
def slow(artifacts: Path):
    with paced_server(config(artifacts, max_queue=1), pass_delay=PASS_DELAY) as srv:
        srv.health = ready(srv.url)
        yield srv


@pytest.fixture(scope="module")
def pipeline(slow, artifacts: Path):
    return open_pipeline(artifacts, "mil", "fp32")[1]


def fresh(pipeline, messages, max_tokens: int) -> str:
    tok = pipeline.tokenizer
    prompt = tok.encode(render_chat(messages, template=tok.data.chat_template), special=True)
    return DecodeSession(pipeline).generate(prompt, GenerateOptions(max_tokens=max_tokens)).text


def open_stream(client: httpx.Client, messages, max_tokens: int = LONG):
    """Start a streaming chat and return (context manager, response, line iterator)."""
    cm = client.stream("POST", "/v1/chat/completions",
                       json={"messages": messages, "max_tokens": max_tokens, "stream": True})
    response = cm.__enter__()
    assert response.status_code == 200
    return cm, response, response.iter_lines()


def read_until_text(lines) -> str:
    for line in lines:
        if line.startswith("data: {"):
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                return delta["content"]
    raise AssertionError("the stream ended before any text")


def counter(values: dict, name: str) -> float:
    return values.get(name, 0.0)


CANCELLED = 'ane_spec_generations_total{finish_reason="cancelled"}'


def test_disconnect_mid_stream_cancels_and_the_next_request_is_correct(slow, pipeline) -> None:
    url = slow.url
    before = metrics_dict(httpx.get(f"{url}/metrics").text)
    with httpx.Client(base_url=url, timeout=30) as client:
        cm, response, lines = open_stream(client, STORY)
        read_until_text(lines)
        cm.__exit__(None, None, None)  # the client drops the connection mid-stream
    after = poll(f"{url}/metrics", lambda m: counter(m, CANCELLED) == counter(before, CANCELLED) + 1
                 and m["ane_spec_generation_in_progress"] == 0, "the cancelled generation")
    generated = (after["ane_spec_generated_tokens_total"]
                 - before.get("ane_spec_generated_tokens_total", 0))
    assert 1 <= generated < LONG
    assert counter(after, 'ane_spec_requests_total{endpoint="chat",outcome="cancelled"}') >= 1
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    # The same conversation again (its prefix is in the cache, half-generated) and another one.
    for messages in (STORY, OTHER, STORY):
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        assert r.choices[0].message.content == fresh(pipeline, messages, 8)


def test_queue_full_is_429_and_health_answers_during_generation(slow, pipeline) -> None:
    url = slow.url
    with httpx.Client(base_url=url, timeout=30) as a, httpx.Client(base_url=url, timeout=30) as b:
        cm_a, _, lines_a = open_stream(a, STORY)
        read_until_text(lines_a)                     # A runs
        cm_b, _, _ = open_stream(b, OTHER)           # B waits: the queue (max_queue=1) is full
        health = poll(f"{url}/health", lambda h: h["queue_depth"] == 1, "B queued")
        assert health["busy"] and health["status"] == "ok"
        m = metrics_dict(httpx.get(f"{url}/metrics").text)
        assert m["ane_spec_queue_depth"] == 1 and m["ane_spec_generation_in_progress"] == 1
        r = httpx.post(f"{url}/v1/chat/completions", json={"messages": OTHER, "max_tokens": 4})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0).completions.create(
                model="m", prompt="hi", max_tokens=2, stream=True)
        cm_a.__exit__(None, None, None)
        cm_b.__exit__(None, None, None)
    poll(f"{url}/health", lambda h: not h["busy"] and h["queue_depth"] == 0, "an idle worker")
    m = metrics_dict(httpx.get(f"{url}/metrics").text)
    assert counter(m, 'ane_spec_requests_total{endpoint="chat",outcome="rejected_queue_full"}') == 1
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": OTHER, "max_tokens": 6})
    assert r.json()["choices"][0]["message"]["content"] == fresh(pipeline, OTHER, 6)


def test_non_streaming_client_that_leaves_the_queue_frees_its_place(slow) -> None:
    url = slow.url
    with httpx.Client(base_url=url, timeout=30) as a:
        cm_a, _, lines_a = open_stream(a, STORY)
        read_until_text(lines_a)
        with pytest.raises(httpx.ReadTimeout):  # waits behind A, then gives up and disconnects
            httpx.post(f"{url}/v1/chat/completions", json={"messages": OTHER, "max_tokens": 4},
                       timeout=httpx.Timeout(30, read=0.5))
        poll(f"{url}/health", lambda h: h["queue_depth"] == 0, "the abandoned request to leave")
        assert httpx.get(f"{url}/health").json()["busy"]
        cm_a.__exit__(None, None, None)
    poll(f"{url}/health", lambda h: not h["busy"], "an idle worker")


def poll_running_slot(url: str, predicate, timeout: float = 30.0) -> dict:
    """The one running /slots row, once predicate holds for it."""
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for r in httpx.get(f"{url}/slots", timeout=10).json()["slots"]
                if r["state"] == "running"]
        assert len(rows) <= 1, rows
        if rows and predicate(rows[0]):
            return rows[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for the running slot: {rows}")
        time.sleep(0.02)


def post_over_socket(url: str, path: str, body: dict) -> socket.socket:
    """Send a whole POST and leave the connection open: the client is gone when the test closes
    the socket, not when a timer it races fires."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)), timeout=10)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def test_work_for_a_departed_client_stops_and_shows_while_it_runs(slow, pipeline) -> None:
    """Output made only of invisible special tokens never produced text, so the old disconnect
    check (on text) never ran and the worker filled the context for nobody. Now every pass
    asks; meanwhile /health says what the worker is on, and /slots shows the conversation.

    The paced pipeline holds every pass PASS_DELAY s, so the whole context (>= 32 passes of at
    most 4 tokens) takes >= 3.2 s. The client leaves by closing its socket once the test has seen
    the generation run: a client on a 0.5 s read timeout left before a loaded CI machine's polls
    saw the slot (and on the hostile suite's unpaced server a quiet machine finished the 126
    tokens inside the timeout)."""
    url, tok = slow.url, pipeline.tokenizer
    invisible = tok.encode("<|tool|>", special=True)[0]
    room = S - 2
    before = metrics_dict(httpx.get(f"{url}/metrics").text)
    client = post_over_socket(url, "/v1/completions", {
        "prompt": [5, 6], "max_tokens": room, "logit_bias": {str(invisible): 100}})
    try:
        health = poll(f"{url}/health", lambda h: h["running"] is not None,
                      "the generation to start")
        running = health["running"]
        assert running["task"] == "completions" and running["prompt_tokens"] == 2
        assert running["seconds"] >= 0 and health["busy"]
        row = poll_running_slot(url, lambda r: r["tokens"] >= 2)  # once the paced prefill ran
        assert row["prompt_tokens"] == 2 and row["running_seconds"] >= 0
        client.settimeout(0)
        with pytest.raises(BlockingIOError):  # still running: no answer has come back
            client.recv(1)
    finally:
        client.close()
    after = poll(f"{url}/metrics", lambda m: counter(m, CANCELLED) == counter(before, CANCELLED) + 1
                 and m["ane_spec_generation_in_progress"] == 0, "the cancelled generation")
    generated = (after["ane_spec_generated_tokens_total"]
                 - before.get("ane_spec_generated_tokens_total", 0))
    assert generated < room * 0.8, generated  # it used to run to the end of the context


def test_mixed_decode_shape_warms_both_widths_and_calibrates_the_guard(artifacts: Path) -> None:
    with BackgroundServer(config(artifacts, decode_shape="mixed")) as srv:
        health = ready(srv.url)
        assert health["decode_shape"] == "mixed" and health["guard_margin"] > 0
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "def f(x):",
                                                          "max_tokens": 12}).json()
        assert r["ane_spec"]["decode_shape"] == "mixed"
        assert r["ane_spec"]["stats"]["decode_shape"] == "mixed"
        # The server recorded the drift it measured, so this session guards the same way.
        _, mixed = open_pipeline(artifacts, "mil", "fp32", decode_shape="mixed", verify=False)
        prompt = mixed.tokenizer.encode("def f(x):", special=True)
        local = DecodeSession(mixed, fill_drafts=health["fill_drafts"]).generate(
            prompt, GenerateOptions(max_tokens=12))
        assert r["choices"][0]["text"] == local.text


def test_warming_up_is_503_with_retry_after(artifacts: Path) -> None:
    gate = threading.Event()
    with paced_server(config(artifacts), warm_gate=gate) as srv, _released(gate):
        r = httpx.get(f"{srv.url}/health")
        health = r.json()
        assert r.status_code == 503 and health["status"] == "loading"
        assert {"step", "done", "total", "fraction"} <= set(health["progress"])
        # The fixed decode shape warms one pass width: 2 shards + the head at T=4; the build's
        # prefill function (P=64) its 2 shards at T=64, and its pass costs are measured once.
        # No T=1 specialisation, no pass-cost policy, no drift calibration.
        assert health["progress"]["total"] == 6 and health["progress"]["done"] == 0
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "warming_up"
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="m", prompt="hi", max_tokens=3)
        m = metrics_dict(httpx.get(f"{srv.url}/metrics").text)
        assert m["ane_spec_ready"] == 0
        assert m['ane_spec_requests_total{endpoint="completions",outcome="rejected_warming"}'] == 2
        gate.set()
        health = ready(srv.url)
        assert health["warmup_seconds"] > 0
        r = client.completions.create(model="m", prompt="hi", max_tokens=3)
        assert r.usage.completion_tokens == 3


def test_api_key(artifacts: Path) -> None:
    key = "s3cret-key"
    with BackgroundServer(config(artifacts, api_key=key)) as srv:
        ready(srv.url)  # /health needs no key
        chat = f"{srv.url}/v1/chat/completions"
        body = {"messages": OTHER, "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"},
                        {"Authorization": f"Bearer {key}x"}, {"Authorization": key}):
            r = httpx.post(chat, json=body, headers=headers)
            assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/metrics").status_code == 401
        assert httpx.get(f"{srv.url}/v1/models").status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)
        assert good.chat.completions.create(model="m", messages=OTHER,
                                            max_tokens=3).usage.completion_tokens == 3
        assert httpx.post(chat, json=body, headers={"authorization": f"bearer {key}"}
                          ).status_code == 200
        m = metrics_dict(httpx.get(f"{srv.url}/metrics",
                                   headers={"Authorization": f"Bearer {key}"}).text)
        assert m['ane_spec_requests_total{endpoint="chat",outcome="rejected_unauthorized"}'] == 5


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.20", "example.com"])
def test_public_host_needs_a_key(artifacts: Path, host: str) -> None:
    with pytest.raises(ValidationError, match="without an API key"):
        ServeConfig(manifest=artifacts, host=host)
    with pytest.raises(ServeConfigError, match=f"refusing to serve on '{host}' without an API"):
        ServeConfig.create(manifest=artifacts, host=host, api_key=None)
    assert ServeConfig(manifest=artifacts, host=host, api_key="k").public


def test_config_checks(artifacts: Path, tmp_path: Path) -> None:
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert not ServeConfig(manifest=artifacts, host=host).public
    with pytest.raises(ServeConfigError, match="API key is empty"):
        ServeConfig.create(manifest=artifacts, api_key=" ")
    with pytest.raises(ServeConfigError, match="ngram_max"):
        ServeConfig.create(manifest=artifacts, ngram_min=5, ngram_max=2)
    with pytest.raises(ServeConfigError, match="port"):
        ServeConfig.create(manifest=artifacts, port=70000)
    with pytest.raises(AneSpecError, match="no manifest"):  # refused before binding anything
        serve(ServeConfig(manifest=tmp_path / "nothing", port=0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_foreground_serve_process_and_clean_shutdown(artifacts: Path) -> None:
    """`serve(config)` as the CLI runs it, in its own process: warms up, answers, and shuts
    down cleanly on SIGTERM (what launchd sends)."""
    port = free_port()
    cfg = config(artifacts, port=port, log_level="info").model_dump_json()
    code = ("import sys; from ane_spec.daemon.config import ServeConfig; "
            "from ane_spec.daemon.server import serve; "
            "sys.exit(serve(ServeConfig.model_validate_json(sys.argv[1])))")
    proc = subprocess.Popen([sys.executable, "-c", code, cfg], stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health").json()["status"] == "ok":
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down gracefully, then re-raises the signal so the exit status says why.
        assert proc.wait(30) == -signal.SIGTERM
        log = proc.stderr.read()
        assert "warm-up" in log and "ready:" in log and "Application shutdown complete" in log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- the LaunchAgent --------------------------------------------------------------------------

def test_launch_agent_printed_off_macos(artifacts: Path, tmp_path: Path) -> None:
    cfg = ServeConfig(manifest=artifacts, port=8123, backend="mil", max_queue=3)
    for kw in ({"platform": "linux"}, {"platform": "darwin", "print_only": True}):
        result = install_launch_agent(cfg, home=tmp_path, **kw)
        assert not result.written and "nothing written" in result.message
        assert str(tmp_path / "Library/LaunchAgents" / f"{LABEL}.plist") in result.message
        assert not (tmp_path / "Library").exists()
        agent = plistlib.loads(result.plist)
        assert agent["Label"] == LABEL and agent["RunAtLoad"] and agent["KeepAlive"]
        # launchd.plist(5): without it, "light resource limits" throttle CPU and I/O.
        assert agent["ProcessType"] == "Interactive"
        args = agent["ProgramArguments"]
        assert args[:4] == [sys.executable, "-m", "ane_spec.cli", "serve"]
        assert args[args.index("--manifest") + 1] == str(artifacts.resolve())
        assert args[args.index("--port") + 1] == "8123"
        assert args[args.index("--max-queue") + 1] == "3"
        assert agent["StandardOutPath"].startswith(str(tmp_path / "Library/Logs"))
        assert "EnvironmentVariables" not in agent


def test_launch_agent_needs_a_build(tmp_path: Path) -> None:
    with pytest.raises(AneSpecError, match="no manifest"):
        install_launch_agent(ServeConfig(manifest=tmp_path / "missing"), home=tmp_path,
                             platform="darwin")
    assert not (tmp_path / "Library").exists()


def test_launch_agent_written_on_macos(artifacts: Path, tmp_path: Path) -> None:
    cfg = ServeConfig(manifest=artifacts, api_key="k3y", host="0.0.0.0", speculative=False)
    result = install_launch_agent(cfg, home=tmp_path, platform="darwin")
    path = tmp_path / "Library/LaunchAgents" / f"{LABEL}.plist"
    assert result.written and result.plist_path == path and "launchctl bootstrap" in result.message
    agent = plistlib.loads(path.read_bytes())
    assert agent["EnvironmentVariables"] == {"ANE_SPEC_API_KEY": "k3y"}
    assert "k3y" not in " ".join(agent["ProgramArguments"])  # never on a command line
    assert "--no-speculative" in agent["ProgramArguments"]
    assert path.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "Library/Logs/ane-spec").is_dir()
    printed = install_launch_agent(cfg, home=tmp_path, platform="darwin", print_only=True)
    assert b"k3y" not in printed.plist and b"ANE_SPEC_API_KEY" in printed.plist


def test_launch_agent_command_parses_with_the_cli(artifacts: Path) -> None:
    """The plist's command must parse with the CLI's `serve`: a parse failure is a bug."""
    from ane_spec.cli import build_parser

    parser = build_parser()
    cfg = ServeConfig(manifest=artifacts, port=8123, max_queue=3, ngram_max=6, guard=False,
                      verify=False, decode_shape="mixed")
    argv = serve_arguments(cfg)[3:]
    try:
        args = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`ane-spec serve` does not parse the LaunchAgent's arguments: {argv}")
    assert Path(args.manifest).resolve() == artifacts.resolve()
    assert (args.port, args.max_queue, args.ngram_max) == (8123, 3, 6)
    assert args.no_guard and args.no_verify and not args.no_speculative
    assert args.decode_shape == "mixed"
    assert os.fspath(args.backend) == cfg.backend
