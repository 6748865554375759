"""The OpenAI-compatible wire format: request bodies (pydantic), response and chunk shapes.

Every parameter is either honoured or refused with a 400 naming it. Honoured: OpenAI's sampling
and output controls (temperature, top_p, seed, stop, max_tokens, presence/frequency penalties,
logit_bias, logprobs, response_format, tools, tool_choice, parallel_tool_calls) and
llama-server's (top_k, min_p, repeat_penalty, repeat_last_n, ignore_eos, n_predict, json_schema,
grammar). Refused by name when set to anything but their neutral value: n > 1, echo,
best_of, llama.cpp samplers this server does not run (mirostat, typical_p, dry, xtc, ...),
non-text content (images, audio, files) and the deprecated functions API. `suffix` on
completions is a fill-in-the-middle prompt where the vocabulary has FIM tokens (see fim.py),
refused otherwise. Unknown fields are
ignored, as clients send vendor extras. Types are strict: `"stream": "yes"` is refused, not
coerced.

Lenient where llama-server is, since clients count on it: `max_tokens` / `n_predict` -1 is the
rest of the context, `top_p: 0` keeps only the most likely token (see app._sampling), any
number of stop strings, and a sampler field set to null or its neutral value is accepted.

Deviation from OpenAI: `temperature` defaults to 0 (greedy), the exact speculative path; pass a
temperature for sampling. Extensions travel in one field named `ane_spec`, both ways.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ane_spec.daemon.config import MAX_NGRAM

MAX_STOP_CHARS = 512  # per stop string; their number is bounded only by the body limit
MAX_TOOLS = 128
SEED_MAX = 2**64 - 1
RANDOM_SEED = -1  # llama.cpp's "pick a random seed"
MAX_TOP_LOGPROBS = 20

# llama.cpp sampler parameters this server does not run, with the value that leaves them off.
_NEUTRAL_LLAMA_CPP = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0, "dry_multiplier": 0.0,
                      "xtc_probability": 0.0, "top_n_sigma": -1.0, "dynatemp_range": 0.0,
                      "n_probs": 0}


# --- errors -----------------------------------------------------------------------------------

def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- requests ---------------------------------------------------------------------------------

_STRICT = ConfigDict(extra="ignore", strict=True)


class SpeculationOptions(BaseModel):
    """Request extension `ane_spec`: per-request speculation settings (server defaults when
    omitted)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    speculative: bool | None = None
    ngram_min: int | None = Field(None, ge=1, le=MAX_NGRAM)
    ngram_max: int | None = Field(None, ge=1, le=MAX_NGRAM)
    guard: bool | None = None


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Generation(BaseModel):
    model_config = _STRICT

    model: str | None = None
    # -1 (LM Studio, llama.cpp): until the context is full; 0 is refused, as it asks for nothing.
    max_tokens: int | None = Field(None, ge=-1)
    n_predict: int | None = Field(None, ge=-1)  # llama.cpp: -1 = until the context is full
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    # 0: llama.cpp's top-p keeps min_keep = 1 token, the most likely one, so 0 decodes greedily.
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)  # llama.cpp: <= 0 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, gt=0.0, le=100.0)
    repeat_last_n: int | None = Field(None, ge=-1)  # llama.cpp: -1 = the whole context
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # OpenAI: {"token id": bias}; llama.cpp also takes [[id, bias | false], ...].
    logit_bias: dict[str, float | bool] | list[list[Any]] | None = None
    ignore_eos: bool | None = None
    seed: int | None = Field(None, ge=-(2**63), le=SEED_MAX)
    stop: Stop | list[Stop] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    user: str | None = None
    json_schema: dict[str, Any] | None = None  # llama-server's shorthand for response_format
    grammar: str | None = None  # llama-server: a GBNF grammar
    n_indent: int | None = Field(None, ge=0)  # llama-server: a line indented less ends the output
    ane_spec: SpeculationOptions | None = None

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _some_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("must be at least 1, or -1 for the rest of the context")
        return value

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported_samplers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in _NEUTRAL_LLAMA_CPP.items():
                if data.get(name) not in (None, neutral):  # null: the client's "not set"
                    hint = {"n_probs": " (use logprobs / top_logprobs)",
                            "mirostat": " (mirostat 1 and 2 are not implemented)"}.get(name, "")
                    raise ValueError(f"{name}: this server does not run that sampler; leave it "
                                     f"at {neutral}{hint}")
        return data

    @model_validator(mode="after")
    def _unsupported(self) -> "_Generation":
        if self.n not in (None, 1):
            raise ValueError("n: only n=1 is supported (one choice per request)")
        if self.grammar is not None and self.json_schema is not None:
            raise ValueError("grammar: give a grammar or a json_schema, not both")
        self._check_unsupported()
        return self

    def _check_unsupported(self) -> None:
        pass

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        """The cap the client asked for; None: no cap (the rest of the context)."""
        if self.max_tokens is not None:
            return None if self.max_tokens < 0 else self.max_tokens
        if self.n_predict is not None and self.n_predict >= 0:
            return max(self.n_predict, 1)
        return None

    def logit_bias_pairs(self, vocab: int) -> tuple[tuple[int, float], ...]:
        """(id, bias) pairs, checked against the vocabulary; `false` bans (-inf)."""
        if not self.logit_bias:
            return ()
        items = (self.logit_bias.items() if isinstance(self.logit_bias, dict)
                 else self.logit_bias)
        pairs = []
        for item in items:
            if isinstance(item, list) and len(item) != 2:
                raise ValueError("logit_bias: each list entry is [token id, bias]")
            key, bias = item
            if not isinstance(bias, (int, float)):
                raise ValueError(f"logit_bias: the bias of {key!r} must be a number or false")
            try:
                token = int(key) if not isinstance(key, (bool, float)) else int("x")
            except ValueError:
                raise ValueError(f"logit_bias: keys are token ids, not {key!r} (see /tokenize)")\
                    from None
            if not 0 <= token < vocab:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary "
                                 f"0..{vocab - 1}")
            if bias is False:
                bias = float("-inf")
            elif bias is True or not -100.0 <= float(bias) <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be in "
                                 "-100..100 (or false to ban it)")
            pairs.append((token, float(bias)))
        return tuple(pairs)


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: str


_NOT_TEXT = {"image_url": "image inputs", "input_image": "image inputs",
             "input_audio": "audio inputs", "file": "file inputs", "input_file": "file inputs"}


def _content_parts(parts: list[Any]) -> list[TextPart]:
    out = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):  # a hostile body may put anything here, e.g. a list
            raise ValueError("each content part needs a string 'type' (only 'text' is supported)")
        if kind in _NOT_TEXT:
            raise ValueError(f"{_NOT_TEXT[kind]} are not supported: this model reads text only")
        if kind != "text":
            raise ValueError(f"content parts of type {kind[:40]!r} are not supported (only "
                             "'text')")
        out.append(TextPart.model_validate(part))
    return out


class FunctionCall(BaseModel):
    model_config = _STRICT

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = _STRICT

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _STRICT

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _parts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("role") == "function":
                raise ValueError("role 'function' belongs to the deprecated functions API: "
                                 "send tools and 'tool' messages")
            if isinstance(data.get("content"), list):
                data = data | {"content": _content_parts(data["content"])}
        return data

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    model_config = _STRICT

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = _STRICT

    type: Literal["function"]
    function: FunctionSpec


class NamedToolChoice(BaseModel):
    model_config = _STRICT

    class _Name(BaseModel):
        model_config = _STRICT
        name: str

    type: Literal["function"]
    function: _Name


class JsonSchemaFormat(BaseModel):
    model_config = _STRICT

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # llama-server's json_object

    @model_validator(mode="after")
    def _has_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and (self.json_schema is None
                                           or self.json_schema.schema_ is None):
            raise ValueError("response_format: type 'json_schema' needs json_schema.schema")
        return self

    @property
    def enforced_schema(self) -> dict[str, Any] | None:
        """The JSON schema to enforce; None means any JSON object (`json_object`)."""
        if self.type == "json_schema":
            return self.json_schema.schema_  # type: ignore[union-attr]
        return self.schema_


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=-1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None

    def _check_unsupported(self) -> None:
        if self.functions is not None or self.function_call is not None:
            raise ValueError("functions: the deprecated functions API is not supported; send "
                             "tools (and tool_choice) instead")
        if self.audio is not None or (self.modalities and self.modalities != ["text"]):
            raise ValueError("modalities: only text output is supported (no audio)")
        if self.prediction is not None:
            raise ValueError("prediction: predicted outputs are not supported")
        if self.web_search_options is not None:
            raise ValueError("web_search_options: this server cannot search the web")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice in ("auto",
                                                                                  "required"):
            if not self.tools:
                raise ValueError("tool_choice: no tools were given")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = {t.function.name for t in self.tools or ()}
            if self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice: no tool is named "
                                 f"{self.tool_choice.function.name!r}")
        if self.tools:
            names = [t.function.name for t in self.tools]
            if len(set(names)) != len(names):
                raise ValueError("tools: two tools have the same name")
        constrained = [n for n, v in (("response_format", self.response_format
                                       and self.response_format.type != "text"),
                                      ("json_schema", self.json_schema is not None),
                                      ("grammar", self.grammar is not None)) if v]
        if len(constrained) > 1:
            raise ValueError(f"{constrained[1]}: give only one of response_format, json_schema "
                             "and grammar")
        if constrained and self.tools and self.tool_choice != "none":
            raise ValueError(f"{constrained[0]}: cannot be combined with tools (set tool_choice "
                             "to 'none', or drop one of them)")

    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return None if self.max_completion_tokens < 0 else self.max_completion_tokens
        return super().requested_max_tokens()

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def top_n(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=-1)  # OpenAI's default for completions
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = Field(None, ge=0, le=5)  # OpenAI's limit for completions

    def _check_unsupported(self) -> None:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        p = self.prompt
        if isinstance(p, list) and not p:
            raise ValueError("prompt: empty list")
        if isinstance(p, list) and isinstance(p[0], (str, list)) and len(p) != 1:
            raise ValueError("prompt: batches of prompts are not supported (send one)")

    def requested_max_tokens(self) -> int | None:
        # The OpenAI default of 16 applies only when neither max_tokens nor n_predict was given.
        if "max_tokens" not in self.model_fields_set and self.n_predict is not None:
            return None if self.n_predict < 0 else max(self.n_predict, 1)
        return super().requested_max_tokens()

    @property
    def top_n(self) -> int | None:
        return self.logprobs

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


class TokenizeRequest(BaseModel):
    """llama-server's /tokenize."""

    model_config = _STRICT

    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    model_config = _STRICT

    tokens: list[int] = Field(max_length=1 << 20)


# --- responses --------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(engine_reason: str, tool_calls: bool = False) -> str:
    """The engine's "context" is OpenAI's "length"; "cancelled" only happens to clients that
    have gone, so it never reaches one."""
    if engine_reason in ("length", "context"):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def tool_call_delta(index: int, call_id: str | None, name: str | None,
                    arguments: str) -> dict[str, Any]:
    """One streamed piece of a tool call, in OpenAI's chunk shape: the first piece carries the
    id, type and name, later ones only more of the arguments string."""
    function: dict[str, Any] = {"arguments": arguments}
    delta: dict[str, Any] = {"index": index, "function": function}
    if call_id is not None:
        delta |= {"id": call_id, "type": "function"}
        function["name"] = name
    return delta


class Envelope:
    """id/created/model shared by a response or by every chunk of one stream."""

    def __init__(self, kind: Literal["chat", "completions"], model: str):
        self.kind = kind
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str | None, reason: str, use: dict[str, int],
                 ext: dict[str, Any], *, tool_calls: list[dict[str, Any]] | None = None,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["tool_calls"] = tool_calls
            choice = {"index": 0, "message": message, "logprobs": logprobs,
                      "finish_reason": reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": reason}
            body = self._base("text_completion")
        return body | {"choices": [choice], "usage": use, "ane_spec": ext}

    def chunk(self, text: str | None = None, reason: str | None = None, *, first: bool = False,
              ext: dict[str, Any] | None = None, tool_calls: list[dict[str, Any]] | None = None,
              logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None or first:
                delta["content"] = text or ""
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": logprobs,
                      "finish_reason": reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        if ext is not None:
            body["ane_spec"] = ext
        return body

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._base(obj) | {"choices": [], "usage": use}


def logprobs_body(kind: str, entries: list[tuple[float, list[tuple[int, float]]]],
                  tokens: list[int], piece: Any) -> dict[str, Any]:
    """OpenAI's logprobs object for the generated tokens; `piece(id)` gives a token's bytes."""
    def text(t: int) -> str:
        return piece(t).decode("utf-8", errors="replace")

    if kind == "chat":
        return {"content": [
            {"token": text(t), "logprob": lp, "bytes": list(piece(t)),
             "top_logprobs": [{"token": text(a), "logprob": alp, "bytes": list(piece(a))}
                              for a, alp in top]}
            for t, (lp, top) in zip(tokens, entries)], "refusal": None}
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(text(t))
    return {"tokens": [text(t) for t in tokens], "token_logprobs": [lp for lp, _ in entries],
            "top_logprobs": [{text(a): alp for a, alp in top} for _, top in entries],
            "text_offset": offsets}


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
