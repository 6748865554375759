"""The OpenAI-compatible wire format: request bodies (pydantic), response and chunk shapes.

Only what the engine can honour is accepted. Parameters OpenAI defines but this server cannot
implement (n > 1, logprobs, penalties, logit_bias, tools, echo, suffix, best_of) are refused with
a 400 naming the parameter when set to anything but their neutral value, rather than ignored.
Unknown fields are ignored, as clients send vendor extras. Known fields are strict: `"stream":
"yes"` or `"max_tokens": "10"` is a 400, not a guess (an integer is still a valid float).

Deviation from OpenAI: `temperature` defaults to 0 (greedy), the exact speculative path; pass a
temperature for sampling. Extensions travel in one field named `ane_spec`, both ways.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ane_spec.daemon.config import MAX_NGRAM

MAX_STOPS = 16
MAX_STOP_CHARS = 512
SEED_MAX = 2**64 - 1


# --- errors -----------------------------------------------------------------------------------

def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# --- requests ---------------------------------------------------------------------------------

class SpeculationOptions(BaseModel):
    """Request extension `ane_spec`: per-request speculation settings (server defaults when
    omitted)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    speculative: bool | None = None
    ngram_min: int | None = Field(None, ge=1, le=MAX_NGRAM)
    ngram_max: int | None = Field(None, ge=1, le=MAX_NGRAM)
    guard: bool | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


Stop = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class _Generation(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=SEED_MAX)
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ane_spec: SpeculationOptions | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _count_stops(cls, value: Any) -> Any:
        # Checked before the str | list union, which would report only "not a valid string".
        if isinstance(value, list) and len(value) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings are allowed, got {len(value)}")
        return value

    @model_validator(mode="after")
    def _unsupported(self) -> "_Generation":
        if self.n not in (None, 1):
            raise ValueError("n: only n=1 is supported")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ValueError(f"{name}: not supported (leave it at 0)")
        if self.logit_bias:
            raise ValueError("logit_bias: not supported")
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
        return self.max_tokens


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def _check_unsupported(self) -> None:
        if self.logprobs or self.top_logprobs:
            raise ValueError("logprobs: not supported")
        if self.tools or self.functions or self.tool_choice not in (None, "none"):
            raise ValueError("tools: tool calling is not supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format: only {\"type\": \"text\"} is supported")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens

    def chat_messages(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                for m in self.messages]


class CompletionRequest(_Generation):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def _check_unsupported(self) -> None:
        if self.echo:
            raise ValueError("echo: not supported")
        if self.suffix:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        if self.logprobs:
            raise ValueError("logprobs: not supported")
        p = self.prompt
        if isinstance(p, list) and not p:
            raise ValueError("prompt: empty list")
        if isinstance(p, list) and isinstance(p[0], (str, list)) and len(p) != 1:
            raise ValueError("prompt: batches of prompts are not supported (send one)")

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return p[0]
        return p


# --- responses --------------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def finish_reason(engine_reason: str) -> str:
    """The engine's "context" is OpenAI's "length"; "cancelled" only happens to clients that
    have gone, so it never reaches one."""
    return "length" if engine_reason in ("length", "context") else "stop"


class Envelope:
    """id/created/model shared by a response or by every chunk of one stream."""

    def __init__(self, kind: Literal["chat", "completions"], model: str):
        self.kind = kind
        self.id = new_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.model = model

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, text: str, reason: str, use: dict[str, int],
                 ext: dict[str, Any]) -> dict[str, Any]:
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": reason}
            body = self._base("chat.completion")
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            body = self._base("text_completion")
        return body | {"choices": [choice], "usage": use, "ane_spec": ext}

    def chunk(self, text: str | None = None, reason: str | None = None, *, first: bool = False,
              ext: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None or first:
                delta["content"] = text or ""
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = self._base("chat.completion.chunk")
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            body = self._base("text_completion")
        body["choices"] = [choice]
        if ext is not None:
            body["ane_spec"] = ext
        return body

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._base(obj) | {"choices": [], "usage": use}
