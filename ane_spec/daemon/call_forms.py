"""Tool calls as models actually write them (issue 29): the forms llama.cpp's parsers accept
for the Hermes 2 Pro / Qwen and Llama 3.x templates, read piece by piece, and the `auto`
grammar that lets a model start any of them.

Which llama.cpp. The vendored llama.cpp (llama-cpp-python 0.3.36) parses these templates with
its PEG "autoparser" (common/chat-auto-parser-generator.cpp), which takes only the template's
own form: `<tool_call>` blocks for Hermes/Qwen, `{"name": ..., "parameters": ...}` objects
after any text for Llama 3. The regex parsers it replaced (common/chat-parser.cpp's
`common_chat_parse_hermes_2_pro` and `common_chat_parse_llama_3_1`) took more, and a model
writes those forms (the real Qwen2.5-Coder fences its call), so the union is accepted:

- Hermes / Qwen: anywhere in the reply, an object `{"name": "f", "arguments": {...}}`
  (name first), bare, or after ```` ```json ````/```` ```xml ````/```` ``` ```` and/or one of the
  tags `<tool_call>`, `<function_call>`, `<tool>`, `<tools>`, `<response>`, `<json>`, `<xml>`,
  `<JSON>` (closed by the matching tag and fence, which are consumed when present); and
  `<function=f>{...}</function>` or `<function name="f">{...}</function>`. Several calls,
  text between them is content.
- Llama 3.x: anywhere, one object `{["type": "function", ]"name": "f", "parameters": {...}}`;
  the text before and after it is content.

Whitespace right before a Hermes call's opening `{` belongs to the call (the old regex's
`\\s*\\{`), as does whitespace after any call.

Time: linear in the text, whole or streamed (issue 36: a whitespace run cost quadratic time,
cubic streamed, on the server's event loop: 4,000 spaces took 1.55 s, 8,000 fed 4 characters
at a time over 60 s). The search for an opening is anchored at the characters one can begin
with (`Forms.openers`; the whitespace a Hermes `{` may take before it is found by looking
back from the `{`), openings ruled out are never looked at again, and whitespace is matched
possessively (`\\s*+`), so two runs side by side never backtrack into each other. A check
that said "may still become" on text ending in whitespace is not repeated while only
whitespace arrives (`FormParser._idle`): every piece here stays what it was when more whitespace
follows (each whitespace literal is followed by `WS`; names take any character), and no
opening, header or closer ends in whitespace unless `WS` ends it. Names are bounded
(`NAME_LIMIT`), the only other part without one. `scripts/bench_tool_call_parser.py` prints
each family's time on 64 KiB of whitespace.

The `auto` grammar (llguidance Lark) lets the model write text, or text then calls in any of
these forms, each call's name one of the tools and its arguments valid against that tool's
schema. llama.cpp does this with a lazy grammar that a trigger switches on; here text is a
terminal that cannot contain an opening (`{"name"`, `<tool_call>`, `<function=`,
`<function name="`), and each form's first call is reached through a terminal for "text up to
and including the first opening" (a greedy text terminal would swallow the opening's first
characters and leave no way to finish it). So under `auto` a reply never spells `{"name"` in
plain text: llama.cpp's old parser would have read it as a call too.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ane_spec.daemon.protocol import NamedToolChoice, Tool, tool_call_delta
from ane_spec.daemon.tools import JsonScan, StreamedCalls
from ane_spec.decode.grammar import JSON_OPTIONS
from ane_spec.decode.json_tightening import tighten

# --- patterns that can also tell whether a text may still become a match ----------------------


class Piece:
    """A regex that also knows the regex of its prefixes (every prefix of a match, the empty
    one and the whole match included): a stream holds text back while it may still become a
    call's opening, and lets it go as content once it cannot."""

    def full(self, groups: bool = False) -> str:
        raise NotImplementedError

    def prefix(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class Lit(Piece):
    text: str

    def full(self, groups: bool = False) -> str:
        return re.escape(self.text)

    def prefix(self) -> str:
        out = ""
        for ch in reversed(self.text):
            out = f"(?:{re.escape(ch)}{out})?"
        return out


@dataclass(frozen=True)
class Rx(Piece):
    """A regex given with its prefix regex by hand."""

    whole: str
    start: str

    def full(self, groups: bool = False) -> str:
        return f"(?:{self.whole})"

    def prefix(self) -> str:
        return f"(?:{self.start})"


# Possessive: a run is never given back, so `WS WS` or `WS` then a failing literal costs one
# pass over the run, not one per character of it.
WS = Rx(r"\s*+", r"\s*+")
# The characters of a call's name: tool names are at most 64 (protocol.Tool); a longer name
# names no tool, and unbounded it was the one part besides whitespace that a stream re-matched
# from its start at every piece.
NAME_LIMIT = 512
# A JSON string's body (a name) and its closing quote.
NAME_STRING = Rx(r'(?:[^"\\]|\\.){0,%d}"' % NAME_LIMIT,
                 r'(?:[^"\\]|\\.){0,%d}(?:\\|")?' % NAME_LIMIT)


class Seq(Piece):
    def __init__(self, *parts: Piece | str):
        self.parts = tuple(Lit(p) if isinstance(p, str) else p for p in parts)

    def full(self, groups: bool = False) -> str:
        return "".join(p.full(groups) for p in self.parts)

    def prefix(self) -> str:
        options = ["".join(q.full() for q in self.parts[:i]) + p.prefix()
                   for i, p in enumerate(self.parts)]
        return "(?:" + "|".join(options) + ")"


class Alt(Piece):
    def __init__(self, *parts: Piece | str):
        self.parts = tuple(Lit(p) if isinstance(p, str) else p for p in parts)

    def full(self, groups: bool = False) -> str:
        return "(?:" + "|".join(p.full(groups) for p in self.parts) + ")"

    def prefix(self) -> str:
        return "(?:" + "|".join(p.prefix() for p in self.parts) + ")"


@dataclass(frozen=True)
class Opt(Piece):
    part: Piece

    def full(self, groups: bool = False) -> str:
        return f"(?:{self.part.full(groups)})?"

    def prefix(self) -> str:
        return self.part.prefix()


@dataclass(frozen=True)
class Group(Piece):
    name: str
    part: Piece

    def full(self, groups: bool = False) -> str:
        inner = self.part.full(groups)
        return f"(?P<{self.name}>{inner})" if groups else inner

    def prefix(self) -> str:
        return self.part.prefix()


class Pattern:
    """A piece compiled twice: `match` (with its named groups) and `could_become`."""

    def __init__(self, piece: Piece):
        self.regex = re.compile(piece.full(groups=True))
        self._prefix = re.compile(piece.prefix())

    def could_become(self, text: str, pos: int = 0) -> bool:
        """Whether `text[pos:]` is a prefix of some match (a match included)."""
        return self._prefix.fullmatch(text, pos) is not None


# --- the forms -----------------------------------------------------------------------------------

HERMES_TAGS = ("tool_call", "function_call", "tool", "tools", "response", "json", "xml", "JSON")
FENCE = Seq("```", Opt(Alt("xml", "json")), "\n", WS)


def _header(arguments_key: str) -> Piece:
    """From just after `"name"` through the arguments' key and colon."""
    return Seq(WS, ":", WS, '"', Group("name", NAME_STRING), WS, ",", WS,
               f'"{arguments_key}"', WS, ":", WS)


@dataclass(frozen=True)
class Forms:
    """A family's openings (`trigger`: leftmost match starts a call), what follows each kind of
    opening up to the arguments (`headers`, keyed by the trigger's group that matched), and
    whether more than one call is read. `openers`: the characters an opening can begin with,
    besides whitespace before a `{` (tests check that no other character can)."""

    trigger: Pattern
    headers: dict[str, Pattern]
    single: bool
    openers: str

    @property
    def space_opens(self) -> bool:
        """Whether an opening may begin with whitespace (Hermes: `\\s*{"name"`)."""
        return self.trigger.could_become(" ")


HERMES_FORMS = Forms(
    trigger=Pattern(Alt(
        Group("json", Seq(Opt(Group("fence", FENCE)),
                          Opt(Seq("<", Group("tag", Alt(*HERMES_TAGS)), ">")),
                          WS, "{", WS, '"name"')),
        Group("fn_eq", Lit("<function=")),
        Group("fn_name", Lit('<function name="')))),
    headers={"json": Pattern(_header("arguments")),
             "fn_eq": Pattern(Seq(Group("name", Rx(r"[^>]{1,%d}" % NAME_LIMIT,
                                                   r"[^>]{0,%d}" % NAME_LIMIT)), ">", WS)),
             "fn_name": Pattern(Seq(Group("name", Rx(r'[^"]{1,%d}' % NAME_LIMIT,
                                                     r'[^"]{0,%d}' % NAME_LIMIT)), '">', WS))},
    single=False, openers="`<{")

LLAMA3_FORMS = Forms(
    trigger=Pattern(Group("json", Seq(
        "{", WS, Opt(Seq('"type"', WS, ":", WS, '"function"', WS, ",", WS)), '"name"'))),
    headers={"json": Pattern(_header("parameters"))},
    single=True, openers="{")


def _closers(opening: re.Match[str]) -> Pattern:
    """What may follow a call's arguments: the rest of its object, then its tag and fence."""
    groups = opening.groupdict()
    return _closers_of(groups.get("tag"), bool(groups.get("fence")),
                       bool(groups.get("fn_eq") or groups.get("fn_name")))


@lru_cache(maxsize=64)
def _closers_of(tag: str | None, fence: bool, function: bool) -> Pattern:
    parts: list[Piece | str] = [WS]
    if tag:
        parts += [Opt(Lit(f"</{tag}>")), WS]
    if fence:
        parts += [Opt(Lit("```")), WS]
    if function:
        parts += [Opt(Lit("</function>")), WS]
    return Pattern(Seq(*parts))


class FormParser(StreamedCalls):
    """Splits generated text into content and tool calls, piece by piece, the forms above.

    The interface of tools.ToolCallParser: `feed` gives (content, one delta per call index),
    `finish` the content still held; `calls` are every call that began (its name whole, its
    arguments begun), `whole_calls` those whose arguments are whole. Each call's arguments are
    the exact text the model wrote, so a stream's deltas concatenate to the arguments of the
    same text parsed whole. Text that may still become an opening is held back until it does
    or cannot; an opening whose header then fails is content after all."""

    def __init__(self, forms: Forms) -> None:
        self.forms = forms
        self._calls: list[dict[str, Any]] = []
        self._arguments: list[str] = []  # the last call's pieces not yet joined into it
        self._text = ""          # text not yet resolved, from `_pos`
        self._pos = 0
        self._state = "text"     # -> "header" -> "arguments" -> "object" -> "closers" -> "text"
        self._opening: re.Match[str] | None = None
        self._opener = 0         # where the opening's first non-space character is
        self._kind = ""
        self._closed = 0
        self._json = JsonScan()
        self._triggers = True    # false after a single-call family's call
        self._openers = re.compile(f"[{re.escape(forms.openers)}]")
        self._space_opens = forms.space_opens
        # The text state's scan: no opening begins in [_pos, _scan) except perhaps at _scan;
        # `_run` is where the whitespace run ending at _scan begins (None: no run there).
        self._scan = 0
        self._run: int | None = None
        # The last pass ended holding text that ends in whitespace, waiting on a check that more
        # whitespace leaves as it is (module docstring): whitespace pieces then only queue up in
        # `_spaces`, and the next other piece runs the check once on all of it.
        self._idle = False
        self._spaces: list[str] = []

    @property
    def complete(self) -> bool:
        return bool(self._calls) and self._closed == len(self._calls)

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not text:
            return "", []
        if self._idle and text.isspace():
            self._spaces.append(text)
            return "", []
        if self._plain(text):
            return text, []
        if self._state == "arguments" and self._pos == len(self._text) and not self._spaces \
                and self._json.inert(text):  # more of the arguments, and nothing else
            self._arguments.append(text)
            return "", [tool_call_delta(len(self._calls) - 1, None, None, text)]
        self._take_spaces(text)
        content, deltas = self._run_states(final=False)
        return content, _one_per_index(deltas)

    def finish(self) -> str:
        self._take_spaces("")
        content, _ = self._run_states(final=True)
        return content

    def _plain(self, text: str) -> bool:
        """Whether `text` is content as it stands: nothing is held before it, and it holds no
        opener's character and cannot end in the whitespace before a Hermes `{`. (A call's
        cost per piece of ordinary text, without the states' loop.)"""
        if self._state != "text" or self._pos != len(self._text) or self._spaces:
            return False
        if self._triggers and (self._openers.search(text)
                               or (self._space_opens and text[-1].isspace())):
            return False
        self._run = None  # the text between is not in `_text`: no run goes across it
        return True

    def _take_spaces(self, text: str) -> None:
        if self._spaces:
            text = "".join(self._spaces) + text
            self._spaces.clear()
        self._text += text

    # The loop: each state consumes what it can decide now, and stops when it needs more text.
    def _run_states(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        self._idle = False
        while True:
            s, pos = self._text, self._pos
            if self._state == "text":
                if not self._triggers:
                    content.append(s[pos:])
                    self._pos = len(s)
                    break
                start, m = self._find_opening(s, final)
                if m:
                    content.append(s[pos:start])
                    self._opening, self._opener = m, self._scan
                    self._pos, self._state = m.end(), "header"
                    self._kind = next(k for k in self.forms.headers if m.group(k) is not None)
                    continue
                hold = start
                # At the end, held text is content, unless a call's tag or object had begun in
                # it (a reply cut inside an opening leaves no markup in the content).
                if final and not any(c in s[hold:] for c in "{>"):
                    hold = len(s)
                content.append(s[pos:hold])
                self._pos = hold
                if final:
                    self._text = ""
                    self._to_text(0)
                self._idle = hold < len(s) and s[-1:].isspace()
                break
            if self._state == "header":
                header = self.forms.headers[self._kind]
                m = header.regex.match(s, pos)
                if m and m.end() < len(s):  # the arguments' first character has arrived
                    name = m.group("name")
                    if self._kind == "json":
                        name = json.loads(f'"{name[:-1]}"')
                    call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": name, "arguments": ""}}
                    self.calls.append(call)  # (the previous call's pieces joined first)
                    deltas.append(tool_call_delta(len(self._calls) - 1, call["id"], name, ""))
                    self._pos, self._state, self._json.depth = m.end(), "arguments", 0
                    continue
                if not final and header.could_become(s, pos):
                    self._idle = s[-1:].isspace()
                    break
                if final:  # cut before the call began: no call, and its markup is no content
                    self._text = ""
                    self._to_text(0)
                    break
                # Not a call after all: the opening is text (with the whitespace it took before
                # its `{`), and the search goes on after its first character.
                content.append(s[self._opening.start():self._opener + 1])
                self._to_text(self._opener + 1)
                continue
            if self._state == "arguments":
                start = pos
                self._pos, closed = self._json.advance(s, pos)
                if closed:
                    self._state = "object"
                if self._pos > start:
                    piece = s[start:self._pos]
                    self._arguments.append(piece)
                    deltas.append(tool_call_delta(len(self._calls) - 1, None, None, piece))
                if self._state == "arguments":
                    break
                self._closed = len(self._calls)
                # The rest of the call's object (a JSON form), up to its own brace.
                self._json.depth = 1 if self._kind == "json" else 0
                self._state = "object" if self._json.depth else "closers"
                continue
            if self._state == "object":
                self._pos, closed = self._json.advance(s, pos)
                if not closed:
                    break
                self._state = "closers"
                continue
            # closers: the call's tag, fence and whitespace, consumed while they may follow
            closers = _closers(self._opening)
            if closers.could_become(s, pos):
                if not final:
                    self._idle = s[-1:].isspace()
                    break
                self._pos = len(s)  # the end came inside them
            else:
                self._pos = closers.regex.match(s, pos).end()
            self._to_text(self._pos)
            self._triggers = not self.forms.single
        if self._pos > 4096 and self._state != "header":  # read text is never looked at again
            cut = self._pos
            self._text, self._pos = self._text[cut:], 0
            self._scan -= cut
            self._run = None if self._run is None else max(0, self._run - cut)
        return "".join(content), deltas

    def _find_opening(self, s: str, final: bool) -> tuple[int, re.Match[str] | None]:
        """(where it starts, the match) for the first opening from `_pos`; else (where the
        text that may still become one begins, None). Only the openers' characters are tried,
        each once unless it may still become an opening; whitespace before a `{` is looked
        back on from the `{`. At the end, the openings after one that may still become one are
        tried too (a whole one there is the call), each once."""
        trigger = self.forms.trigger
        held: int | None = None
        while True:
            found = self._openers.search(s, self._scan)
            at = len(s) if found is None else found.start()
            self._track_run(s, at)
            lead = None if self._run is None or not self._space_opens \
                else max(self._run, self._pos)
            if found is None:  # trailing whitespace may still be a Hermes `{`'s
                if held is not None:
                    return held, None
                return (len(s) if lead is None else lead), None
            m = trigger.regex.match(s, at)
            if m:
                if lead is not None and lead < at:
                    wide = trigger.regex.match(s, lead)
                    if wide:
                        return lead, wide
                return at, m
            if held is None and trigger.could_become(s, at):
                held = lead if lead is not None and lead < at \
                    and trigger.could_become(s, lead) else at
                if not final:
                    return held, None
            self._scan, self._run = at + 1, None

    def _track_run(self, s: str, at: int) -> None:
        """Move the scan to `at`, keeping `_run` the start of the whitespace run ending there."""
        seg = s[self._scan:at]
        if seg:
            kept = len(seg.rstrip())
            if kept == len(seg):
                self._run = None
            elif kept or self._run is None:
                self._run = self._scan + kept
        self._scan = at

    def _to_text(self, pos: int) -> None:
        self._pos, self._state = pos, "text"
        self._scan, self._run = pos, None


def _one_per_index(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for d in deltas:
        if merged and merged[-1]["index"] == d["index"]:
            merged[-1]["function"]["arguments"] += d["function"]["arguments"]
        else:
            merged.append(d)
    return merged


# --- the `auto` grammars -------------------------------------------------------------------------

# What the grammar lets a model write between a call's parts: the separators of the compact
# JSON its arguments are held to (grammar.JSON_OPTIONS), a newline around tags and fences. Any
# more room and a weak model spends its tokens on spaces.
GRAMMAR_WS = 'KS: /: ?/\nIS: /, ?/\nWS: /\\n/'
_FENCE_RX = "```(json|xml)?\\n\\s*"
_NAME_RX = '\\{\\s*"name"'
# Where a call's opening may hold whitespace, the grammar allows what llama.cpp's JSON grammars
# allow (json-schema-to-grammar's `space`: nothing, one space, or a newline and up to 20 spaces
# or tabs), not `\s*`: a weak model given any run of (Unicode) whitespace there spends every
# token it has on it and never reaches the call. The parser still reads `\s*` (_NAME_RX), and
# text may not hold such an opening, so what the grammar refuses is neither text nor a call.
_SPACE_RX = "( |\\n[ \\t]{0,20})?"
_NAME_GRAMMAR_RX = '\\{' + _SPACE_RX + '"name"'
_FENCE_GRAMMAR_RX = "```(json|xml)?\\n[ \\t]{0,20}"


def _tools_of(tools: list[Tool], choice: str | NamedToolChoice | None) -> list[Tool]:
    if isinstance(choice, NamedToolChoice):
        return [t for t in tools if t.function.name == choice.function.name]
    return tools


def _arguments_rules(tools: list[Tool]) -> list[str]:
    from ane_spec.daemon.tools import NO_PARAMETERS

    rules = []
    for i, t in enumerate(tools):
        schema = dict(t.function.parameters or NO_PARAMETERS)
        schema["x-guidance"] = JSON_OPTIONS
        rules.append(f"args{i}: %json {json.dumps(tighten(schema))}")
    return rules


def _lead(name: str, ending: str, openings: str) -> str:
    """A terminal: text up to and including its first opening, which is `ending`."""
    return f"{name}: /(.|\\n)*{ending}/ & ~/(.|\\n)*({openings})(.|\\n)+/"


def hermes_auto_grammar(tools: list[Tool], parallel: bool | None) -> str:
    """Text, or text then calls in any Hermes form (module docstring)."""
    names = [t.function.name for t in tools]
    openings = f"<tool_call>|{_NAME_RX}|<function=|<function name=\""
    body = ["\"\\\"\" (" + " | ".join(
        f'"{_lark_str(n)}\\"" IS "\\"arguments\\"" KS args{i}'
        for i, n in enumerate(names)) + ") \"}\""]
    rules = [f"rest: KS {body[0]}",
             'obj: "{\\"name\\"" rest',
             "fn_eq: (" + " | ".join(f'"{_lark_str(n)}>" WS? args{i}'
                                     for i, n in enumerate(names)) + ') WS? "</function>"',
             "fn_name: (" + " | ".join(f'"{_lark_str(n)}\\">" WS? args{i}'
                                       for i, n in enumerate(names)) + ') WS? "</function>"',
             'tool_call: WS? obj WS? "</tool_call>"',
             *_arguments_rules(tools), GRAMMAR_WS,
             "TEXT: /(.|\\n)+/ & ~/(.|\\n)*(" + openings + ")(.|\\n)*/",
             _lead("LEAD_TC", "<tool_call>", openings),
             _lead("LEAD_TC_FENCED", _FENCE_RX + "<tool_call>", openings),
             _lead("LEAD_JSON", _NAME_GRAMMAR_RX, openings),
             _lead("LEAD_JSON_FENCED", _FENCE_GRAMMAR_RX + _NAME_GRAMMAR_RX, openings),
             _lead("LEAD_FN_EQ", "<function=", openings),
             _lead("LEAD_FN_NAME", "<function name=\"", openings)]
    first = ["LEAD_TC tool_call", "LEAD_TC_FENCED tool_call WS? FENCE_END", "LEAD_JSON rest",
             "LEAD_JSON_FENCED rest WS? FENCE_END", "LEAD_FN_EQ fn_eq", "LEAD_FN_NAME fn_name"]
    later = ['"<tool_call>" tool_call', "FENCE WS? obj WS? FENCE_END", "obj",
             '"<function=" fn_eq', '"<function name=\\"" fn_name']
    # A closing fence takes its newline along: as a string followed by WS, a greedy lexer
    # would read "```\\n" as the next call's opening fence.
    rules += ['FENCE: /```(json|xml)?\\n/', 'FENCE_END: /```\\n?/']
    for i, tag in enumerate(HERMES_TAGS[1:]):
        lead = f"LEAD_TAG{i}"
        rules.append(_lead(lead, f"<{tag}>{_SPACE_RX}{_NAME_GRAMMAR_RX}", openings))
        first.append(f'{lead} rest WS? "</{tag}>"')
        later.append(f'"<{tag}>" WS? obj WS? "</{tag}>"')
    more = "" if parallel is False else " (WS? call)*"
    return "\n".join([f"start: TEXT | first{more} WS?", "first: " + " | ".join(first),
                      "call: " + " | ".join(later), *rules]) + "\n"


def llama3_auto_grammar(tools: list[Tool]) -> str:
    """Text, or text then one call `{["type": "function", ]"name": ..., "parameters": ...}`.
    A reply that opens with `{` is a call (llama.cpp's old trigger, anchored at the start; its
    PEG parser reads content only up to the first `{`)."""
    names = [t.function.name for t in tools]
    # What the parser reads as an opening (text may not hold one), and what a model may write.
    opening = '\\{\\s*("type"\\s*:\\s*"function"\\s*,\\s*)?"name"'
    space = _SPACE_RX
    written = f'\\{{{space}("type"{space}:{space}"function"{space},{space})?"name"'
    rest = ("rest: KS \"\\\"\" (" + " | ".join(
        f'"{_lark_str(n)}\\"" IS "\\"parameters\\"" KS args{i}'
        for i, n in enumerate(names)) + ') "}"')
    brace_first = "~/\\s*\\{(.|\\n)*/"
    return "\n".join([
        "start: TEXT | (LEAD_FIRST | LEAD) rest", rest, *_arguments_rules(tools),
        GRAMMAR_WS, f"TEXT: /(.|\\n)+/ & ~/(.|\\n)*{opening}(.|\\n)*/ & {brace_first}",
        f"LEAD_FIRST: /[ \\t\\n]{{0,20}}{written}/",
        _lead("LEAD", written, opening) + f" & {brace_first}"]) + "\n"


def _lark_str(name: str) -> str:
    """A tool name inside a Lark string literal (names are [A-Za-z0-9_.-], protocol.py)."""
    return name.replace("\\", "\\\\").replace('"', '\\"')
