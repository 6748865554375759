"""Agent libraries on a real server, driving tool calls with a small max_tokens: instructor
(TOOLS mode), pydantic-ai (an output tool through its OpenAI chat model, streamed and not),
smolagents (OpenAIServerModel under a ToolCallingAgent) and LangChain's bind_tools.

Issue 20's failure: with parallel calls on (the OpenAI default), the tiny model keeps adding
calls until max_tokens cuts one, and each of these libraries crashed on the markup that reached
`content`. Cut, each must now end the way it ends against OpenAI: its own "cut by length" error
(instructor's IncompleteOutputException, pydantic-ai's IncompleteToolCall) or, for smolagents,
the step error it records for arguments that are not JSON. Given room, each gets well-formed
results. Each test skips, naming the library, where that library is absent.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterable
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from ane_spec.daemon.config import ServeConfig
from tests.live_server import started

MARKUP = "<|tool_call|>"  # Phi-4-mini's call start: must never reach a library as text
ROOM = 200  # max_tokens with room for a whole call: each test fails if its library never gets one


class Weather(BaseModel):
    """The weather request a library asks the model for."""

    city: str = Field(pattern=r"^[a-z]{1,8}$")
    days: int = Field(ge=1, le=14)


@pytest.fixture(scope="module")
def server(tiny_build_512: Path):
    srv = started(ServeConfig(manifest=tiny_build_512, port=0, backend="mil",
                              precision="fp32", log_level="warning", access_log=False))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


ASK = "weather in Paris?"


def _no_markup(message) -> None:  # noqa: ANN001 - an openai ChatCompletionMessage
    """What the issue saw crash every library: template markup in the content, or a tool call
    without a name or an arguments string."""
    assert MARKUP not in (message.content or ""), message
    for call in message.tool_calls or ():
        assert call.id and call.function.name and isinstance(call.function.arguments, str), call


def _cut_inside_arguments(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return True
    return False


def test_instructor_tools_mode(client) -> None:
    """TOOLS mode names its function in tool_choice: one call. Cut, instructor raises its
    IncompleteOutputException (never retried) holding the call so far; with room, a Weather."""
    instructor = pytest.importorskip("instructor", reason="instructor is not installed")
    from instructor.core.exceptions import IncompleteOutputException

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    cut_inside = 0
    for max_tokens in range(4, ROOM, 3):
        try:
            weather = patched.chat.completions.create(
                model="m", messages=[{"role": "user", "content": ASK}], response_model=Weather,
                max_tokens=max_tokens, max_retries=0)
        except IncompleteOutputException as cut:
            choice = cut.last_completion.choices[0]
            assert choice.finish_reason == "length"
            _no_markup(choice.message)
            calls = choice.message.tool_calls or []
            assert len(calls) <= 1 and all(c.function.name == "Weather" for c in calls)
            cut_inside += bool(calls) and _cut_inside_arguments(calls[0].function.arguments)
            continue
        assert isinstance(weather, Weather)
        break
    else:
        raise AssertionError(f"{ROOM} tokens did not finish the call")
    assert cut_inside >= 2, "no cap cut the call inside its arguments"
    # greedy: more room gives the same output (instructor attaches the raw reply, so compare
    # the fields)
    assert patched.chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASK}], response_model=Weather,
        max_tokens=ROOM, max_retries=0).model_dump() == weather.model_dump()


def test_instructor_parallel_tools_mode(server, client) -> None:
    """PARALLEL_TOOLS sends tool_choice "auto" for an Iterable of models; a logit_bias on the
    call-start token makes the tiny model call (tests/test_tool_formats.py). Cut inside the call,
    IncompleteOutputException; with room, a list of whole Weather objects."""
    instructor = pytest.importorskip("instructor", reason="instructor is not installed")
    from instructor.core.exceptions import IncompleteOutputException

    (start,) = httpx.post(f"{server.url}/tokenize", json={"content": MARKUP,
                                                          "parse_special": True}).json()["tokens"]
    patched = instructor.from_openai(client, mode=instructor.Mode.PARALLEL_TOOLS)
    cut_inside = 0
    for max_tokens in range(4, ROOM, 4):
        try:
            found = list(patched.chat.completions.create(
                model="m", messages=[{"role": "user", "content": ASK}],
                response_model=Iterable[Weather], max_tokens=max_tokens, max_retries=0,
                logit_bias={str(start): 100}))
        except IncompleteOutputException as cut:
            message = cut.last_completion.choices[0].message
            _no_markup(message)
            calls = message.tool_calls or []
            cut_inside += bool(calls) and _cut_inside_arguments(calls[-1].function.arguments)
            continue
        assert found and all(isinstance(w, Weather) for w in found), found
        break
    else:
        raise AssertionError(f"{ROOM} tokens did not finish the calls")
    assert cut_inside >= 1, "no cap cut a call inside its arguments"


def test_pydantic_ai_output_tool(server) -> None:
    """An output type makes pydantic-ai send tool_choice "required" with parallel calls on, so
    the tiny model keeps adding final_result calls until max_tokens cuts one. Cut before any
    call is whole, pydantic-ai raises UnexpectedModelBehavior naming the token limit, and
    IncompleteToolCall where the cut call is the only one; with a whole call first, it takes it."""
    pytest.importorskip("pydantic_ai", reason="pydantic-ai is not installed")
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import IncompleteToolCall, UnexpectedModelBehavior
    from pydantic_ai.messages import ModelResponse, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0))
    agent = Agent(OpenAIChatModel("m", provider=provider), output_type=Weather)
    outcomes = []
    for max_tokens in range(4, ROOM, 3):
        try:
            result = agent.run_sync(ASK, model_settings={"max_tokens": max_tokens})
        except IncompleteToolCall as cut:
            assert f"token limit ({max_tokens})" in str(cut)
            outcomes.append("incomplete call")
            continue
        except UnexpectedModelBehavior as cut:  # the reply ended before a call had its name
            assert f"token limit ({max_tokens}) exceeded before any response" in str(cut)
            outcomes.append("empty")
            continue
        assert isinstance(result.output, Weather)
        (reply,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
        calls = [p for p in reply.parts if isinstance(p, ToolCallPart)]
        assert calls and all(p.tool_name == "final_result" for p in calls)
        assert Weather.model_validate_json(calls[0].args) == result.output
        outcomes.append("output")
        break
    assert outcomes[-1] == "output" and "incomplete call" in outcomes, outcomes
    # with room for several calls, the last one is cut (parallel calls on): still the output
    result = agent.run_sync(ASK, model_settings={"max_tokens": ROOM})
    (reply,) = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert reply.finish_reason == "length" and len(reply.parts) >= 2
    assert isinstance(result.output, Weather)
    # streamed (its own client: run_sync's event loop holds the first one's connections): the
    # same output given room; cut, pydantic-ai's own streaming errors
    provider = OpenAIProvider(openai_client=openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0))
    streaming = Agent(OpenAIChatModel("m", provider=provider), output_type=Weather)
    output, streamed_errors = asyncio.run(_streamed_outputs(streaming, UnexpectedModelBehavior))
    assert output == result.output
    # cut before a call is named, and inside its arguments (output validation)
    assert len(streamed_errors) == 2, streamed_errors


async def _streamed_outputs(agent, errors: type[Exception]):  # noqa: ANN001, ANN202
    """The first output a growing max_tokens streams, and the errors met on the way."""
    seen = set()
    for max_tokens in range(4, ROOM, 6):
        try:
            async with agent.run_stream(ASK, model_settings={"max_tokens": max_tokens}) as run:
                return await run.get_output(), seen
        except errors as cut:
            seen.add(str(cut).split(",")[0].split("(")[0])
    raise AssertionError(f"{ROOM} tokens did not finish a streamed call")


def test_langchain_tool_call_cut_by_max_tokens(server) -> None:
    """LangChain sorts a call cut inside its arguments into `invalid_tool_calls` (non-streamed)
    and parses the partial JSON of a streamed one; either way the content stays empty."""
    langchain_openai = pytest.importorskip("langchain_openai",
                                           reason="langchain-openai is not installed")
    seen_invalid = False
    for max_tokens in range(4, ROOM, 4):
        llm = langchain_openai.ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                          model="m", max_tokens=max_tokens, max_retries=0)
        bound = llm.bind_tools([Weather], tool_choice="required", parallel_tool_calls=False)
        message = bound.invoke(ASK)
        chunks = list(bound.stream(ASK))
        streamed = sum(chunks[1:], chunks[0])
        assert message.content == streamed.content == ""
        names = [c["name"] for c in message.tool_calls + message.invalid_tool_calls]
        assert names in ([], ["Weather"]), message
        if message.invalid_tool_calls:
            seen_invalid = True
            (bad,) = message.invalid_tool_calls
            assert [c["id"] for c in streamed.tool_calls] and \
                _cut_inside_arguments(bad["args"])
        if message.response_metadata["finish_reason"] == "tool_calls":
            (call,) = message.tool_calls
            assert Weather.model_validate(call["args"]) and streamed.tool_calls[0]["args"] == \
                call["args"]
            break
    else:
        raise AssertionError(f"{ROOM} tokens did not finish the call")
    assert seen_invalid


def test_smolagents_tool_calling_agent(server) -> None:
    """smolagents' ToolCallingAgent sends tool_choice "required". A call cut inside its
    arguments reaches the tool as the raw string, which smolagents records as the step's tool
    error; a reply cut before any call is named is its "no content and no tool calls" parsing
    error. With room, the tool runs with well-formed arguments. The run always returns."""
    smolagents = pytest.importorskip("smolagents", reason="smolagents is not installed")
    from smolagents.memory import ActionStep
    from smolagents.utils import AgentParsingError, AgentToolCallError, AgentToolExecutionError

    seen: list[int] = []

    def forecast(days: int) -> str:
        """The weather forecast.

        Args:
            days: how many days ahead
        """
        seen.append(days)
        return "sunny"

    # an integer argument, so the tiny model's calls end (a free string runs to max_tokens)
    tool = smolagents.tool(forecast)
    errors = []
    for max_tokens in range(4, ROOM, 4):
        model = smolagents.OpenAIServerModel(model_id="m", api_base=f"{server.url}/v1",
                                             api_key="unused", client_kwargs={"max_retries": 0},
                                             max_tokens=max_tokens)
        agent = smolagents.ToolCallingAgent(tools=[tool], model=model, max_steps=1,
                                            verbosity_level=-1)
        # the default system prompt is ~2,000 tokens; the tiny model's context is 512
        agent.prompt_templates["system_prompt"] = "Call tools."
        agent.prompt_templates["final_answer"] = {"pre_messages": "Answer.",
                                                  "post_messages": "{{task}}"}
        agent.run(ASK)
        step = next(s for s in agent.memory.steps if isinstance(s, ActionStep))
        message = step.model_output_message.raw.choices[0].message
        _no_markup(message)
        if step.error is None:
            break
        errors.append(type(step.error))
        assert isinstance(step.error, (AgentParsingError, AgentToolCallError,
                                       AgentToolExecutionError)), step.error
    else:
        raise AssertionError(f"{ROOM} tokens did not finish a call")
    assert seen and all(isinstance(d, int) for d in seen), seen
    assert AgentParsingError in errors and (AgentToolCallError in errors
                                            or AgentToolExecutionError in errors), errors
