"""Issue 29, items 1 and 6: tool calls as models write them, and tests that notice a lost call.

Offline: llama.cpp's own parser cases for the Hermes 2 Pro / Qwen and Llama 3.x templates, as
data (each read whole and piece by piece), and the `auto` grammars (every form a model may
start, nothing forged). Live: real servers over small Qwen 3 and Llama 3 builds whose output a
*constructed grammar* fixes (the format's grammar, replaced from the test): calls in each form
under `auto` come back as tool_calls on every adapter, streamed and not, call for call; the
server's own re-check refuses what the grammar should have prevented.

Ported from llama.cpp (the sources: llama-cpp-python 0.3.36's vendored `tests/test-chat.cpp`,
which runs the PEG autoparser, and the `tests/test-chat.cpp` of the regex-parser era, from the
ik_llama.cpp fork that still carries it: `COMMON_CHAT_FORMAT_HERMES_2_PRO` and
`COMMON_CHAT_FORMAT_LLAMA_3_X` blocks):

- Hermes 2 Pro (regex era), every non-partial parse case without reasoning: `<tool_call>`
  with and without newlines, content before it, `<function=f>` and `<function name="f">`,
  the tags `<tool>`, `<tools>`, `<response>`, `<json>`, `<xml>`, `<JSON>`, fences ```json,
  ```xml and ```, a fence around `<response>` and `<function_call>`, bare objects (one line and
  pretty), two `<tool_call>` and two `<function=...>` calls, "This is not a tool call:" text
  before a bare call, plain content. The partial cases `<tool_call>{"name` and
  ```` ```json\\n<function_call> { "name" : "python" ````: here a call exists only once its
  arguments have begun (tools.py), so these give no call and no markup in the content.
- Hermes 2 Pro / Hermes 3 / Qwen 2.5 (PEG): the `<tool_call>` case with and without content,
  and plain content; Reka Edge's (the same `<tool_call>` JSON format) two parallel calls and
  its call cut inside the arguments (`{"arg`).
- Llama 3.x: `{"name": ..., "parameters": ...}` (regex era) and content with tools defined
  (PEG, 3.1/3.2/3.3); plus the two things those parsers read that no case pins: the
  `"type": "function"` prefix (regex era's function_regex) and text before the call (PEG's
  content-until-`{`).

Left out, and why: everything about `<think>` reasoning (ane-spec returns a think block as
content, it has no reasoning_format); `parse_tool_calls = false` (the parser runs only with
tools); Llama 3.1's `<|python_tag|>` built-in tools (`python.call(code=...)`: ane-spec
defines no built-in tools); continuation (`continue_final_message`) and json_schema cases
(not tool calls); template rendering (`test_templates`: tests/test_tool_formats.py checks the
prompts); the other templates' formats. Phi-4-mini: llama.cpp has no parser or test for its
`<|tool_call|>` format, so nothing to port.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ane_spec.daemon import call_forms
from ane_spec.daemon.call_forms import HERMES_TAGS
from ane_spec.daemon.protocol import Tool
from ane_spec.daemon.tool_formats import HERMES, LLAMA3, PHI4, HermesFormat, Llama3Format
from ane_spec.decode.grammar import Grammar, lark_grammar
from tests.test_tool_formats import accepts, tokenizer

SPECIAL = ("special_function", '{"arg1": 1}')
PYTHON = ("python", '{"code":"print(\'hello\')"}')
CALL = '{"name": "special_function", "arguments": {"arg1": 1}}'
HELLO = "Hello, world!\nWhat's up?"

# (text, content, calls): llama.cpp's Hermes 2 Pro parse cases (module docstring).
HERMES_CASES = [
    (f"<tool_call>\n{CALL}\n</tool_call>", "", [SPECIAL]),
    (f"<tool_call>\n{CALL}</tool_call>", "", [SPECIAL]),
    (f"<tool_call>{CALL}</tool_call>", "", [SPECIAL]),
    (f"{HELLO}<tool_call>\n{CALL}\n</tool_call>", HELLO, [SPECIAL]),
    (f"{HELLO}<tool_call>\n{CALL}</tool_call>", HELLO, [SPECIAL]),
    ('<function=special_function>{"arg1": 1}</function>', "", [SPECIAL]),
    ('<function name="special_function">\n{"arg1": 1}\n</function>', "", [SPECIAL]),
    (f"<tool>\n  {CALL}\n</tool>", "", [SPECIAL]),
    (f"<tools>\n  {CALL}\n</tools>", "", [SPECIAL]),
    (f"<response>\n  {CALL}\n</response>", "", [SPECIAL]),
    (f"```xml\n<response>\n    {CALL}\n</response>\n```", "", [SPECIAL]),
    (f"```xml\n  {CALL}\n```", "", [SPECIAL]),
    (f"```\n  {CALL}\n```", "", [SPECIAL]),
    (f"```\n{CALL}\n```", "", [SPECIAL]),
    (f"```json\n  {CALL}\n```", "", [SPECIAL]),
    (f"```json\n\n                    <function_call> {CALL} \n"
     "                    </function_call> \n``` ", "", [SPECIAL]),
    (f"<json>\n  {CALL}\n</json>", "", [SPECIAL]),
    ('<xml>\n  {\n    "name": "special_function", "arguments": {"arg1": 1}\n  }\n</xml>', "",
     [SPECIAL]),
    (f"<JSON>\n  {CALL}\n</JSON>", "", [SPECIAL]),
    (CALL, "", [SPECIAL]),
    ('{\n  "name": "special_function", "arguments": {"arg1": 1}}', "", [SPECIAL]),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "python", "arguments": {"code":"print(\'hello\')"}}\n</tool_call>', "",
     [SPECIAL, PYTHON]),
    ('<function=special_function>{"arg1": 1}</function>\n'
     '<function=python>{"code":"print(\'hello\')"}</function>', "", [SPECIAL, PYTHON]),
    (f"This is not a tool call:\n{CALL}", "This is not a tool call:", [SPECIAL]),
    (HELLO, HELLO, []),
    # Reka Edge (PEG): two parallel calls; a call cut inside its arguments.
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}\n</tool_call>',
     "", [SPECIAL, ("special_function_with_opt", '{"arg1": 1, "arg2": 2}')]),
    ('<tool_call>\n{"name": "special_function", "arguments": {"arg', "",
     [("special_function", '{"arg')]),
    # Partial (regex era): cut inside the opening, so no call, and no markup in the content.
    ("Let's call something\n<tool_call>{\"name\"", "Let's call something\n", []),
    ("Let's call something\n<tool_call>{\"name", "Let's call something\n", []),
    ('```json\n<function_call> { "name" : "python"', "", []),
    # Not calls: an object without arguments, a `{` in text.
    ('x {"name": "Bob"} y', 'x {"name": "Bob"} y', []),
    ("a < b and `c` {d}\n\n", "a < b and `c` {d}\n\n", []),
]

LLAMA3_CASES = [
    ('{"name": "special_function", "parameters": {"arg1": 1}}', "", [SPECIAL]),
    (HELLO, HELLO, []),
    ('{"type": "function", "name": "special_function", "parameters": {"arg1": 1}}', "",
     [SPECIAL]),
    ('Sure: {"name": "special_function", "parameters": {"arg1": 1}}', "Sure: ", [SPECIAL]),
    ('{"name": "special_function", "parameters": {"arg', "", [("special_function", '{"arg')]),
]


def parse(fmt, text: str, size: int | None = None) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) of `text` read whole or `size` characters at a time;
    the streamed deltas must add up to the same calls."""
    parser, content, args = fmt.parser(), "", {}
    for i in range(0, len(text), size or len(text) or 1):
        piece, deltas = parser.feed(text[i:i + (size or len(text))])
        content += piece
        assert len({d["index"] for d in deltas}) == len(deltas)
        for d in deltas:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    content += parser.finish()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    assert [args[i] for i in sorted(args)] == [a for _, a in calls]
    return content, calls


@pytest.mark.parametrize("fmt,text,content,calls",
                         [(HERMES, *c) for c in HERMES_CASES] + [(LLAMA3, *c)
                                                                 for c in LLAMA3_CASES])
def test_llama_cpp_parser_cases(fmt, text: str, content: str, calls) -> None:
    assert parse(fmt, text) == (content, calls)
    for size in (1, 2, 3, 7):
        assert parse(fmt, text, size) == (content, calls), size


# -- the auto grammars ----------------------------------------------------------------------------

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}})
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "get_time.v2"}})
OBJ = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ARGS = '{"city": "Paris"}'
# Every form the Hermes grammar lets a model write (compact JSON, as JSON_OPTIONS has it).
HERMES_FORMS = {
    "tool_call": f"<tool_call>\n{OBJ}\n</tool_call>",
    "fence_json": f"```json\n{OBJ}\n```",
    "fence_xml": f"```xml\n{OBJ}\n```",
    "fence": f"```\n{OBJ}\n```",
    "fenced_tool_call": f"```json\n<tool_call>\n{OBJ}\n</tool_call>\n```",
    "bare": OBJ,
    "function_eq": f"<function=get_weather>{ARGS}</function>",
    "function_name": f'<function name="get_weather">\n{ARGS}\n</function>',
    **{f"tag_{t}": f"<{t}>\n{OBJ}\n</{t}>" for t in HERMES_TAGS[1:]},
}


@lru_cache(maxsize=None)
def hermes_auto(parallel: bool | None = None) -> Grammar:
    return Grammar(tokenizer("qwen3"), lark_grammar(HERMES.grammar([WEATHER, CLOCK], "auto",
                                                                   parallel)))


@pytest.mark.parametrize("form", sorted(HERMES_FORMS))
def test_the_hermes_auto_grammar_lets_a_model_start_every_form(form: str) -> None:
    """Each form, alone, after text and followed by another call, is in the language and
    parses to exactly the calls written; the same form with an undefined tool or arguments its
    schema refuses is not."""
    tok, text = tokenizer("qwen3"), HERMES_FORMS[form]
    time_call = '<tool_call>\n{"name": "get_time.v2", "arguments": {}}\n</tool_call>'
    for reply, content, n in [(text, "", 1), ("Let me look.\n" + text, "Let me look.", 1),
                              (text + "\n" + time_call, "", 2)]:
        assert accepts(hermes_auto(), tok.encode(reply)), reply
        got_content, calls = parse(HERMES, reply)
        assert len(calls) == n and calls[0] == ("get_weather", ARGS), calls
        assert got_content.strip() == content
    assert not accepts(hermes_auto(False), tok.encode(text + "\n" + time_call))
    assert not accepts(hermes_auto(), tok.encode(text.replace("get_weather", "rm_rf")))
    assert not accepts(hermes_auto(), tok.encode(text.replace('"Paris"', "3")))


def test_the_auto_grammars_keep_text_text() -> None:
    tok = tokenizer("qwen3")
    for text in ["plain text", "```python\nprint({'a': 1})\n```", "x < y > z", '{"a": 1}',
                 "<tools>list</tools>"]:
        assert accepts(hermes_auto(), tok.encode(text)) and parse(HERMES, text) == (text, [])
    # What llama.cpp's parser would read as a call is never plain text.
    for text in ['say {"name": "x"} now', "say <tool_call> please",
                 "<function=get_weather> is a tag"]:
        assert not accepts(hermes_auto(), tok.encode(text)), text
    tok = tokenizer("llama3")
    grammar = Grammar(tok, lark_grammar(LLAMA3.grammar([WEATHER], "auto", None)))
    call = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for reply in [call, "Sure: " + call, call.replace("{", '{"type": "function", ', 1)]:
        assert accepts(grammar, tok.encode(reply))
        assert parse(LLAMA3, reply)[1] == [("get_weather", ARGS)]
    assert accepts(grammar, tok.encode("It is sunny."))
    assert not accepts(grammar, tok.encode(call.replace("get_weather", "rm_rf")))


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_calls_opening_holds_only_llama_cpps_whitespace(family: str) -> None:
    """Between a call's `{` and its `"name"` the grammar allows llama.cpp's `space` (nothing, a
    space, or a newline and up to 20 spaces or tabs), not `\\s*`: given that, a tiny random
    Llama 3 with `{` biased wrote 25 whitespace tokens and Unicode spaces after it, and
    never reached the call in 120 tokens (test_tool_formats' streamed-call test on an AVX-512
    machine). The parser still reads any whitespace there (call_forms._NAME_RX)."""
    tok = tokenizer(family)
    fmt = LLAMA3 if family == "llama3" else HERMES
    grammar = Grammar(tok, lark_grammar(fmt.grammar([WEATHER], "auto", None)))
    key = "parameters" if family == "llama3" else "arguments"
    for space in ("", " ", "\n", "\n" + " " * 20, "\n\t\t"):
        call = f'{{{space}"name": "get_weather", "{key}": {{"city": "Paris"}}}}'
        assert accepts(grammar, tok.encode(call)), repr(space)
        assert parse(fmt, call)[1] == [("get_weather", ARGS)]
    for space in (" " * 2, "\n" + " " * 21, "\u3000", "\n\n"):
        assert not accepts(grammar, tok.encode(f'{{{space}"name"'), prefix=True), repr(space)
    if family == "llama3":  # its `{"type": "function", ...}` header too
        assert accepts(grammar, tok.encode(
            '{"type": "function",\n    "name": "get_weather", "parameters": {"city": "Paris"}}'))
        assert not accepts(grammar, tok.encode('{"type"    : "function"'), prefix=True)


# -- whitespace runs (issue 36) -------------------------------------------------------------------

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench_tool_call_parser.py"
_bench_spec = importlib.util.spec_from_file_location("bench_tool_call_parser", BENCH)
bench = importlib.util.module_from_spec(_bench_spec)
_bench_spec.loader.exec_module(bench)
FAMILIES = {"hermes": HERMES, "llama3": LLAMA3, "phi4": PHI4}


def test_a_whitespace_run_costs_linear_time_in_every_familys_forms() -> None:
    """64 KiB of whitespace, then `x`, in plain text and after every kind of opening, header
    and call, read whole and in 4-character pieces: each well under 100 ms, checked as < 1 s
    (a quadratic parse took 19.9 s for 16,000 spaces; streamed, 8,000 took over 60 s). The
    script runs each case in a child process it kills after 5 s, so a slow parser fails the
    test instead of hanging it."""
    out = subprocess.run([sys.executable, str(BENCH), "--json", "--timeout", "5"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["family"] for r in rows} == set(FAMILIES) and len(rows) > 20
    for r in rows:
        print(f"{r['family']:7} {r['case']:24} whole {r['whole']} s, 4-char pieces "
              f"{r['pieces']} s")
    slow = [(r["family"], r["case"], r["whole"], r["pieces"]) for r in rows
            if r["whole"] is None or r["pieces"] is None or max(r["whole"], r["pieces"]) >= 1]
    assert not slow, slow


def test_a_whitespace_run_reads_the_same_whole_and_streamed() -> None:
    run = (bench.WS * 7000)[:64 * 1024]
    for family, openings in bench.cases().items():
        fmt = FAMILIES[family]
        for name, opening in openings.items():
            text = opening + run + "x"
            whole = parse(fmt, text)
            assert parse(fmt, text, 4) == whole, (family, name)
            short = opening + run[:700] + "x"
            assert parse(fmt, short, 1) == parse(fmt, short), (family, name)
            if name == "text":  # no call, and not a character held back or lost
                assert whole == (text, [])


@pytest.mark.parametrize("forms", [call_forms.HERMES_FORMS, call_forms.LLAMA3_FORMS])
def test_an_opening_begins_only_at_its_openers(forms) -> None:
    """The search tries only `Forms.openers` (and whitespace before a Hermes `{`): no other
    character may begin an opening."""
    starts = {chr(c) for c in range(0x3000) if forms.trigger.could_become(chr(c))}
    assert {c for c in starts if not c.isspace()} == set(forms.openers)
    assert forms.space_opens == any(c.isspace() for c in starts)


FRAGMENTS = ["<tool_call>", "</tool_call>", "```json\n", "```", "{", "}", '"name"', ": ", '"f"',
             ", ", '"arguments"', '"parameters"', '"type": "function", ', "{}", '{"a": [1, "}"]}',
             "<function=", "f>", '<function name="', 'f">', "</function>", " ", "\n", "\t",
             "    ", "x", "<", ">", "<tools>", '"', "\\", "<|tool_call|>", "[", "]", ",",
             "<|/tool_call|>", '{"name": "f", "arguments": {"a": 1}}']


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=24),
       st.lists(st.integers(1, 9), min_size=1, max_size=40), st.sampled_from(sorted(FAMILIES)))
def test_any_text_reads_the_same_in_any_pieces(fragments, sizes, family) -> None:
    """Whitespace pieces are queued, not parsed, while a check waits on text ending in
    whitespace: whatever the cut, the content and calls are those of the text read whole."""
    text, fmt = "".join(fragments), FAMILIES[family]
    parser, content, i, k = fmt.parser(), "", 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        content += parser.feed(text[i:i + n])[0]
        i, k = i + n, k + 1
    content += parser.finish()
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in parser.calls]
    assert (content, calls) == parse(fmt, text)


# -- live: constructed grammars on real servers ---------------------------------------------------

CITY = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
        "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory):
    from ane_spec.daemon.config import ServeConfig
    from ane_spec.model.synthetic import write_synthetic_gguf
    from ane_spec.shards.build import BuildRequest, build
    from tests.live_server import started
    from tests.test_architectures import spec

    root = tmp_path_factory.mktemp("call-forms")
    out = {}
    for arch in ("qwen3", "llama"):
        gguf = write_synthetic_gguf(root / f"{arch}.gguf", spec(arch, seed=11, num_layers=2))
        build(gguf, root / arch, BuildRequest(topology="2", max_seq=768))
        out[arch] = started(ServeConfig(manifest=root / arch, port=0, backend="mil",
                                        precision="fp16", log_level="warning",
                                        access_log=False))
    yield out
    for srv in out.values():
        srv.stop()


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch):
    """`forced(text)`: every tool request's grammar (any family, any tool_choice) becomes one
    that allows exactly `text`, so the model writes it whatever its weights."""
    def force(text: str) -> None:
        literal = json.dumps(text)  # a Lark string literal: the same escapes
        for cls in (HermesFormat, Llama3Format):
            monkeypatch.setattr(cls, "grammar", lambda self, *a, **k: f"start: {literal}\n")
    return force


def chat(url: str, stream: bool, path: str = "/v1/chat/completions", **kw):
    """(status, content, finish_reason, [(name, arguments)], error) of a chat request."""
    body = {"model": "m", "messages": ASK, "tools": [CITY], "tool_choice": "auto",
            "max_tokens": 200, "stream": stream} | kw
    if not stream:
        r = httpx.post(f"{url}{path}", json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code, None, None, [], r.json()["error"]
        choice = r.json()["choices"][0]
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in choice["message"].get("tool_calls") or ()]
        return 200, choice["message"]["content"], choice["finish_reason"], calls, None
    import openai

    from tests.test_daemon_clients import streamed
    chunks, error = [], None
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if "error" in data:
                error = data["error"]
                continue
            chunks.append(openai.types.chat.ChatCompletionChunk.model_validate(data))
    content, reason, calls = streamed(chunks)
    return r.status_code, content, reason, [(c["name"], c["arguments"]) for c in calls], error


def responses(url: str, stream: bool, **kw):
    """(status, [(name, arguments)], status field, error) of a Responses request."""
    body = {"model": "m", "input": ASK[0]["content"], "max_output_tokens": 200,
            "tools": [{"type": "function"} | CITY["function"]], "stream": stream} | kw
    if not stream:
        r = httpx.post(f"{url}/v1/responses", json=body, timeout=120)
        if r.status_code != 200:
            return r.status_code, [], None, r.json()["error"]
        out = r.json()
        return 200, [(o["name"], o["arguments"]) for o in out["output"]
                     if o["type"] == "function_call"], out["status"], None
    final, error = None, None
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] in ("response.completed", "response.incomplete",
                                     "response.failed"):
                    final = event["response"]
                elif event["type"] == "error":
                    error = event
    calls = [(o["name"], o["arguments"]) for o in (final or {}).get("output", ())
             if o["type"] == "function_call"]
    return r.status_code, calls, (final or {}).get("status"), error or (final or {}).get("error")


def ollama(url: str, stream: bool, **kw):
    """(status, [(name, arguments as JSON text)], error) of an /api/chat request."""
    body = {"model": "m", "messages": ASK, "tools": [CITY], "stream": stream,
            "options": {"num_predict": 200}} | kw
    messages, error = [], None
    if not stream:
        r = httpx.post(f"{url}/api/chat", json=body, timeout=120)
        data = r.json()
        error = data.get("error")
        messages = [data["message"]] if "message" in data else []
    else:
        with httpx.stream("POST", f"{url}/api/chat", json=body, timeout=120) as r:
            for line in r.iter_lines():
                data = json.loads(line)
                error = data.get("error", error)
                if "message" in data:
                    messages.append(data["message"])
    calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"]))
             for m in messages for c in m.get("tool_calls") or ()]
    return r.status_code, calls, error


def _args(calls):
    """Calls with their arguments parsed: Ollama re-serialises them."""
    return [(n, json.loads(a)) for n, a in calls]


# Forms of three calls (to see the last one kept) with the content they leave.
THREE = [("Paris", "<tool_call>\n"), ("Rome", "```json\n"), ("Oslo", "")]
HERMES_LIVE = {
    "fence": ('Checking.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              "\n```", "Checking.\n", ["Paris"]),
    "bare": ('{"name": "get_weather", "arguments": {"city": "Paris"}}', "", ["Paris"]),
    "function": ('<function=get_weather>{"city": "Paris"}</function>', "", ["Paris"]),
    "three": ("\n".join(
        f'{lead}{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}'
        + {"<tool_call>\n": "\n</tool_call>", "```json\n": "\n```", "": ""}[lead]
        for c, lead in THREE), "", [c for c, _ in THREE]),
}


@pytest.mark.parametrize("form", sorted(HERMES_LIVE))
def test_auto_calls_in_any_form_reach_every_adapter_call_for_call(servers, forced,
                                                                  form: str) -> None:
    """A call written in any accepted form under `auto` comes back as tool calls, with no
    markup in the content, from /v1/chat/completions, llama-server's /chat/completions, the
    Responses API and Ollama's /api/chat, streamed and not: the same calls, all of them."""
    text, content, cities = HERMES_LIVE[form]
    forced(text)
    url = servers["qwen3"].url
    expected = [("get_weather", json.dumps({"city": c})) for c in cities]
    for path in ("/v1/chat/completions", "/chat/completions"):
        for stream in (False, True):
            status, got_content, reason, calls, error = chat(url, stream, path)
            assert (status, error, reason) == (200, None, "tool_calls"), (path, stream, error)
            assert calls == expected, (path, stream)
            assert (got_content or "") == content, (path, stream)
    for stream in (False, True):
        status, calls, state, error = responses(url, stream)
        assert (status, error, state) == (200, None, "completed"), (stream, error)
        assert calls == expected, stream
        status, calls, error = ollama(url, stream)
        assert (status, error) == (200, None) and _args(calls) == _args(expected), stream


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}',
    'Sure: {"name": "get_weather", "parameters": {"city": "Paris"}}'])
def test_llama3_calls_streamed_and_not(servers, forced, text: str) -> None:
    forced(text)
    url = servers["llama"].url
    answers = [chat(url, stream) for stream in (False, True)]
    for status, content, reason, calls, error in answers:
        assert (status, error, reason) == (200, None, "tool_calls")
        assert calls == [("get_weather", '{"city": "Paris"}')]
        assert (content or "") == text.split("{")[0]


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
    '```json\n{"name": "rm_rf", "arguments": {}}\n```',
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": 3}}\n</tool_call>',
    '{"name": "get_weather", "arguments": {"town": "Paris"}}',
    # the last of several calls is the bad one: the good ones must not pass alone
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'])
def test_the_server_rechecks_calls_end_to_end(servers, forced, bad: str) -> None:
    """Calls the grammar should have prevented (an undefined tool, arguments the schema
    refuses), made by a constructed grammar under `auto`, are refused by the server itself:
    500 `invalid_output` unstreamed, an error event after the stream's text, on every
    adapter. Nothing reports them as ordinary calls."""
    forced(bad)
    url = servers["qwen3"].url
    for path in ("/v1/chat/completions", "/chat/completions"):
        status, _, _, calls, error = chat(url, False, path)
        assert status == 500 and error["code"] == "invalid_output", (path, error)
        assert "a bug in ane-spec" in error["message"]
        status, _, _, calls, error = chat(url, True, path)
        assert status == 200 and error is not None and error["code"] == "invalid_output"
    status, calls, state, error = responses(url, False)
    assert status == 500 and error["code"] == "invalid_output", error
    status, calls, state, error = responses(url, True)
    # Responses streams end in response.failed, with OpenAI's code for a server fault.
    assert state == "failed" and error["code"] == "server_error", (state, error)
    assert "a bug in ane-spec" in error["message"] and not calls
    status, calls, error = ollama(url, False)
    assert status == 500 and error and not calls, (status, error, calls)
    status, calls, error = ollama(url, True)
    assert error, (status, calls)


def test_tool_call_parsing_runs_off_the_event_loop() -> None:
    """The server parses each streamed piece in a worker thread: while a parser works (here,
    blocked until released), the event loop goes on serving other tasks."""
    import asyncio
    import threading

    from ane_spec.daemon.finish import _parse

    started, release = threading.Event(), threading.Event()

    class BlockingParser:
        def feed(self, text: str):
            started.set()
            release.wait(5)
            return text, []

        def finish(self) -> str:
            return "!"

    async def main() -> None:
        parsing = asyncio.create_task(_parse(BlockingParser(), "piece", last=True))
        assert await asyncio.to_thread(started.wait, 5)
        ticks = 0
        for _ in range(5):  # the loop runs while the parser is blocked
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 5 and not parsing.done()
        release.set()
        assert await parsing == ("piece!", [])

    asyncio.run(main())
