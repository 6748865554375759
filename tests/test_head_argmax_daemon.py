"""A --head-argmax build behind a real server: the daemon refuses exactly what the decode session
refuses, for the same reason, naming the parameter that asked for logits (one decision,
`session.needs_logits`), and serves plain greedy requests token-identically to the session."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.server import BackgroundServer
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.errors import AneSpecError
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def argmax_build(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("argmax") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=128, head_argmax=True))
    return out


@pytest.fixture(scope="module")
def server(argmax_build: Path):
    cfg = ServeConfig(manifest=argmax_build, port=0, backend="mil", precision="fp32",
                      log_level="warning", access_log=False)
    with BackgroundServer(cfg) as srv:
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.02)
        yield srv


@pytest.mark.parametrize(("body", "options", "param"), [
    ({"temperature": 0.7}, GenerateOptions(sampling=SamplingParams(temperature=0.7)),
     "temperature"),
    ({"logprobs": 2}, GenerateOptions(logprobs=2), "logprobs"),
    # repeat_penalty 1 is off: the parameter that asks for logits is logit_bias
    ({"logit_bias": {"5": 3}, "repeat_penalty": 1.0},
     GenerateOptions(sampling=SamplingParams(logit_bias=((5, 3.0),))), "logit_bias"),
    ({"frequency_penalty": 0.5, "repeat_penalty": 1.0},
     GenerateOptions(sampling=SamplingParams(frequency_penalty=0.5)), "frequency_penalty"),
])
def test_server_and_session_refuse_alike(server, argmax_build: Path, body: dict,
                                         options: GenerateOptions, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": "def f(x):", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    _, pipeline = open_pipeline(argmax_build, "mil", "fp32", verify=False)
    with pytest.raises(AneSpecError) as refused:
        DecodeSession(pipeline).generate([5, 6, 7], options)
    assert (error["param"], error["message"]) == (param, str(refused.value))


def test_constraints_name_their_parameter_and_plain_greedy_is_served(server,
                                                                      argmax_build: Path) -> None:
    chat = f"{server.url}/v1/chat/completions"
    ask = [{"role": "user", "content": "weather?"}]
    r = httpx.post(chat, json={"messages": ask, "tools": [WEATHER], "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
    assert "cannot do tools" in r.json()["error"]["message"]
    r = httpx.post(chat, json={"messages": ask, "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 12})
    assert r.status_code == 200, r.text
    _, pipeline = open_pipeline(argmax_build, "mil", "fp32", verify=False)
    local = DecodeSession(pipeline).generate([5, 6, 7], GenerateOptions(max_tokens=12))
    assert r.json()["choices"][0]["text"] == local.text
