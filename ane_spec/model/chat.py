"""Chat prompts: the GGUF's `tokenizer.chat_template` rendered the way HF transformers does.

transformers renders chat templates with jinja2's `ImmutableSandboxedEnvironment`
(`trim_blocks`, `lstrip_blocks`, `raise_exception` available); so does this module. Phi-4-mini's
template gives `<|system|>SYS<|end|><|user|>MSG<|end|><|assistant|>`.
"""

from __future__ import annotations

import json
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


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    return env.from_string(template)


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
                bos_token: str = "<|endoftext|>") -> str:
    """Render `messages` ({"role", "content"[, "tools"]} dicts) with `template`.

    `template=None` means the GGUF had no `tokenizer.chat_template`: Phi-4-mini's own is used.
    With it, a system message's "tools" (a JSON string) goes between <|tool|> and <|/tool|>.
    Template syntax errors and errors while rendering (a non-string content where the template
    concatenates, a `raise_exception` call, a sandbox violation) become `TokenizerError`.
    """
    msgs = _check_messages(messages)
    source = PHI4_MINI_CHAT_TEMPLATE if template is None else template
    from jinja2 import TemplateSyntaxError

    try:
        compiled = _compile(source)
    except TemplateSyntaxError as exc:
        raise TokenizerError(f"the chat template does not parse: {exc}") from None
    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               eos_token=eos_token, bos_token=bos_token)
    except _TemplateRaised as exc:
        raise TokenizerError(f"the chat template refused the messages: {exc}") from None
    except Exception as exc:  # a GGUF's template is user input: any failure is the user's
        raise TokenizerError(f"the chat template failed to render: "
                             f"{type(exc).__name__}: {exc}") from None
