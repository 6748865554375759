"""Issue 29, item 1: client libraries' default tool calling gets a parsed call: LangChain's
`bind_tools` (langchain-ollama's ChatOllama), the ollama client's `tools`, and the OpenAI
Agents SDK's default run (the Responses API). None of them sends `tool_choice`, so every call
here is made under `auto`, in whatever form the model writes it.

Two servers: a small synthetic Qwen 3 whose reply a constructed grammar fixes to a fenced call
(the form the real Qwen2.5-Coder favours), and the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M
(tests/real_models.py's shared build) asked about the weather.
"""

from __future__ import annotations

import json

import pytest

from tests.test_tool_call_forms import CITY

QUESTION = "What is the weather in Paris? Use the tool."
FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
        city: The city's name.
    """
    return f"It is sunny in {city}."


@pytest.fixture(scope="module", params=["synthetic", "qwen2.5-coder"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    from ane_spec.daemon.config import ServeConfig
    from ane_spec.shards.build import BuildRequest, build
    from tests.live_server import started

    if request.param == "synthetic":
        root = tmp_path_factory.mktemp("tool-clients")
        from ane_spec.model.synthetic import write_synthetic_gguf
        from tests.test_architectures import spec

        gguf = write_synthetic_gguf(root / "qwen3.gguf", spec("qwen3", seed=11, num_layers=2))
        build(gguf, root / "m", BuildRequest(topology="2", max_seq=768))
        model = root / "m"
    else:
        model = request.getfixturevalue("qwen_coder_build")
    srv = started(ServeConfig(manifest=model, port=0, backend="mil", precision="fp16",
                              log_level="warning", access_log=False))
    srv.kind = request.param
    yield srv
    srv.stop()


@pytest.fixture
def fenced_on_synthetic(server, monkeypatch: pytest.MonkeyPatch):
    """On the synthetic model, every tool grammar becomes one that allows only FENCED."""
    if server.kind == "synthetic":
        from ane_spec.daemon.tool_formats import HermesFormat

        monkeypatch.setattr(HermesFormat, "grammar",
                            lambda self, *a, **k: f"start: {json.dumps(FENCED)}\n")
    return server


def _is_weather_call(name: str, args: dict) -> bool:
    return name == "get_weather" and isinstance(args.get("city"), str) and args["city"]


def test_langchain_bind_tools(fenced_on_synthetic) -> None:
    import langchain_ollama
    llm = langchain_ollama.ChatOllama(base_url=fenced_on_synthetic.url, model="m",
                                      num_predict=120, temperature=0)
    message = llm.bind_tools([get_weather]).invoke(QUESTION)
    assert len(message.tool_calls) == 1, message
    (call,) = message.tool_calls
    assert _is_weather_call(call["name"], call["args"]), call
    assert "get_weather" not in (message.content or "")  # no markup left as text


def test_ollama_client_tools(fenced_on_synthetic) -> None:
    import ollama

    client = ollama.Client(host=fenced_on_synthetic.url)
    kw = dict(model="m", messages=[{"role": "user", "content": QUESTION}],
              tools=[get_weather], options={"num_predict": 120, "temperature": 0})
    message = client.chat(**kw).message
    assert len(message.tool_calls or ()) == 1, message
    (call,) = message.tool_calls
    assert _is_weather_call(call.function.name, dict(call.function.arguments)), call
    streamed = [c for part in client.chat(stream=True, **kw)
                for c in part.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == \
        [(call.function.name, dict(call.function.arguments))]


def test_openai_agents_default_run(fenced_on_synthetic) -> None:
    """The Agents SDK's default model is the Responses API; its run calls the tool, then asks
    the model again with the result (which may call again: max_turns ends it)."""
    import agents
    import openai

    agents.set_tracing_disabled(True)
    agents.set_default_openai_client(openai.AsyncOpenAI(
        base_url=f"{fenced_on_synthetic.url}/v1", api_key="unused", max_retries=0),
        use_for_tracing=False)
    calls: list[str] = []

    @agents.function_tool(name_override="get_weather")
    def weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return get_weather(city)

    agent = agents.Agent(name="Assistant", instructions="Answer with the tools.", model="m",
                         tools=[weather],
                         model_settings=agents.ModelSettings(max_tokens=120, temperature=0))
    try:
        agents.Runner.run_sync(agent, QUESTION, max_turns=2)
    except (agents.exceptions.MaxTurnsExceeded, agents.exceptions.ModelBehaviorError) as exc:
        # After the call, the answer may run past max_tokens (the SDK calls the "incomplete"
        # response a model error); the call itself must have come first.
        assert calls, exc
    assert calls and all(isinstance(c, str) and c for c in calls), calls


def test_the_tool_schema_reaches_the_model_unchanged(fenced_on_synthetic) -> None:
    """The same request through /v1 with `auto` (what the libraries send): one call."""
    import httpx

    r = httpx.post(f"{fenced_on_synthetic.url}/v1/chat/completions", timeout=600, json={
        "model": "m", "messages": [{"role": "user", "content": QUESTION}], "tools": [CITY],
        "max_tokens": 120, "temperature": 0}).json()
    calls = r["choices"][0]["message"].get("tool_calls") or []
    assert len(calls) == 1, r
    assert _is_weather_call(calls[0]["function"]["name"],
                            json.loads(calls[0]["function"]["arguments"]))
