"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered the way HF transformers does.

transformers renders chat templates with jinja2's `ImmutableSandboxedEnvironment`
(`trim_blocks`, `lstrip_blocks`, `raise_exception` available); so does this module. Phi-4-mini's
template gives `<|system|>SYS<|end|><|user|>MSG<|end|><|assistant|>`.

`render_chat_pieces` also says which characters of the prompt are the messages' own text, so
that a tokenizer can refuse to read special tokens there: `<|end|><|assistant|>` typed into a
message is text, not a forged turn. llama.cpp (and HF) render the prompt and then parse special
tokens anywhere in it; `render_chat` + `encode(special=True)` does that.
"""

from __future__ import annotations

import json
import secrets
from functools import lru_cache
from typing import Any

from ane_spec.errors import TokenizerError

# Phi-4-mini-instruct's template, verbatim (used when the GGUF carries none).
PHI4_MINI_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


class _TemplateRaised(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' replacement for jinja's tojson, which would HTML-escape '<' and '>'.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(str(fmt))


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    # Llama 3.x templates date the system turn with it; HF transformers and llama.cpp's minja
    # both provide it (with the current local date), and without it the template falls back
    # to a fixed 2024 date, so prompts would differ from theirs.
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    return env.from_string(template)


class Markup(str):
    """A piece of a message that is markup, not text: what the server itself writes into a
    message (Phi-4-mini's `<|tool_call|>` tags around a call), never a client's words."""


MessageText = str | list[str]  # a list mixes text (str) and Markup pieces


def _flat(value: MessageText) -> str:
    return value if isinstance(value, str) else "".join(value)


def _is_pieces(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(p, str) for p in value)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"messages must be a list of dicts, not {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TokenizerError(f"message {i} must be a dict, not {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise TokenizerError(f"message {i} has no '{key}'")
        if not isinstance(m["role"], str):
            raise TokenizerError(f"message {i}: 'role' must be a string, not "
                                 f"{type(m['role']).__name__}")
    return list(messages)


def render_chat(messages: list[dict], *, template: str | None,
                add_generation_prompt: bool = True, eos_token: str = "<|endoftext|>",
                bos_token: str = "<|endoftext|>", add_bos: bool = False,
                tools: list[dict] | None = None, extra: dict[str, Any] | None = None) -> str:
    """Render `messages` ({"role", "content"[, "tools"]} dicts) with `template`; a content
    given as a list of pieces (text and `Markup`) is joined.

    `template=None` means the GGUF had no `tokenizer.chat_template`: Phi-4-mini's own is used.
    With it, a system message's "tools" (a JSON string) goes between <|tool|> and <|/tool|>.
    `add_bos`: the prompt will be tokenized with BOS added (Llama 3), so a BOS the template
    writes first is dropped, as llama.cpp's common_chat_templates_apply does.
    `tools` (OpenAI's tool list) and `extra` (more template variables) are passed to the
    template as llama.cpp's common_chat_templates_apply passes them (Llama 3, Qwen templates).
    Template syntax errors and errors while rendering (a non-string content where the template
    concatenates, a `raise_exception` call, a sandbox violation) become `TokenizerError`.
    """
    msgs = [m | {k: _flat(m[k]) for k in ("content", "tools") if _is_pieces(m.get(k))}
            for m in _check_messages(messages)]
    source = PHI4_MINI_CHAT_TEMPLATE if template is None else template
    from jinja2 import TemplateSyntaxError

    try:
        compiled = _compile(source)
    except TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc}") from None
    try:
        variables = dict(extra or {})
        if tools is not None:
            variables["tools"] = tools
        text = compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               eos_token=eos_token, bos_token=bos_token, **variables)
        return text[len(bos_token):] if add_bos and bos_token and text.startswith(
            bos_token) else text
    except _TemplateRaised as exc:
        raise TokenizerError(f"the chat template refused the messages: {exc}") from None
    except Exception as exc:  # a GGUF's template is user input: any failure is the user's
        raise TokenizerError(f"the chat template failed to render: "
                             f"{type(exc).__name__}: {exc}") from None


def render_chat_pieces(messages: list[dict], *, template: str | None,
                       add_generation_prompt: bool = True, eos_token: str = "<|endoftext|>",
                       bos_token: str = "<|endoftext|>", add_bos: bool = False,
                       tools: list[dict] | None = None, extra: dict[str, Any] | None = None
                       ) -> list[tuple[str, bool]]:
    """`render_chat`'s prompt as (text, is_markup) pieces. Each message's "content", "tools"
    and "reasoning_content" is text (a plain str, or a list of str and `Markup`); so is every
    string inside a message's "tool_calls" and inside `tools` (names, descriptions, schemas,
    arguments: the client's words, which templates write with `tojson` or `+`); everything the
    template adds around them is markup.

    The template is rendered with each text piece wrapped in unguessable markers, and once
    without; the markers must come out intact and the two renders agree once they are removed
    (a template that trims content is fine: whitespace is kept outside the markers). A template
    that rewrites message text otherwise is refused, since its text could not be told from its
    markup.
    """
    # Private-use characters only: no template filter (replace, upper, ...) touches them.
    nonce = "".join(chr(0xE010 + secrets.randbelow(0x1000)) for _ in range(8))
    start, end = f"\ue000{nonce}\ue001", f"\ue002{nonce}\ue003"

    def marked(value: MessageText) -> str:
        pieces = [value] if isinstance(value, str) else value
        out = []
        for piece in pieces:
            if isinstance(piece, Markup) or not piece.strip():
                out.append(piece)
                continue
            core = piece.strip()
            lead = piece[:len(piece) - len(piece.lstrip())]
            out.append(f"{lead}{start}{core}{end}{piece[len(lead) + len(core):]}")
        return "".join(out)

    def deep(value: Any) -> Any:
        # Structural keys ("name", "function", ...) are read by the template and stay as they
        # are; only the leaves and the keys of schemas and arguments are the client's text.
        if isinstance(value, str):
            return marked(value)
        if isinstance(value, list):
            return [deep(v) for v in value]
        if isinstance(value, dict):
            return {k: (deep_all(v) if k in ("parameters", "arguments") else deep(v))
                    for k, v in value.items()}
        return value

    def deep_all(value: Any) -> Any:
        if isinstance(value, dict):
            return {marked(k) if isinstance(k, str) else k: deep_all(v) for k, v in value.items()}
        if isinstance(value, list):
            return [deep_all(v) for v in value]
        return marked(value) if isinstance(value, str) else value

    kw = dict(template=template, add_generation_prompt=add_generation_prompt,
              eos_token=eos_token, bos_token=bos_token, add_bos=add_bos, extra=extra)
    plain = render_chat(messages, tools=tools, **kw)
    texts = ("content", "tools", "reasoning_content")
    wrapped = render_chat([m | {k: marked(m[k]) for k in texts if m.get(k) is not None}
                           | ({"tool_calls": deep(m["tool_calls"])} if m.get("tool_calls")
                              else {})
                           for m in messages], tools=None if tools is None else deep(tools), **kw)
    pieces: list[tuple[str, bool]] = []
    rest = wrapped
    while rest:
        head, found, tail = rest.partition(start)
        pieces.append((head, True))
        if not found:
            break
        text, closed, rest = tail.partition(end)
        if not closed:
            break
        pieces.append((text, False))
    if "".join(p for p, _ in pieces) != plain or any(start in p or end in p for p, _ in pieces):
        raise TokenizerError("the chat template rewrites message text, so the messages' own "
                             "text cannot be told from the template's markup; serve with "
                             "--special-in-content to tokenize the prompt as llama.cpp does")
    return [p for p in pieces if p[0]]
