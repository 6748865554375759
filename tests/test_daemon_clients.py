"""What real clients need, through the openai client against a real uvicorn server on loopback:
structured output (.parse), tool calls (a round trip, streamed deltas), llama.cpp's sampling
parameters, CORS, and llama-server's /tokenize, /detokenize and /props.

Every constrained output is also checked against `DecodeSession.generate` with speculation off:
the server's speculative output must be token-identical.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from ane_spec.daemon.config import ServeConfig
from tests.live_server import started

S = 512
ORIGIN = "http://playground.example"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "time"}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z]{1,8}$")
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def artifacts(tiny_build_512: Path) -> Path:
    return tiny_build_512  # S tokens of context


@pytest.fixture(scope="module")
def server(artifacts: Path):
    srv = started(ServeConfig(manifest=artifacts, port=0, backend="mil", precision="fp32",
                              log_level="warning", access_log=False, allowed_origins=ORIGIN))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def plain(**kw) -> dict:
    """The same request with speculation off (the reference for exactness)."""
    return {**kw, "extra_body": {**kw.get("extra_body", {}), "ane_spec": {"speculative": False}}}


def test_parse_with_a_pydantic_model(client) -> None:
    kw = dict(model="m", messages=[{"role": "user", "content": "a person"}],
              response_format=Person, max_tokens=120)
    r = client.chat.completions.parse(**kw)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(r.choices[0].message.content) == person
    ref = client.chat.completions.parse(**plain(**kw))
    assert ref.choices[0].message.content == r.choices[0].message.content
    # json_object: any JSON object, compact
    kw = dict(model="m", messages=ASK, response_format={"type": "json_object"}, max_tokens=40,
              logit_bias={"0": 5})
    r = client.chat.completions.create(**kw)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    assert client.chat.completions.create(**plain(**kw)).choices[0].message.content == \
        r.choices[0].message.content


def test_tool_round_trip(client) -> None:
    kw = dict(model="m", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=120,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              parallel_tool_calls=False)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "days"} and 1 <= args["days"] <= 14
    ref = client.chat.completions.create(**plain(**kw)).choices[0].message.tool_calls[0]
    assert ref.function == call.function
    # required: some call; parallel_tool_calls=False: exactly one
    r = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls) == 1
    # the result goes back as a tool message, then the model answers in text
    history = ASK + [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'}]
    final = client.chat.completions.create(model="m", messages=history, tools=[WEATHER, CLOCK],
                                           tool_choice="none", max_tokens=12)
    assert final.choices[0].message.tool_calls is None
    assert final.choices[0].finish_reason in ("stop", "length")
    # ... rendered the way tools.py documents: the call in the assistant turn, the result in
    # a <|tool_response|> turn (checked through the server's own /tokenize of that text)
    prompt = final.usage.prompt_tokens
    expected = ("<|user|>weather in Paris?<|end|><|assistant|><|tool_call|>"
                + json.dumps([{"name": "get_weather", "arguments": args}])
                + '<|/tool_call|><|end|><|tool_response|>{"temp_c": 21}<|end|><|assistant|>')
    tokens = httpx.post(f"{client.base_url}".removesuffix("/v1/") + "/tokenize",
                        json={"content": expected}).json()["tokens"]
    assert len(tokens) == prompt


def streamed(chunks) -> tuple[str, str | None, list[dict]]:
    """(content, finish_reason, calls) of a chat stream, with OpenAI's per-chunk promises checked:
    at most one entry per call index in a chunk, and a call's id and name come once, first."""
    calls: dict[int, dict] = {}
    reason, content = None, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reason = chunk.choices[0].finish_reason or reason
        indices = [d.index for d in delta.tool_calls or ()]
        assert len(indices) == len(set(indices)), delta.tool_calls
        for d in delta.tool_calls or ():
            slot = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id:
                assert slot["id"] is None and slot["arguments"] == ""
                slot["id"], slot["name"] = d.id, d.function.name
            slot["arguments"] += d.function.arguments or ""
    return content, reason, [calls[i] for i in sorted(calls)]


def test_streamed_tool_call_deltas_reassemble(client) -> None:
    kw = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=120,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0]
    content, reason, calls = streamed(client.chat.completions.create(stream=True, **kw))
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len(calls[0]["arguments"]) > 5


def test_tool_calls_cut_by_max_tokens(client) -> None:
    """Cut anywhere by max_tokens, a reply of tool calls comes back as OpenAI returns one: the
    calls that began (the last with its truncated arguments string), finish_reason "length",
    no markup in the content, and the same calls streamed as not."""
    kw = dict(model="m", messages=ASK, tools=[WEATHER], tool_choice="required")
    full = client.chat.completions.create(max_tokens=200, **kw).choices[0]
    assert full.finish_reason == "tool_calls"
    reference = [(c.function.name, c.function.arguments) for c in full.message.tool_calls]
    cuts = []  # (whole calls, length of the truncated call's arguments) per cut inside a call
    for max_tokens in range(1, 200, 3):
        whole = client.chat.completions.create(max_tokens=max_tokens, **kw).choices[0]
        content, reason, calls = streamed(client.chat.completions.create(
            stream=True, max_tokens=max_tokens, **kw))
        got = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
        assert [(c["name"], c["arguments"]) for c in calls] == got, max_tokens
        assert (whole.message.content or "") == content == "", max_tokens
        if whole.finish_reason == "tool_calls":  # it fit: every later cap gives the same
            assert got == reference
            break
        assert whole.finish_reason == reason == "length", max_tokens
        # what was generated so far, call for call: whole calls, then maybe a truncated one
        for j, (name, arguments) in enumerate(got):
            assert name == reference[j][0], max_tokens
            assert (arguments == reference[j][1] if j < len(got) - 1
                    else reference[j][1].startswith(arguments)), max_tokens
        if got and got[-1][1] != reference[len(got) - 1][1]:
            cuts.append((len(got) - 1, len(got[-1][1])))
    else:
        raise AssertionError("200 tokens did not finish the calls")
    assert len(reference) >= 2 and {0, 1} <= {n for n, _ in cuts}  # cut in the 1st and 2nd
    assert len(cuts) >= 3 and all(arguments for _, arguments in cuts), cuts


def test_sampling_parameters_do_what_llama_cpp_documents(client, server) -> None:
    def text(**kw) -> tuple[str, object]:
        kw = {"max_tokens": 20} | kw
        r = client.completions.create(model="m", prompt="the the the", **kw)
        return r.choices[0].text, r

    greedy, g = text()
    ids = httpx.post(f"{server.url}/tokenize", json={"content": greedy}).json()["tokens"]
    first = ids[0]
    # logit_bias: -100 bans a token, +100 makes it the only choice
    banned, _ = text(logit_bias={str(first): -100})
    assert httpx.post(f"{server.url}/tokenize", json={"content": banned}).json()["tokens"][0] \
        != first
    forced, _ = text(logit_bias={str(first): 100}, max_tokens=5)
    assert httpx.post(f"{server.url}/tokenize", json={"content": forced}).json()["tokens"] \
        == [first] * 5
    # repeat_penalty / presence / frequency: fewer repeated tokens than greedy (token identity
    # from each token's bytes in the chat logprobs)
    def repeats(**kw) -> int:
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content":
                                                                 "the the the"}],
                                           max_tokens=24, logprobs=True, **kw)
        toks = [tuple(c.bytes) for c in r.choices[0].logprobs.content]
        return len(toks) - len(set(toks))

    base = repeats()
    assert base > 0
    for extra in ({"repeat_penalty": 3.0}, {"presence_penalty": 2.0},
                  {"frequency_penalty": 2.0}):
        assert repeats(extra_body=extra) < base, extra
    # top_k 1 and min_p 1 leave only the likeliest token: greedy at any temperature and seed
    assert text(temperature=1.5, seed=7, extra_body={"top_k": 1})[0] == greedy
    assert text(temperature=1.5, seed=7, extra_body={"min_p": 1.0})[0] == greedy
    # seed: fixed is reproducible, -1 is random
    a, b = text(temperature=1.5, seed=5)[0], text(temperature=1.5, seed=5)[0]
    assert a == b
    assert len({text(temperature=1.5, seed=-1)[0] for _ in range(3)}) > 1
    # ignore_eos: a forced end of generation is ignored, generation runs to the limit
    eos = httpx.post(f"{server.url}/tokenize", json={"content": "<|endoftext|>"}).json()
    bias = {str(eos["tokens"][0]): 100}
    _, r = text(logit_bias=bias)
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 0
    _, r = text(logit_bias=bias, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 20
    # n_predict (llama.cpp's max_tokens), and max_tokens capped to the room left
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "the", "n_predict": 3})
    assert r.json()["usage"]["completion_tokens"] == 3
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=100000,
                                       logit_bias={str(t): -100 for t in eos["tokens"]})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == S
    # logprobs: the chosen token (greedy: the likeliest) and its alternatives
    r = client.chat.completions.create(model="m", messages=ASK, max_tokens=4, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob) for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content


def test_cors(server, artifacts: Path) -> None:
    chat = f"{server.url}/v1/chat/completions"
    pre = httpx.options(chat, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                       "Access-Control-Request-Headers":
                                           "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    r = httpx.post(chat, json={"messages": ASK, "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert r.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(chat, headers={"Origin": "http://evil.example",
                                         "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in other.headers
    # off by default: no CORS header at all, and a page's requests are refused by their
    # Origin (as Ollama refuses an origin it does not allow), preflight included
    srv = started(ServeConfig(manifest=artifacts, port=0, backend="mil", precision="fp32",
                              log_level="warning", access_log=False))
    try:
        url = f"{srv.url}/v1/chat/completions"
        pre = httpx.options(url, headers={"Origin": ORIGIN,
                                          "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 2}, headers={"Origin": ORIGIN})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        r = httpx.post(url, json={"messages": ASK, "max_tokens": 2})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_llama_server_routes(server) -> None:
    url = server.url
    text = "Hello <|user|> wörld"
    tokens = httpx.post(f"{url}/tokenize", json={"content": text}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": tokens}).json() == {"content": text}
    pieces = httpx.post(f"{url}/tokenize", json={"content": text, "with_pieces": True}).json()
    assert [p["id"] for p in pieces["tokens"]] == tokens
    assert "<|user|>" in [p["piece"] for p in pieces["tokens"]]
    props = httpx.get(f"{url}/props").json()
    assert props["default_generation_settings"]["n_ctx"] == S
    assert "<|assistant|>" in props["chat_template"]
    # llama-server's total_slots: the KV slots this server keeps resident
    assert props["total_slots"] == httpx.get(f"{url}/health").json()["kv_slots"]["resident"]
    r = httpx.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    r = httpx.post(f"{url}/tokenize", json={"content": 5})
    assert r.status_code == 400


def test_langchain_with_structured_output(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                      model="m", max_tokens=120, max_retries=0)
    person = llm.with_structured_output(Person).invoke("a person")
    assert isinstance(person, Person)


def test_tool_call_parser_is_independent_of_how_text_is_split() -> None:
    """Stream pieces can end anywhere (between ':' and a space, inside a string holding '}'):
    the deltas always concatenate to the arguments of the whole text parsed at once."""
    from ane_spec.daemon.tools import ToolCallParser

    text = ('ok <|tool_call|>[{"name": "a", "arguments": {"s": "x}\\"]", "n": [1, {"b": 2}]}}, '
            '{"name":"b","arguments":{}}]<|/tool_call|>')
    whole = ToolCallParser()
    assert whole.feed(text)[0] == "ok " and whole.complete
    expected = [(c["function"]["name"], c["function"]["arguments"]) for c in whole.calls]
    assert expected == [("a", '{"s": "x}\\"]", "n": [1, {"b": 2}]}'), ("b", "{}")]
    for step in range(1, 8):
        parser, content, calls = ToolCallParser(), "", {}
        for i in range(0, len(text), step):
            piece, deltas = parser.feed(text[i:i + step])
            assert len({d["index"] for d in deltas}) == len(deltas)  # one entry per call
            content += piece
            for d in deltas:
                name, args = calls.get(d["index"], (None, ""))
                calls[d["index"]] = (d["function"].get("name", name),
                                     args + d["function"]["arguments"])
        assert content + parser.finish() == "ok " and list(calls.values()) == expected, step


def test_tool_call_parser_keeps_a_call_cut_inside_its_arguments() -> None:
    """Cut by max_tokens: a call whose name is whole is returned with the arguments so far;
    only the calls whose arguments closed are whole (and judged against their schema)."""
    from ane_spec.daemon.tools import ToolCallParser

    text = '<|tool_call|>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {"y": [2'
    parser = ToolCallParser()
    assert parser.feed(text)[0] == "" and not parser.complete
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls] == \
        [("a", '{"x": 1}'), ("b", '{"y": [2')]
    assert [c["function"]["name"] for c in parser.whole_calls] == ["a"]
    header_only = ToolCallParser()
    header_only.feed('<|tool_call|>[{"name": "get_w')
    assert header_only.calls == [] and header_only.finish() == ""
