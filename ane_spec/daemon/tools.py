"""Tool calls in Phi-4-mini's own format, to and from OpenAI's `tools` / `tool_calls`.

Sources (nothing here is guessed):
- Tool definitions: Phi-4-mini-instruct's model card ("Tool-enabled function-calling format"):
  the system turn carries a JSON list of {"name", "description", "parameters"} between
  `<|tool|>` and `<|/tool|>`; its chat template (tokenizer_config.json, also the GGUF's
  `tokenizer.chat_template`) renders a system message's "tools" string exactly there.
- Calls: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]<|/tool_call|>`, one JSON list
  per turn, as in Microsoft's Phi Cookbook (Phi-4-mini function calling, which parses that list)
  and guidance-ai's llguidance tool-call guide for Phi-4-mini.
- Results: the template renders any role as `<|role|>content<|end|>`; a `tool` message is given
  the role `tool_response`, the vocabulary's `<|tool_response|>` token (llama.cpp's Phi-4-mini
  template does the same), so results never look like the `<|tool|>` definitions block.

The forced kinds of `tool_choice` (required, a named function) are enforced with a grammar, and
`auto` with one that allows plain text or a well-formed call: even a tiny model returns
arguments valid against the function's `parameters` schema.

The model's own voice cannot be forged. Client text (messages, tool descriptions, earlier calls'
arguments) is text: only the `Markup` this module adds may become special tokens
(`chat.render_chat_pieces`). Under `auto`, the plain text may not spell `<|tool_call|>` in
ordinary tokens, so only the real special token starts a call, and `check_calls` refuses any
call to an undefined tool or with arguments its schema rejects.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ane_spec.daemon.protocol import ChatMessage, NamedToolChoice, Tool, tool_call_delta
from ane_spec.decode.grammar import JSON_OPTIONS
from ane_spec.decode.grammar_limits import GrammarLimits, check_json_depth
from ane_spec.decode.json_tightening import tighten
from ane_spec.decode.stops import StopMatcher
from ane_spec.model.chat import Markup

TOOL_CALL = "<|tool_call|>"
TOOL_CALL_END = "<|/tool_call|>"
TOOL_RESPONSE_ROLE = "tool_response"
# The model card's own system text, used when a request with tools has no system message.
DEFAULT_TOOL_SYSTEM = "You are a helpful assistant with some tools."
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_definitions(tools: list[Tool]) -> str:
    """The JSON list the model card puts between <|tool|> and <|/tool|>."""
    return json.dumps([{"name": t.function.name, "description": t.function.description or "",
                        "parameters": t.function.parameters or NO_PARAMETERS} for t in tools],
                      ensure_ascii=False)


def template_messages(messages: list[ChatMessage], tools: list[Tool] | None,
                      limits: GrammarLimits = GrammarLimits()) -> list[dict[str, Any]]:
    """OpenAI messages as the chat template's {"role", "content"[, "tools"]} dicts; a content
    is text, or text with the tool-call tags as `Markup` (see `chat.render_chat_pieces`)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        content: str | list[str] = m.text()
        if role == "tool":
            role = TOOL_RESPONSE_ROLE
        elif role == "assistant" and m.tool_calls:
            calls = [{"name": c.function.name,
                      "arguments": parsed_arguments(c.function.arguments, limits)}
                     for c in m.tool_calls]
            content = [content, Markup(TOOL_CALL), json.dumps(calls, ensure_ascii=False),
                       Markup(TOOL_CALL_END)]
        out.append({"role": role, "content": content})
    if tools:
        system = next((m for m in out if m["role"] == "system"), None)
        if system is None:
            system = {"role": "system", "content": DEFAULT_TOOL_SYSTEM}
            out.insert(0, system)
        system["tools"] = tool_definitions(tools)
    return out


def parsed_arguments(text: str, limits: GrammarLimits) -> Any:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise ValueError(f"an assistant tool call's arguments are not JSON: {text[:60]!r}")\
            from None
    except RecursionError:  # Python's parser gives up near 1,000 levels
        raise ValueError("an assistant tool call's arguments are nested too deeply; the limit "
                         f"is {limits.max_depth} levels") from None
    check_json_depth(value, "an assistant tool call's arguments", limits)
    return value


def tool_call_grammar(tools: list[Tool], choice: str | NamedToolChoice | None,
                      parallel: bool | None) -> str:
    """A Lark grammar (llguidance) for the reply: a forced call for `required` or a named
    function, plain text or a call for `auto`. Arguments follow each function's schema."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    calls: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": {"anyOf": [{
            "type": "object",
            "properties": {"name": {"const": t.function.name},
                           "arguments": t.function.parameters or NO_PARAMETERS},
            "required": ["name", "arguments"], "additionalProperties": False} for t in tools]},
        "x-guidance": JSON_OPTIONS}
    if parallel is False:
        calls["maxItems"] = 1
    call = f"call: {TOOL_CALL} %json {json.dumps(tighten(calls))} {TOOL_CALL_END}"
    if choice in (None, "auto"):
        # Any text that does not spell the call tag in ordinary tokens.
        return f"start: TEXT | TEXT? call\n{call}\nTEXT: {never_spelling(TOOL_CALL)}\n"
    return f"start: call\n{call}\n"


def never_spelling(marker: str) -> str:
    """A Lark terminal for text that does not contain `marker` (llguidance's & and ~)."""
    escaped = re.escape(marker).replace("/", "\\/")
    return f"/(.|\\n)+/ & ~/(.|\\n)*{escaped}(.|\\n)*/"


def check_calls(calls: list[dict[str, Any]], tools: list[Tool]) -> str | None:
    """Why parsed tool calls cannot be returned (an undefined tool, arguments that are not JSON
    or that the tool's schema rejects), or None. The grammar already guarantees all of this:
    a failure here is a bug, and the calls must not reach the client."""
    import jsonschema

    schemas = {t.function.name: t.function.parameters or NO_PARAMETERS for t in tools}
    for call in calls:
        name, text = call["function"]["name"], call["function"]["arguments"]
        if name not in schemas:
            return f"the model called {name!r}, which is not one of the tools given"
        try:
            jsonschema.validate(json.loads(text), schemas[name])
        except (json.JSONDecodeError, RecursionError):
            return f"the arguments of the call to {name!r} are not JSON"
        except jsonschema.ValidationError as exc:
            return f"the arguments of the call to {name!r} do not match its schema " \
                   f"({exc.message})"
        except jsonschema.SchemaError:
            continue  # a schema llguidance enforced but jsonschema cannot check
    return None


@dataclass(frozen=True)
class CallSyntax:
    """How a format writes its calls, for `ToolCallParser`.

    `start`: the text that opens the calls, content before it (the Hermes and Llama 3 forms,
    with and without markers, are read by call_forms.py). `header`: a call's start
    through its arguments' first character (group 1: the name, a JSON string body); it is
    complete only once that character has arrived, so that a piece ending between ':' and an
    optional space cannot put the space into the streamed arguments. `close`: the call
    object's own brace. `end` / `end_marker`: the end of the calls, where there is one.
    `single`: one call per turn."""

    start: str
    header: re.Pattern[str]
    close: re.Pattern[str]
    end: re.Pattern[str] | None = None
    end_marker: str | None = None
    single: bool = False


# A call's name (at most 512 characters: tool names are at most 64, protocol.Tool), then the
# separator before its arguments' key. Whitespace is possessive (`\s*+`): two runs side by
# side never backtrack into each other, so a failed match costs one pass (issue 36).
NAME = r'"name"\s*+:\s*+"((?:[^"\\]|\\.){0,512})"\s*+,\s*+'
PHI4_SYNTAX = CallSyntax(
    start=TOOL_CALL,
    header=re.compile(r'\s*+[\[,]\s*+\{\s*+' + NAME + r'"arguments"\s*+:\s*+(?=\S)'),
    close=re.compile(r"\s*+\}"), end=re.compile(r"\s*+\]"), end_marker=TOOL_CALL_END)


_OUTSIDE_STRING = re.compile(r'["{}\[\]]')  # the characters `step` acts on, outside a string
_INSIDE_STRING = re.compile(r'["\\]')      # and inside one


class JsonScan:
    """Where a JSON value being streamed ends: bracket depth outside strings, so a `}` inside a
    string or after a backslash does not count. `step` is True when a closing bracket brings
    the depth to zero; `advance` steps through a text, jumping over what `step` ignores."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escaped = False

    def step(self, ch: str) -> bool:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            return self.depth == 0
        return False

    def inert(self, text: str) -> bool:
        """Whether `step` would act on no character of `text` (its state stays as it is)."""
        return not self.escaped and (_INSIDE_STRING if self.in_string
                                     else _OUTSIDE_STRING).search(text) is None

    def advance(self, s: str, pos: int) -> tuple[int, bool]:
        """`step` through s[pos:] up to the closing bracket that brings the depth to zero:
        (the position after it, True), or (len(s), False). Characters `step` ignores are
        skipped by a regex search (a long run of them, say whitespace, in one C call)."""
        while pos < len(s):
            if self.escaped:  # the escaped character itself, whatever it is
                self.escaped = False
                pos += 1
                continue
            m = (_INSIDE_STRING if self.in_string else _OUTSIDE_STRING).search(s, pos)
            if m is None:
                return len(s), False
            pos = m.end()
            if self.step(m.group()):
                return pos, True
        return pos, False


class StreamedCalls:
    """The calls a streaming parser has read so far: `_calls` (each begun), the last call's
    argument pieces not yet joined into it (`_arguments`), and how many are closed."""

    _calls: list[dict[str, Any]]
    _arguments: list[str]
    _closed: int

    @property
    def whole_calls(self) -> list[dict[str, Any]]:
        """The calls whose arguments are complete (all but a call cut off inside them)."""
        return self.calls[:self._closed]

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Every call that began (its name whole, its arguments begun)."""
        if self._arguments:  # joined here, not per piece: `+=` on a growing string copies it
            self._calls[-1]["function"]["arguments"] += "".join(self._arguments)
            self._arguments.clear()
        return self._calls


class ToolCallParser(StreamedCalls):
    """Splits generated text (special tokens rendered) into content and tool calls, piece by
    piece, so a stream can send OpenAI's tool-call deltas as the arguments are generated.

    The calls' text is `[{"name": "f", "arguments": {...}}, ...]` (the grammar fixes the key
    order); each call's arguments are streamed as the exact substring the model wrote, so the
    deltas of a stream concatenate to the arguments of the same output parsed whole. A call
    exists once its name is whole and its arguments have begun: output cut off before that
    (max_tokens) has no call, output cut inside the arguments has a call whose arguments are
    truncated, as OpenAI returns one.
    """

    def __init__(self, syntax: CallSyntax = PHI4_SYNTAX) -> None:
        self.syntax = syntax
        # Content, held back at a partial start marker.
        self._content = StopMatcher([syntax.start])
        self._done = False
        self._call_text = ""
        self._pos = 0           # cursor into _call_text
        self._state = "header"  # -> "arguments" -> "close" -> "header" ...
        self._json = JsonScan()  # inside a call's arguments
        self._closed = 0        # calls whose arguments are whole
        self._calls: list[dict[str, Any]] = []  # {"id", "type", "function": {name, arguments}}
        self._arguments: list[str] = []  # the last call's pieces not yet joined into it
        # Issue 36: a whitespace run streamed after `<|tool_call|>` was matched again from
        # `_pos` at every piece. Now, when a match waits on text that ends in whitespace, more
        # whitespace cannot change its answer (header, close and end take any whitespace where
        # that text's ends, and each ends in a non-space or a lookahead for one), so whitespace
        # pieces only queue up (`_spaces`) until another piece comes. The end marker is looked
        # for in new text only.
        self._idle = False
        self._spaces: list[str] = []
        self._marker_from = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content to show, tool-call deltas: one per call index) for this piece of text."""
        if self._done or not text:
            return "", []
        if not self._content.stopped:  # before the calls' start
            content = self._content.push(text)
            return content, (_one_per_index(self._scan(self._content.tail))
                             if self._content.stopped else [])
        return "", _one_per_index(self._scan(text))

    def finish(self) -> str:
        """Content still held back at the end of the stream."""
        return self._content.flush()

    @property
    def complete(self) -> bool:
        """Whether the calls were read whole (Phi-4-mini: through the list's closing bracket)."""
        if self.syntax.end is None and not self.syntax.single:
            return bool(self._calls) and self._closed == len(self._calls)
        return self._done and bool(self._calls)

    def _scan(self, text: str) -> list[dict[str, Any]]:
        if self._idle and text.isspace():
            self._spaces.append(text)
            return []
        if self._state == "arguments" and self._pos == len(self._call_text) and not self._spaces \
                and self._json.inert(text):  # more of the arguments, and nothing else
            self._arguments.append(text)
            return [tool_call_delta(len(self._calls) - 1, None, None, text)]
        if self._spaces:
            text = "".join(self._spaces) + text
            self._spaces.clear()
        if self._pos > 4096:  # what is read is never looked at again
            self._call_text = self._call_text[self._pos:]
            self._marker_from = max(0, self._marker_from - self._pos)
            self._pos = 0
        self._call_text += text
        self._idle = False
        deltas: list[dict[str, Any]] = []
        s, syntax = self._call_text, self.syntax
        while not self._done:
            if self._state == "header":  # a call's start, or the list's end
                m = syntax.header.match(s, self._pos)
                if m:
                    name = json.loads(f'"{m.group(1)}"')
                    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": name, "arguments": ""}}
                    self.calls.append(call)  # (the previous call's pieces joined first)
                    deltas.append(tool_call_delta(len(self._calls) - 1, call["id"], name, ""))
                    self._pos, self._json.depth, self._state = m.end(), 0, "arguments"
                    continue
                if (self._calls and syntax.end is not None and syntax.end.match(s, self._pos)) \
                        or self._marker_in(s):
                    self._done = True
                    break
                self._idle = s[-1:].isspace()
                break
            if self._state == "arguments":
                start = self._pos
                self._pos, closed = self._json.advance(s, self._pos)
                if closed:
                    self._state = "close"
                if self._pos > start:
                    piece = s[start:self._pos]
                    self._arguments.append(piece)
                    deltas.append(tool_call_delta(len(self._calls) - 1, None, None, piece))
                if self._state == "arguments":
                    break
                continue
            close = syntax.close.match(s, self._pos)  # the call object's own brace
            self._closed = len(self._calls)
            if not close:
                self._idle = s[-1:].isspace()
                break
            self._pos, self._state = close.end(), "header"
            self._done = syntax.single
        return deltas

    def _marker_in(self, s: str) -> bool:
        """Whether the end marker is in the text from `_pos`, each character looked at once."""
        marker = self.syntax.end_marker
        if marker is None:
            return False
        found = s.find(marker, max(self._pos, self._marker_from)) >= 0
        self._marker_from = max(self._pos, len(s) - len(marker) + 1)
        return found



def _one_per_index(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A call's deltas from one piece of text merged into one entry (its header then its
    arguments), as OpenAI and llama-server send them: a client reading `tool_calls[0]` of a
    chunk must not lose the arguments that came with the name."""
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d["index"]:
            merged[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            merged.append(d)
    return merged
