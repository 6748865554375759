"""Each model family's tool-call format: how tools and earlier calls reach its chat template,
the grammar its calls follow, and how its output is read back. Chosen from the GGUF's own chat
template and vocabulary, as llama.cpp's common/chat.cpp chooses (common_chat_templates_apply_jinja):

- `<tool_call>` in the template: Hermes 2 Pro / Qwen 2.5 / Qwen 3
  (`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call);
- `<|start_header_id|>ipython<|end_header_id|>` in the template: Llama 3.x (one JSON object
  `{"name": ..., "parameters": {...}}`; Meta's template renders only one call per turn);
- a `<|tool_call|>` control token (Phi-4-mini, tools.py): `<|tool_call|>[...]<|/tool_call|>`;
- `<start_of_turn>` and no `tool_calls` in the template: Gemma 2 / 3, whose templates render
  neither tools nor calls. llama.cpp has no tool format for them: its differential autoparser
  finds none (chat-auto-parser-generator.cpp builds a tool parser and grammar only for a
  template whose jinja caps say supports_tool_calls) and reads the whole output as content
  (tests/test-chat.cpp: "Google Gemma 2 2B - does not support tool calling"). So tools are
  accepted and given to the template, which ignores them, and nothing is read as a call.

Templates get tools and calls as llama.cpp gives them: `tools` is OpenAI's list, an assistant
message's `tool_calls` carry arguments as parsed JSON (the templates `tojson` them), tool
results are `tool` messages; Llama 3 gets `tools_in_user_message = false` (llama.cpp's
common_chat_params_init_llama_3_x). Output is read in every form llama.cpp's parsers for the
template read, and under `auto` the grammar lets the model start any of them (call_forms.py);
the grammars allow only what the parsers read, so a constrained call always parses.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ane_spec.daemon.call_forms import (
    HERMES_FORMS,
    LLAMA3_FORMS,
    FormParser,
    hermes_auto_grammar,
    llama3_auto_grammar,
)
from ane_spec.daemon.protocol import ChatMessage, NamedToolChoice, Tool
from ane_spec.daemon.tools import (
    NO_PARAMETERS,
    PHI4_SYNTAX,
    TOOL_CALL,
    CallSyntax,
    ToolCallParser,
    parsed_arguments,
    template_messages,
    tool_call_grammar,
)
from ane_spec.decode.grammar import JSON_OPTIONS
from ane_spec.decode.grammar_limits import GrammarLimits
from ane_spec.decode.json_tightening import tighten

HERMES_CALL, HERMES_CALL_END = "<tool_call>", "</tool_call>"
LLAMA3_IPYTHON = "<|start_header_id|>ipython<|end_header_id|>"
# What llama.cpp's llm_chat_detect_template looks for to call a template Gemma's
# (LLM_CHAT_TEMPLATE_GEMMA); Gemma 4's templates use `<|turn>` instead.
GEMMA_TURN = "<start_of_turn>"


@dataclass(frozen=True)
class TemplateInput:
    """What the chat template is rendered with: messages, `tools`, more variables."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    extra: dict[str, Any] | None = None


class ToolFormat:
    """One family's format. Subclasses set `name` and `syntax` and build the grammar."""

    name: str
    syntax: CallSyntax
    # Tags that are ordinary (USER_DEFINED) tokens of the vocabulary, which message text must
    # not produce: a call or a tool result typed into a message stays text (see tool_tag_ids).
    tags: tuple[str, ...] = ()
    # The template reads an assistant message's `reasoning_content` (Qwen 3), see split_thinking.
    reasoning_field = False
    # Whether the model can call tools at all: False for a template with no tool-call format
    # (ContentOnlyFormat), whose output is all content, as llama.cpp reads it.
    calls = True

    def template_input(self, messages: list[ChatMessage], tools: list[Tool] | None,
                       limits: GrammarLimits = GrammarLimits()) -> TemplateInput:
        """Messages as llama.cpp hands them to a Jinja template (OpenAI's shape)."""
        out: list[dict[str, Any]] = []
        for m in messages:
            message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                       "content": m.text()}
            if m.role == "assistant" and self.reasoning_field and "</think>" in message["content"]:
                message.update(split_thinking(message["content"]))
            if m.role == "assistant" and m.tool_calls:
                message["tool_calls"] = [
                    {"type": "function", "id": c.id or "",
                     "function": {"name": c.function.name,
                                  "arguments": parsed_arguments(c.function.arguments, limits)}}
                    for c in m.tool_calls]
            out.append(message)
        listed = None if not tools else [t.model_dump(exclude_none=True) for t in tools]
        return TemplateInput(out, listed, self.extra())

    def extra(self) -> dict[str, Any] | None:
        return None

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.syntax)

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice | None,
                parallel: bool | None) -> str:
        raise NotImplementedError


def _call_schema(tools: list[Tool], choice: str | NamedToolChoice | None,
                 arguments_key: str) -> dict[str, Any]:
    """One call object, `{"name": <a tool's name>, <arguments_key>: <its parameters>}`, keys
    in that order (the parsers read them so)."""
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    return tighten({"anyOf": [{
        "type": "object",
        "properties": {"name": {"const": t.function.name},
                       arguments_key: t.function.parameters or NO_PARAMETERS},
        "required": ["name", arguments_key], "additionalProperties": False} for t in tools],
        "x-guidance": JSON_OPTIONS})


class Phi4Format(ToolFormat):
    """Phi-4-mini's `<|tool_call|>[...]<|/tool_call|>` (tools.py), its template's own input."""

    name = "phi4"
    syntax = PHI4_SYNTAX

    def template_input(self, messages: list[ChatMessage], tools: list[Tool] | None,
                       limits: GrammarLimits = GrammarLimits()) -> TemplateInput:
        return TemplateInput(template_messages(messages, tools, limits))

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice | None,
                parallel: bool | None) -> str:
        return tool_call_grammar(tools, choice, parallel)


def split_thinking(content: str) -> dict[str, str]:
    """An assistant message's `<think>...</think>` as `reasoning_content`, split exactly as
    Qwen 3's template splits it when given none. Done before rendering so that the template
    never cuts a message's text (render_chat_pieces would refuse the prompt): clients send
    back the think block that this server returns as content."""
    head, _, tail = content.partition("</think>")
    return {"reasoning_content": head.rstrip("\n").split("<think>")[-1].lstrip("\n"),
            "content": content.split("</think>")[-1].lstrip("\n")}


class HermesFormat(ToolFormat):
    """Qwen 2.5 / Qwen 3 (Hermes 2 Pro): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n
    </tool_call>` per call, calls separated by a newline, as the templates render them; read
    in every form llama.cpp's Hermes parsers read (call_forms.py), and under `auto` the model
    may start any of them."""

    name = "hermes"
    tags = (HERMES_CALL, HERMES_CALL_END, "<tool_response>", "</tool_response>")

    def parser(self) -> FormParser:
        return FormParser(HERMES_FORMS)

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice | None,
                parallel: bool | None) -> str:
        if choice in (None, "auto"):
            return hermes_auto_grammar(tools, parallel)
        # A forced call is written in the template's own form.
        schema = json.dumps(_call_schema(tools, choice, "arguments"))
        more = "" if parallel is False else f' ("\\n{HERMES_CALL}" body)*'
        return (f'start: "{HERMES_CALL}" body{more}\n'
                f'body: "\\n" %json {schema} "\\n{HERMES_CALL_END}"\n')


class Llama3Format(ToolFormat):
    """Llama 3.x: one `{"name": "f", "parameters": {...}}` (llama.cpp's parsers also read a
    leading `"type": "function"`, and text around the call), the template's own form when a
    call is forced."""

    name = "llama3"

    def extra(self) -> dict[str, Any] | None:
        return {"tools_in_user_message": False}

    def parser(self) -> FormParser:
        return FormParser(LLAMA3_FORMS)

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice | None,
                parallel: bool | None) -> str:
        if choice in (None, "auto"):
            return llama3_auto_grammar(tools)
        return f"start: call\ncall: %json {json.dumps(_call_schema(tools, choice, 'parameters'))}\n"


class Qwen3Format(HermesFormat):
    """Hermes calls, with a template that reads `reasoning_content` (Qwen 3)."""

    reasoning_field = True


class ContentOnlyFormat(ToolFormat):
    """A template with no tool-call format (Gemma 2 / 3): tools and earlier calls are handed to
    it as to any template (it renders neither), and the output is content, never a call, as
    llama.cpp's content-only parser reads it. Having no call syntax, it has no grammar: a call
    cannot be required (the server refuses tool_choice "required" or a named function, where
    llama.cpp would silently answer in text)."""

    name = "content"
    calls = False

    def parser(self) -> ToolCallParser:
        raise TypeError("a content-only template has no tool-call parser")

    def grammar(self, tools: list[Tool], choice: str | NamedToolChoice | None,
                parallel: bool | None) -> str:
        raise TypeError("a content-only template has no tool-call grammar")


PHI4, HERMES, QWEN3, LLAMA3 = Phi4Format(), HermesFormat(), Qwen3Format(), Llama3Format()
CONTENT_ONLY = ContentOnlyFormat()


def tool_tag_ids(fmt: ToolFormat, id_of: Any) -> list[int]:
    """The vocabulary's ids of `fmt`'s tags. llama.cpp (and HF) read Qwen's `<tool_call>` in
    any text, since it is not a control token; here message text never spells it, as it never
    spells `<|im_start|>`, so the model sees a call only where it or the template wrote one."""
    return [i for i in map(id_of, fmt.tags) if i is not None]


def tool_format_of(template: str | None, markup_ids: frozenset[int],
                   id_of: Any) -> ToolFormat | None:
    """The format a GGUF's template and vocabulary call tools in (CONTENT_ONLY: they cannot),
    or None where the server knows of none. `template` None is Phi-4-mini's own
    (chat.PHI4_MINI_CHAT_TEMPLATE)."""
    if template is not None and HERMES_CALL in template:
        return QWEN3 if "reasoning_content" in template else HERMES
    if template is not None and LLAMA3_IPYTHON in template:
        return LLAMA3
    if id_of(TOOL_CALL) in markup_ids:
        return PHI4
    if template is not None and GEMMA_TURN in template and "tool_calls" not in template:
        return CONTENT_ONLY
    return None


def can_call_tools(template: str | None, markup_ids: frozenset[int], id_of: Any) -> bool:
    """Whether the model has a tool-call format (what Ollama's "tools" capability says): not
    Gemma 3, whose tools are accepted but never called (Ollama lists none for it either)."""
    fmt = tool_format_of(template, markup_ids, id_of)
    return fmt is not None and fmt.calls
