"""Chat prompts: Phi-4-mini's template (built in or from the GGUF) rendered as HF does."""

from __future__ import annotations

import json

import pytest

from ane_spec.errors import TokenizerError
from ane_spec.model.chat import PHI4_MINI_CHAT_TEMPLATE, render_chat
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab

# Verbatim from Phi-4-mini-instruct's tokenizer_config.json (what a GGUF carries).
GGUF_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3?"},
]
EXPECTED = ("<|system|>You are a helpful assistant.<|end|><|user|>What is 2+2?<|end|>"
            "<|assistant|>4.<|end|><|user|>And 3+3?<|end|><|assistant|>")


def test_builtin_template_is_phi4_minis() -> None:
    assert PHI4_MINI_CHAT_TEMPLATE == GGUF_TEMPLATE


@pytest.mark.parametrize("template", [None, GGUF_TEMPLATE])
def test_conversation(template: str | None) -> None:
    assert render_chat(CONVERSATION, template=template) == EXPECTED
    assert render_chat(CONVERSATION[1:2], template=template) == \
        "<|user|>What is 2+2?<|end|><|assistant|>"
    assert render_chat([], template=template) == "<|assistant|>"


def test_no_generation_prompt_ends_with_eos() -> None:
    out = render_chat(CONVERSATION[:3], template=None, add_generation_prompt=False)
    assert out == EXPECTED[:EXPECTED.index("<|user|>And")] + "<|endoftext|>"
    assert render_chat(CONVERSATION[:1], template=GGUF_TEMPLATE, add_generation_prompt=False,
                       eos_token="</s>").endswith("<|end|></s>")


def test_tools() -> None:
    tools = json.dumps([{"name": "get_weather", "description": "Weather for a city",
                         "parameters": {"city": {"type": "str"}}}])
    msgs = [{"role": "system", "content": "Use tools.", "tools": tools},
            {"role": "user", "content": "Weather in Paris?"}]
    for template in (None, GGUF_TEMPLATE):
        assert render_chat(msgs, template=template) == (
            f"<|system|>Use tools.<|tool|>{tools}<|/tool|><|end|><|user|>Weather in Paris?<|end|>"
            "<|assistant|>")
    # tools=None, or tools on a non-system message, change nothing.
    plain = [{"role": "system", "content": "S", "tools": None},
             {"role": "user", "content": "U", "tools": tools}]
    assert render_chat(plain, template=None) == "<|system|>S<|end|><|user|>U<|end|><|assistant|>"


def test_other_templates_are_honoured() -> None:
    chatml = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    out = render_chat(CONVERSATION[1:2], template=chatml)
    assert out == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    # HF's environment: trim_blocks/lstrip_blocks, loop controls, tojson without HTML escaping.
    tmpl = ("{% for m in messages %}\n  {% if loop.index > 1 %}{% break %}{% endif %}\n"
            "{{ m | tojson }}\n{% endfor %}")
    assert render_chat([{"role": "user", "content": "<b>"}] * 2, template=tmpl) == \
        '{"role": "user", "content": "<b>"}\n'


def test_errors() -> None:
    with pytest.raises(TokenizerError, match="message 1 has no 'content'"):
        render_chat([{"role": "user", "content": "a"}, {"role": "user"}], template=None)
    with pytest.raises(TokenizerError, match="message 0 has no 'role'"):
        render_chat([{"content": "a"}], template=GGUF_TEMPLATE)
    with pytest.raises(TokenizerError, match="must be a dict"):
        render_chat(["hello"], template=None)
    with pytest.raises(TokenizerError, match="list of dicts"):
        render_chat("hello", template=None)  # type: ignore[arg-type]
    with pytest.raises(TokenizerError, match="does not parse"):
        render_chat(CONVERSATION, template="{% for m in messages %}{{ m['role'] }")
    with pytest.raises(TokenizerError, match="refused the messages: no system role"):
        render_chat(CONVERSATION, template="{{ raise_exception('no system role') }}")
    with pytest.raises(TokenizerError, match="failed to render: TypeError"):
        render_chat([{"role": "user", "content": None}], template=None)
    with pytest.raises(TokenizerError, match="failed to render"):  # the sandbox holds
        render_chat(CONVERSATION, template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError, match="failed to render"):  # and is immutable
        render_chat(CONVERSATION, template="{{ messages.append(1) }}")


def test_rendered_prompt_tokenizes_to_control_tokens() -> None:
    data = build_synthetic_vocab(200064)
    tok = Tokenizer.from_data(data)
    prompt = render_chat(CONVERSATION, template=data.chat_template)
    ids = tok.encode(prompt, special=True)
    assert ids[0] == 200022 and ids[-1] == 200019  # <|system|> ... <|assistant|>
    assert ids.count(200020) == 4 and ids.count(200021) == 2  # <|end|>, <|user|>
    assert tok.decode(ids) == prompt
    assert tok.decode(ids, skip_special=True) == "".join(m["content"] for m in CONVERSATION)


# -- Gemma 3 ------------------------------------------------------------------------------------

GEMMA_CHATS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": " padded\n"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}],
    [{"role": "user", "content": "a\n\nb"}, {"role": "assistant", "content": "c"}],
    [{"role": "user", "content": "Écris «ça» 😀"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "<b>tags</b> stay text"}],
]


def _gemma(messages: list[dict], add_generation_prompt: bool = True) -> str:
    from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE

    return render_chat(messages, template=GEMMA3_CHAT_TEMPLATE, bos_token="<bos>",
                       eos_token="<eos>", add_bos=True,
                       add_generation_prompt=add_generation_prompt)


def test_gemma3_template() -> None:
    """Gemma 3's rules: no system turn (its text opens the first user turn), "model" for
    "assistant", contents trimmed, roles alternating; BOS is the tokenizer's (add_bos)."""
    assert _gemma(GEMMA_CHATS[2]) == (
        "<start_of_turn>user\nS\n\npadded<end_of_turn>\n<start_of_turn>model\n4.<end_of_turn>\n"
        "<start_of_turn>user\nAnd 3+3?<end_of_turn>\n<start_of_turn>model\n")
    assert _gemma(GEMMA_CHATS[3], add_generation_prompt=False) == (
        "<start_of_turn>user\na\n\nb<end_of_turn>\n<start_of_turn>model\nc<end_of_turn>\n")
    # Content parts: text trimmed, an image as <start_of_image>.
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " x "}]}]
    assert _gemma(parts).startswith("<start_of_turn>user\n<start_of_image>x<end_of_turn>")
    from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE

    assert render_chat(GEMMA_CHATS[0], template=GEMMA3_CHAT_TEMPLATE, bos_token="<bos>") \
        .startswith("<bos><start_of_turn>user\n")  # without add_bos, the template writes it
    with pytest.raises(TokenizerError, match="Conversation roles must alternate"):
        _gemma([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(TokenizerError, match="Conversation roles must alternate"):
        _gemma([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                {"role": "tool", "content": "{}"}])


@pytest.mark.oracle
def test_gemma3_template_matches_llama_cpp() -> None:
    """llama.cpp renders a template containing <start_of_turn> with its built-in
    LLM_CHAT_TEMPLATE_GEMMA (llama_chat_apply_template: no BOS, which the tokenizer adds), and
    llama-cpp-python's Jinja2ChatFormatter runs the template itself (BOS included); both agree
    with this renderer on every conversation here. (They part only where a system message has
    surrounding whitespace: llama.cpp's built-in trims it, the template keeps it.)"""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE

    formatter = Jinja2ChatFormatter(GEMMA3_CHAT_TEMPLATE, eos_token="<eos>", bos_token="<bos>")
    for chat in GEMMA_CHATS:
        for add_gen in (True, False):
            ours = _gemma(chat, add_generation_prompt=add_gen)
            keep = [(m["role"].encode(), m["content"].encode()) for m in chat]
            msgs = (llama_cpp.llama_chat_message * len(chat))(
                *[llama_cpp.llama_chat_message(role=r, content=c) for r, c in keep])
            buf = llama_cpp.ctypes.create_string_buffer(4096)
            n = llama_cpp.llama_chat_apply_template(GEMMA3_CHAT_TEMPLATE.encode(), msgs,
                                                    len(chat), add_gen, buf, len(buf))
            assert 0 < n < len(buf) and buf.raw[:n].decode() == ours, chat
            if add_gen:
                assert formatter(messages=chat).prompt == "<bos>" + ours


def test_gemma3_prompt_tokenizes_to_its_turn_tokens() -> None:
    from ane_spec.model.chat_templates import GEMMA3_CHAT_TEMPLATE

    data = build_synthetic_vocab(2048, family="gemma3")
    assert data.chat_template == GEMMA3_CHAT_TEMPLATE
    tok = Tokenizer.from_data(data)
    ids = tok.encode(_gemma(GEMMA_CHATS[2]), special=True, add_special=True)
    assert ids[:3] == [2, 105, tok.id_of("user")]  # <bos> once, then <start_of_turn>
    assert ids.count(105) == 4 and ids.count(106) == 3 and ids[-1] == tok.id_of("\n")
    assert tok.decode(ids, skip_special=True) == (
        "user\nS\n\npadded\nmodel\n4.\nuser\nAnd 3+3?\nmodel\n")
