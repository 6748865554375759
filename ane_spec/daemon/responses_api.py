"""OpenAI's Responses API (`POST /v1/responses`), which newer OpenAI SDK code and coding agents
use. A thin adapter: each request becomes one /v1/chat/completions request (see relay.py), and
the answer goes back as a Response object, or as its stream of typed events.

Taken: `input` (a string, or messages with input_text / output_text parts, function_call and
function_call_output items), `instructions`, `max_output_tokens`, `temperature`, `top_p`,
function `tools`, `tool_choice`, `parallel_tool_calls`, `text.format` (text, json_object,
json_schema), `stream`, and this server's `ane_spec` extension. Accepted and ignored: `store`
(nothing is stored: the answer says `store: false`), `metadata`, `include`, `reasoning` (the
model does not reason), `truncation`, `user`. Refused by name: `previous_response_id` and
`conversation` (no stored state: send the whole conversation), `background`, tools other than
functions, and non-text inputs.

A generation cut by `max_output_tokens` ends `status: "incomplete"` with
`incomplete_details.reason: "max_output_tokens"` (and a `response.incomplete` event), as
OpenAI's does; the item it cut (a message, or a function call whose arguments are not whole
JSON) is `incomplete` too. `usage.input_tokens_details.cached_tokens` counts the prompt tokens
whose KV cache was reused, and the response carries `ane_spec` (its `stats`, as every /v1
response does). A `function_call_output` must answer a `function_call` of the same input (400
otherwise, as OpenAI's).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse, Response, StreamingResponse

from ane_spec.daemon.engine import Engine
from ane_spec.daemon.protocol import ChatCompletionRequest, dumps, error_body
from ane_spec.daemon.relay import Failure, Generate, answer, chunks, json_body, validated

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    ane_spec: dict[str, Any] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise Failure(400, f"{where}: content must be a string or a list of parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise Failure(400, f"{where}: {str(kind)[:40]!r} parts are not supported: this "
                               "model reads text only", where)
        texts.append(str(part.get("text", "")))
    return "".join(texts)


def chat_messages(body: ResponsesBody) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages: function_call items join the assistant
    turn they belong to, function_call_output items become tool messages."""
    out: list[dict[str, Any]] = []
    if body.instructions:
        out.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return out + [{"role": "user", "content": body.input}]
    calls: set[Any] = set()  # the call ids of the input's function_call items
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append({"role": item.get("role"), "content": _text_of(item.get("content"),
                                                                     where)})
        elif kind == "function_call":
            calls.add(item.get("call_id"))
            call = {"id": item.get("call_id"), "type": "function", "function": {
                "name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:  # OpenAI's answer, word for word
                raise Failure(400, f"No tool call found for function call output with call_id "
                                   f"{str(item.get('call_id'))[:100]}.", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text_of(output,
                                                                                  where)})
        else:
            raise Failure(400, f"{where}: items of type {str(kind)[:40]!r} are not supported",
                          where)
    return out


def chat_request(body: ResponsesBody) -> ChatCompletionRequest:
    for name, value in (("previous_response_id", body.previous_response_id),
                        ("conversation", body.conversation), ("background", body.background)):
        if value:
            raise Failure(400, f"{name}: not supported: this server stores no responses; send "
                               "the whole conversation in `input`", name)
    fields: dict[str, Any] = {"messages": chat_messages(body), "stream": body.stream}
    if body.stream:
        fields["stream_options"] = {"include_usage": True}
    for name, value in (("max_tokens", body.max_output_tokens),
                        ("temperature", body.temperature), ("top_p", body.top_p),
                        ("parallel_tool_calls", body.parallel_tool_calls),
                        ("ane_spec", body.ane_spec)):
        if value is not None:
            fields[name] = value
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise Failure(400, f"tools[{i}]: {str(tool.get('type'))[:40]!r} tools are not "
                                   "supported (only function tools)", "tools")
            tools.append({"type": "function", "function": {
                k: tool[k] for k in ("name", "description", "parameters", "strict")
                if tool.get(k) is not None}})
        fields["tools"] = tools
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise Failure(400, "tool_choice: only 'auto', 'none', 'required' or a function",
                          "tool_choice")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        fields["tool_choice"] = choice
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") in ("json_object", "text"):
        fields["response_format"] = {"type": fmt["type"]}
    elif fmt is not None:
        raise Failure(400, "text.format: must be a {\"type\": \"text\" | \"json_object\" | "
                           "\"json_schema\"} object", "text.format")
    return validated(ChatCompletionRequest, fields)


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content if status != "in_progress" else []}


def whole_json(arguments: str) -> bool:
    """Whether a call's arguments are whole JSON: a call cut by max_output_tokens has not."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def call_item(item_id: str, call_id: str, name: str, arguments: str,
              status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def router(engine: Engine, generate: Generate) -> APIRouter:
    api = APIRouter()

    def response(body: ResponsesBody, rid: str, created: int, status: str,
                 output: list[dict[str, Any]], use: dict[str, int] | None,
                 ext: dict[str, Any] | None = None) -> dict[str, Any]:
        cached = ext["stats"]["reused_prefix_tokens"] if ext else 0
        out = {
            "id": rid, "object": "response", "created_at": created, "status": status,
            "model": engine.model_id, "output": output, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
            "store": False, "reasoning": None, "truncation": "disabled",
            "usage": None if use is None else {
                "input_tokens": use["prompt_tokens"], "output_tokens": use["completion_tokens"],
                "total_tokens": use["total_tokens"],
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens_details": {"reasoning_tokens": 0}}}
        if ext is not None:
            out["ane_spec"] = ext
        return out

    @api.post("/v1/responses")
    async def responses(request: Request) -> Response:
        try:
            body = validated(ResponsesBody, await json_body(request))
            inner = chat_request(body)
            rid, created = new_id("resp"), int(time.time())
            if not body.stream:
                data = await answer(generate, request, inner, "chat")
                choice = data["choices"][0]
                status = "incomplete" if choice["finish_reason"] == "length" else "completed"
                output = []
                if choice["message"].get("content"):
                    output.append(message_item(new_id("msg"), choice["message"]["content"]))
                for call in choice["message"].get("tool_calls") or ():
                    output.append(call_item(new_id("fc"), call["id"],
                                            call["function"]["name"],
                                            call["function"]["arguments"]))
                if status == "incomplete" and output:  # the item the cut fell in
                    last = output[-1]
                    if last["type"] == "message" or not whole_json(last["arguments"]):
                        last["status"] = "incomplete"
                return JSONResponse(response(body, rid, created, status, output,
                                             data["usage"], data.get("ane_spec")))
            events = await chunks(generate, request, inner, "chat")
        except Failure as exc:
            return JSONResponse(error_body(exc.message, param=exc.param, code=exc.code),
                                status_code=exc.status)
        return StreamingResponse(stream(body, rid, created, events),
                                 media_type="text/event-stream", headers=SSE_HEADERS)

    async def stream(body: ResponsesBody, rid: str, created: int,
                     events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {dumps(payload)}\n\n"

        output: list[dict[str, Any]] = []  # finished items
        text: dict[str, Any] | None = None  # the open message: {"id", "index", "text"}
        calls: dict[int, dict[str, Any]] = {}  # open function calls by chat index
        reason, ext = None, None

        def close_text(cut: int = -1) -> list[str]:
            """The open message, `incomplete` when it is item `cut` (the one a cut fell in)."""
            nonlocal text
            if text is None:
                return []
            where = {"item_id": text["id"], "output_index": text["index"]}
            part = {"type": "output_text", "text": text["text"], "annotations": [],
                    "logprobs": []}
            item = message_item(text["id"], text["text"],
                                "incomplete" if text["index"] == cut else "completed")
            output.append(item)
            text = None
            return [event("response.output_text.done", **where, content_index=0,
                          text=part["text"], logprobs=[]),
                    event("response.content_part.done", **where, content_index=0, part=part),
                    event("response.output_item.done", output_index=where["output_index"],
                          item=item)]

        def close_calls(cut: int = -1) -> list[str]:
            """The open calls; item `cut` is `incomplete` if its arguments are not whole."""
            out = []
            for call in calls.values():
                status = ("incomplete" if call["index"] == cut
                          and not whole_json(call["arguments"]) else "completed")
                item = call_item(call["id"], call["call_id"], call["name"], call["arguments"],
                                 status)
                output.append(item)
                out += [event("response.function_call_arguments.done", item_id=call["id"],
                              output_index=call["index"], name=call["name"],
                              arguments=call["arguments"]),
                        event("response.output_item.done", output_index=call["index"],
                              item=item)]
            calls.clear()
            return out

        def opened() -> int:
            return len(output) + (text is not None) + len(calls)

        start = response(body, rid, created, "in_progress", [], None)
        yield event("response.created", response=start)
        yield event("response.in_progress", response=start)
        async for chunk in events:
            if "error" in chunk:
                failed = response(body, rid, created, "failed", output, None)
                failed["error"] = {"code": "server_error",
                                   "message": chunk["error"].get("message", "error")}
                yield event("response.failed", response=failed)
                return
            if chunk.get("usage"):
                status = "incomplete" if reason == "length" else "completed"
                cut = opened() - 1 if status == "incomplete" else -1
                for line in close_text(cut) + close_calls(cut):
                    yield line
                yield event(f"response.{status}", response=response(
                    body, rid, created, status, output, chunk["usage"], ext))
                continue
            choice = chunk["choices"][0]
            reason = choice.get("finish_reason") or reason
            ext = chunk.get("ane_spec") or ext
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if text is None:
                    text = {"id": new_id("msg"), "index": opened(), "text": ""}
                    where = {"item_id": text["id"], "output_index": text["index"]}
                    yield event("response.output_item.added", output_index=text["index"],
                                item=message_item(text["id"], "", "in_progress"))
                    yield event("response.content_part.added", **where, content_index=0,
                                part={"type": "output_text", "text": "", "annotations": [],
                                      "logprobs": []})
                text["text"] += delta["content"]
                yield event("response.output_text.delta", item_id=text["id"],
                            output_index=text["index"], content_index=0,
                            delta=delta["content"], logprobs=[])
            for d in delta.get("tool_calls") or ():
                fn = d.get("function") or {}
                if d["index"] not in calls:
                    for line in close_text():
                        yield line
                    call = calls[d["index"]] = {
                        "id": new_id("fc"), "index": opened(), "call_id": d.get("id"),
                        "name": fn.get("name") or "", "arguments": ""}
                    yield event("response.output_item.added", output_index=call["index"],
                                item=call_item(call["id"], call["call_id"], call["name"], "",
                                               "in_progress"))
                call = calls[d["index"]]
                if fn.get("arguments"):
                    call["arguments"] += fn["arguments"]
                    yield event("response.function_call_arguments.delta", item_id=call["id"],
                                output_index=call["index"], delta=fn["arguments"])

    return api
