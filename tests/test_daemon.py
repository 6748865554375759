"""The daemon's HTTP API on a real uvicorn server over a tiny build, through the openai client.

Every text the server returns is checked against `DecodeSession.generate` on the same prompt
tokens in this process (what `ane-spec generate` runs), streamed and not.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ane_spec.daemon.config import ServeConfig
from ane_spec.daemon.server import BackgroundServer
from ane_spec.decode.sampling import SamplingParams
from ane_spec.decode.session import DecodeSession, GenerateOptions
from ane_spec.model.chat import render_chat
from ane_spec.probes.gates import open_pipeline
from ane_spec.shards.build import BuildRequest, build

S = 128


@pytest.fixture(scope="module")
def artifacts(tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("daemon") / "art"
    build(tiny_gguf, out, BuildRequest(topology="2,1", max_seq=S))
    return out


def wait_ready(url: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/health")
        health = r.json()
        if health["status"] == "ok":
            assert r.status_code == 200
            return health
        assert health["status"] == "loading" and r.status_code == 503, health
        time.sleep(0.02)
    raise AssertionError("the server did not become ready")


@pytest.fixture(scope="module")
def server(artifacts: Path):
    config = ServeConfig(manifest=artifacts, port=0, backend="mil", precision="fp32",
                         log_level="warning", access_log=False)
    with BackgroundServer(config) as srv:
        srv.health = wait_ready(srv.url)
        yield srv


@pytest.fixture(scope="module")
def pipeline(server, artifacts: Path):
    """Opened after the server's warm-up recorded the drift, so the guard matches."""
    return open_pipeline(artifacts, "mil", "fp32")[1]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def chat_tokens(pipeline, messages: list[dict]) -> list[int]:
    tok = pipeline.tokenizer
    return tok.encode(render_chat(messages, template=tok.data.chat_template), special=True)


def reference(pipeline, prompt: list[int], server=None, **options):
    """A fresh session, as `ane-spec generate` runs it (the server's draft-fill policy, which
    only matters to sampling's random stream)."""
    fill = None if server is None else server.health["fill_drafts"]
    return DecodeSession(pipeline, fill_drafts=fill).generate(prompt, GenerateOptions(**options))


def stream_chat(client, **kw) -> tuple[str, str, dict, object]:
    parts, reason, ext, use = [], None, None, None
    for chunk in client.chat.completions.create(stream=True,
                                                stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            use = chunk.usage
        if chunk.choices:
            choice = chunk.choices[0]
            parts.append(choice.delta.content or "")
            reason = choice.finish_reason or reason
            ext = (chunk.model_extra or {}).get("ane_spec", ext)
    return "".join(parts), reason, ext, use


def stream_completion(client, **kw) -> tuple[str, str, dict]:
    parts, reason, ext = [], None, None
    for chunk in client.completions.create(stream=True, **kw):
        parts.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
        ext = (chunk.model_extra or {}).get("ane_spec", ext)
    return "".join(parts), reason, ext


CHATS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why?"}],
    [{"role": "user", "content": [{"type": "text", "text": "two "},
                                  {"type": "text", "text": "parts"}]}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_matches_the_engine(client, server, pipeline, messages) -> None:
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in messages]
    prompt = chat_tokens(pipeline, flat)
    ref = reference(pipeline, prompt, max_tokens=40)
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=40)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == "length" == ref.finish_reason
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ref.tokens)
    text, reason, ext, use = stream_chat(client, model="any", messages=messages, max_tokens=40)
    assert (text, reason) == (ref.text, "length")
    assert use.completion_tokens == len(ref.tokens)
    assert ext["stats"]["generated_tokens"] == len(ref.tokens) and ext["speculative"]

    # A stop sequence straddling passes: cut from the middle of the reference text.
    stop = ref.text[10:13]
    assert stop and stop not in ref.text[:12]
    expected = ref.text[:ref.text.index(stop)]
    r = client.chat.completions.create(model="any", messages=messages, max_tokens=40,
                                       stop=[stop, "never-in-output"])
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (expected, "stop")
    assert stream_chat(client, model="any", messages=messages, max_tokens=40,
                       stop=stop)[:2] == (expected, "stop")
    assert reference(pipeline, prompt, max_tokens=40, stop=(stop,)).text == expected


def test_completions_text_and_token_prompts(client, pipeline) -> None:
    tok = pipeline.tokenizer
    for prompt_text in ("Once upon a time", "x"):
        prompt = tok.encode(prompt_text, special=True)
        ref = reference(pipeline, prompt, max_tokens=30)
        r = client.completions.create(model="m", prompt=prompt_text, max_tokens=30)
        assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "length")
        assert r.usage.prompt_tokens == len(prompt)
        assert stream_completion(client, model="m", prompt=prompt_text, max_tokens=30)[:2] == \
            (ref.text, "length")
        # the same prompt as token ids, and as a one-element batch
        r = client.completions.create(model="m", prompt=prompt, max_tokens=30)
        assert r.choices[0].text == ref.text
        r = client.completions.create(model="m", prompt=[prompt_text], max_tokens=30)
        assert r.choices[0].text == ref.text
    # OpenAI's default max_tokens for completions is 16
    r = client.completions.create(model="m", prompt="Once upon a time")
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


def test_end_of_generation_is_finish_stop(client, pipeline) -> None:
    """A prompt whose greedy continuation hits an end-of-generation token: "stop"."""
    tok = pipeline.tokenizer
    eog = sorted(tok.eog_ids)
    for seed in range(200):
        prompt = [(seed * 37 + 11 * i) % 900 + 1 for i in range(6)]
        ref = reference(pipeline, prompt, max_tokens=60)
        if ref.finish_reason == "stop":
            break
    else:
        pytest.skip(f"no prompt tried ends in one of {eog}")
    r = client.completions.create(model="m", prompt=prompt, max_tokens=60)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (ref.text, "stop")
    assert r.usage.completion_tokens == len(ref.tokens)


def test_sampling_with_a_seed(client, server, pipeline) -> None:
    prompt = chat_tokens(pipeline, CHATS[0])
    for speculative in (True, False):
        kw = dict(model="m", messages=CHATS[0], max_tokens=30, temperature=0.9, top_p=0.95,
                  seed=1234, extra_body={"ane_spec": {"speculative": speculative}})
        ref = reference(pipeline, prompt, server, max_tokens=30, speculative=speculative,
                        sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=1234))
        r = client.chat.completions.create(**kw)
        assert r.choices[0].message.content == ref.text
        assert stream_chat(client, **kw)[0] == ref.text
        assert r.model_extra["ane_spec"]["speculative"] is speculative


def test_speculation_settings_and_stats(client, pipeline) -> None:
    prompt = chat_tokens(pipeline, CHATS[1])
    ref = reference(pipeline, prompt, max_tokens=40)
    seen = []
    for ext in ({"speculative": False}, {"ngram_min": 2, "ngram_max": 3}, {"guard": False},
                {"ngram_min": 6}):
        r = client.chat.completions.create(model="m", messages=CHATS[1], max_tokens=40,
                                           extra_body={"ane_spec": ext})
        assert r.choices[0].message.content == ref.text  # greedy: settings never change text
        info = r.model_extra["ane_spec"]
        seen.append(info)
        for key, value in ext.items():
            assert info[key] == value
    plain, spec = seen[0]["stats"], seen[1]["stats"]
    assert plain["tokens_per_pass"] == 1.0 and plain["acceptance"] == 0.0
    assert spec["passes"] <= plain["passes"]
    assert seen[3]["ngram_max"] == 6  # raised to ngram_min when not given
    assert {"prompt_tokens", "reused_prefix_tokens", "prefill_tokens", "decode_tok_s",
            "tokens_per_pass", "acceptance", "guard_interventions"} <= set(spec)


def test_three_turn_chat_prefills_only_new_tokens(client, server, pipeline) -> None:
    """Each turn reuses the whole previous conversation from the KV cache (exactly what a local
    session with the same history reuses), and gives what a fresh session gives."""
    mirror = DecodeSession(pipeline, fill_drafts=server.health["fill_drafts"])
    history: list[dict] = [{"role": "system", "content": "Be brief."}]
    previous_prompt = None
    for n, user in enumerate(["hello there", "and then what", "tell me more"]):
        history.append({"role": "user", "content": user})
        prompt = chat_tokens(pipeline, history)
        local = mirror.generate(prompt, GenerateOptions(max_tokens=12))
        fresh = reference(pipeline, prompt, max_tokens=12)
        stream = n == 1
        if stream:
            text, _, ext, _ = stream_chat(client, model="m", messages=history, max_tokens=12)
        else:
            r = client.chat.completions.create(model="m", messages=history, max_tokens=12)
            text, ext = r.choices[0].message.content, r.model_extra["ane_spec"]
        assert text == fresh.text == local.text
        stats = ext["stats"]
        assert stats["prompt_tokens"] == len(prompt)
        assert stats["prefill_tokens"] == len(prompt) - stats["reused_prefix_tokens"]
        if n:
            assert stats["reused_prefix_tokens"] == local.stats.reused_prefix_tokens
            assert stats["reused_prefix_tokens"] >= len(previous_prompt)
            assert stats["prefill_tokens"] <= len(prompt) - len(previous_prompt)
        previous_prompt = prompt
        history.append({"role": "assistant", "content": text})


def test_health_models_and_metrics(server, client) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["context"] == S
    # The fixed decode shape: exact by construction, so no guard and every draft slot filled.
    assert health["decode_shape"] == "fixed" and health["guard_margin"] is None
    assert health["fill_drafts"] is True
    models = client.models.list()
    assert [m.id for m in models.data] == [health["model"]]
    assert client.models.retrieve(health["model"]).id == health["model"]
    client.chat.completions.create(model="m", messages=CHATS[0], max_tokens=5)
    client.chat.completions.create(model="m", messages=CHATS[0] + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}],
        max_tokens=5)
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = parse_metrics(r.text)
    for name in ("ane_spec_queue_depth", "ane_spec_prompt_tokens_total",
                 "ane_spec_generated_tokens_total", "ane_spec_reused_prefix_tokens_total",
                 "ane_spec_decode_tokens_per_second", "ane_spec_tokens_per_pass",
                 "ane_spec_draft_acceptance", "ane_spec_guard_interventions_total",
                 "ane_spec_warmup_seconds", "ane_spec_time_to_first_token_seconds_count"):
        assert name in values, name
    assert values['ane_spec_requests_total{endpoint="chat",outcome="completed"}'] >= 2
    assert values["ane_spec_reused_prefix_tokens_total"] > 0
    assert values["ane_spec_ready"] == 1 and values["ane_spec_queue_depth"] == 0


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        m = re.fullmatch(r'([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)', line)
        assert m, f"not a Prometheus sample line: {line!r}"
        values[m.group(1)] = float(m.group(2))
    return values


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_limits_and_bad_requests(server, pipeline) -> None:
    url = server.url
    chat, comp = f"{url}/v1/chat/completions", f"{url}/v1/completions"
    msgs = CHATS[0]
    n = len(chat_tokens(pipeline, msgs))
    # Like llama-server, a max_tokens past the room left is capped to it (finish "length");
    # only a prompt that leaves no room at all is refused.
    r = httpx.post(chat, json={"messages": msgs, "max_tokens": S + 5, "logit_bias": {
        str(t): -100 for t in pipeline.tokenizer.eog_ids}}, timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == S - n
    e = error_of(httpx.post(comp, json={"prompt": "x " * 400}), 400)
    assert e["code"] == "context_length_exceeded" and f"{S} tokens" in e["message"]
    for body, param in [
        ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"messages": msgs, "max_tokens": "ten"}, "max_tokens"),
        ({"messages": msgs, "temperature": -1}, "temperature"),
        ({"messages": msgs, "top_p": -0.1}, "top_p"),
        ({"messages": msgs, "n": 3}, "n"),
        ({"messages": msgs, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": msgs, "stream": "yes"}, "stream"),
        ({"messages": msgs, "max_tokens": 5.0}, "max_tokens"),
        ({"messages": msgs, "stop": ["x" * 513]}, "stop"),
        ({"messages": msgs, "mirostat": 2}, "mirostat"),
        ({"messages": msgs, "logit_bias": {"hello": 1}}, "logit_bias"),
        ({"messages": msgs, "logit_bias": {"1": 500}}, "logit_bias"),
        ({"messages": msgs, "tool_choice": "required"}, "tool_choice"),
        ({"messages": msgs, "functions": [{"name": "f"}]}, "functions"),
        ({"messages": msgs, "response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": msgs, "response_format": {"type": "json_object"}, "ignore_eos": True},
         "ignore_eos"),
        ({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages.0"),
        ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0"),
        ({"messages": msgs, "stop": 5}, "stop"),
        ({"messages": msgs, "stream": "yes"}, "stream"),
        ({"messages": msgs, "max_tokens": 4.0}, "max_tokens"),
        ({"messages": msgs, "ane_spec": {"ngram_min": 0}}, "ane_spec.ngram_min"),
        ({"messages": msgs, "ane_spec": {"ngram_min": 4, "ngram_max": 2}}, "ane_spec.ngram_max"),
        ({"messages": msgs, "ane_spec": {"bogus": 1}}, "ane_spec.bogus"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages.0.role"),
        ({"messages": "hello"}, "messages"),
        ({}, "messages"),
    ]:
        e = error_of(httpx.post(chat, json=body), 400)
        assert e["param"] == param, (body, e)
    for body, param in [({"prompt": [1, 5000]}, "prompt"), ({"prompt": [-1]}, "prompt"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
                        ({"prompt": "a", "echo": True}, "echo"), ({"max_tokens": 3}, "prompt")]:
        e = error_of(httpx.post(comp, json=body), 400)
        assert e["param"] == param, (body, e)
    e = error_of(httpx.post(chat, content=b'{"messages": [', headers={
        "content-type": "application/json"}), 400)
    assert "not valid JSON" in e["message"]
    error_of(httpx.post(chat, content=b"\xff\xfe", headers={"content-type": "application/json"}),
             400)
    error_of(httpx.post(chat, content=b"messages=1", headers={
        "content-type": "application/x-www-form-urlencoded"}), 415)  # not JSON: refused unread
    error_of(httpx.post(chat, content=b"messages=1"), 400)  # no Content-Type: read as JSON
    error_of(httpx.post(chat, json=[1, 2]), 400)
    error_of(httpx.post(chat, content=b"x" * (1 << 20 + 1),
                        headers={"content-type": "application/json"}), 413)
    error_of(httpx.get(f"{url}/v1/nothing"), 404)
    error_of(httpx.get(chat), 405)
    error_of(httpx.get(f"{url}/v1/models/not-this-one"), 404)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    e = error_of(httpx.post(f"{url}/v1/embeddings", json={"input": "x", "model": "m"}), 501)
    assert "embeddings are not supported" in e["message"]
    e = error_of(httpx.post(chat, json={"messages": msgs, "mirostat": 2}), 400)
    assert "mirostat 1 and 2 are not implemented" in e["message"]
    e = error_of(httpx.post(chat, json={"messages": msgs, "n": 2}), 400)
    assert "only n=1" in e["message"]
    e = error_of(httpx.post(chat, json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}), 400)
    assert "image inputs are not supported" in e["message"]


# --- fuzz: no body the API can receive gives a 5xx ---------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
SMALL_INT = st.integers(-3, 24)


def bodies(invalid_one_in: int | None) -> tuple[st.SearchStrategy, st.SearchStrategy]:
    """(chat, completion) body strategies. Each field is invalid one time in `invalid_one_in`
    (never with None), so many bodies get past validation and really generate."""

    def field(valid: st.SearchStrategy, invalid: st.SearchStrategy = JSON) -> st.SearchStrategy:
        if invalid_one_in is None:
            return valid
        return st.sampled_from(range(invalid_one_in)).flatmap(
            lambda i: invalid if i == 0 else valid)

    common = {
        "model": field(st.text(max_size=8)),
        "max_tokens": field(st.integers(1, 24), SMALL_INT | JSON),
        "temperature": field(st.sampled_from([0.0, 0.7]) | st.floats(0, 2), st.floats(-1, 3)),
        "top_p": field(st.floats(0.05, 1.0), st.floats(-0.1, 1.1) | JSON),
        "seed": field(st.integers(-(2**63), 2**64 - 1), st.integers(-(2**70), 2**70) | JSON),
        "stop": field(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=4),
                      st.lists(st.text(max_size=3), max_size=18) | JSON),
        "stream": field(st.booleans()),
        "stream_options": field(st.fixed_dictionaries({}, optional={
            "include_usage": field(st.booleans())})),
        "n": field(st.sampled_from([1, None]), SMALL_INT | JSON),
        "presence_penalty": field(st.sampled_from([0, 0.0, None]), st.floats(-2, 2) | JSON),
        "logit_bias": field(st.sampled_from([None, {}]), JSON),
        "user": field(st.text(max_size=5)),
        "ane_spec": field(st.fixed_dictionaries({}, optional={
            "speculative": field(st.booleans()), "guard": field(st.booleans()),
            "ngram_min": field(st.integers(1, 4), SMALL_INT | JSON),
            "ngram_max": field(st.integers(4, 8), SMALL_INT | JSON)})),
    }
    part = st.fixed_dictionaries({"type": field(st.just("text"), st.just("image_url") | JSON),
                                  "text": field(st.text(max_size=12))})
    message = st.fixed_dictionaries({
        "role": field(st.sampled_from(["system", "developer", "user", "assistant"]),
                      st.just("tool") | JSON),
        "content": field(st.text(max_size=40) | st.lists(part, max_size=2), st.none() | JSON)})
    chat = st.fixed_dictionaries(
        {"messages": field(st.lists(message, min_size=1, max_size=3), st.lists(message) | JSON)},
        optional=common | {"max_completion_tokens": field(st.integers(1, 24), SMALL_INT | JSON),
                           "logprobs": field(st.just(False)), "tools": field(st.none()),
                           "response_format": field(st.just({"type": "text"}))})
    completion = st.fixed_dictionaries(
        {"prompt": field(st.text(min_size=1, max_size=40)
                         | st.lists(st.integers(0, 1023), min_size=1, max_size=30)
                         | st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=1),
                         st.lists(st.integers(-5, 1100), max_size=30)
                         | st.lists(st.lists(st.integers(0, 1100), max_size=5), max_size=2)
                         | st.lists(st.text(max_size=8), max_size=2) | JSON)},
        optional=common | {"echo": field(st.just(False)), "suffix": field(st.none()),
                           "best_of": field(st.just(1), SMALL_INT | JSON)})
    return chat, completion


VALID_CHAT, VALID_COMPLETION = bodies(None)
CHAT_BODY, COMPLETION_BODY = bodies(6)


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_fuzz_no_server_errors(server, data) -> None:
    path, body = data.draw(st.sampled_from([
        ("/v1/chat/completions", VALID_CHAT), ("/v1/completions", VALID_COMPLETION),
        ("/v1/chat/completions", CHAT_BODY), ("/v1/completions", COMPLETION_BODY),
        ("/v1/chat/completions", JSON), ("/v1/completions", st.binary(max_size=40)),
    ]).flatmap(lambda pb: st.tuples(st.just(pb[0]), pb[1])))
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kw = {"content": json.dumps(body), "headers": {"content-type": "application/json"}}
    with httpx.stream("POST", server.url + path, timeout=60, **kw) as r:
        raw = r.read().decode()
    event(f"{path} -> {r.status_code}")
    assert r.status_code < 500, raw
    if r.status_code != 200:
        assert set(json.loads(raw)["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert raw.endswith("data: [DONE]\n\n") and '"error"' not in raw, raw
    else:
        assert json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")


def test_still_healthy_after_fuzz(server, client, pipeline) -> None:
    prompt = chat_tokens(pipeline, CHATS[0])
    r = client.chat.completions.create(model="m", messages=CHATS[0], max_tokens=20)
    assert r.choices[0].message.content == reference(pipeline, prompt, max_tokens=20).text
    values = parse_metrics(httpx.get(f"{server.url}/metrics").text)
    assert not any(k.startswith("ane_spec_requests_total") and 'outcome="failed"' in k
                   for k in values)
