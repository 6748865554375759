"""What a client's grammar, JSON schema or JSON value may make the server do, checked in plain
Python before any native code sees it.

llguidance compiles grammars recursively: a JSON schema of ~1,000 chained `$ref`s (75 KB) or a
GBNF grammar of ~20,000 chained rules overflows the stack and kills the process, and its GBNF
converter is quadratic (4,000 rules: 23 s). These checks refuse such inputs by name, cheaply and
without recursion, so that what reaches the compiler (itself run in a child process first, see
`grammar_compiler`) is far inside what it handles. Each limit is generous for real schemas:
pydantic models nest a handful of levels deep, llama.cpp's own GBNF grammars have tens of rules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

from pydantic import BaseModel, ConfigDict, Field

from ane_spec.decode.grammar import GrammarError


class GrammarLimits(BaseModel):
    model_config = ConfigDict(frozen=True)

    max_bytes: int = Field(128 << 10, ge=1)  # a grammar's text, or a schema as compact JSON
    max_rules: int = Field(1024, ge=1)       # GBNF / Lark rule definitions
    max_depth: int = Field(64, ge=1)         # nesting of a schema or of a JSON value
    max_ref_depth: int = Field(64, ge=1)     # $ref hops one path through a schema may take
    compile_seconds: float = Field(10.0, gt=0)  # the child compiler's deadline


class GrammarLimitError(GrammarError):
    """A grammar or schema over one of `GrammarLimits`; the message names the limit."""


# A rule definition at the start of a line: `name ::= ...` (GBNF) or `name: ...` (Lark). A line
# ends at "\n" or a bare "\r", as it does for llguidance's GBNF parser (a `^` with re.MULTILINE
# sees only "\n": 1,502 rules separated by "\r" passed a limit of 1,024).
_RULE = re.compile(r"(?:\A|(?<=[\r\n]))[ \t]*[A-Za-z_?!][\w.-]*[ \t]*(?:::=|:)")


def json_depth(value: Any) -> int:
    """Nesting depth of a JSON value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth + 1)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_depth(value: Any, what: str, limits: GrammarLimits) -> None:
    depth = json_depth(value)
    if depth > limits.max_depth:
        raise GrammarLimitError(f"{what} is nested {depth} levels deep; the limit is "
                                f"{limits.max_depth} (max_depth)")


def check_grammar_text(text: str, what: str, limits: GrammarLimits) -> None:
    """A GBNF or Lark grammar's size and rule count."""
    size = len(text.encode("utf-8", errors="replace"))
    if size > limits.max_bytes:
        raise GrammarLimitError(f"{what} is {size} bytes; the limit is {limits.max_bytes} "
                                "(max_bytes)")
    rules = len(_RULE.findall(text))
    if rules > limits.max_rules:
        raise GrammarLimitError(f"{what} defines {rules} rules; the limit is "
                                f"{limits.max_rules} (max_rules)")


def check_schema(schema: Any, what: str, limits: GrammarLimits) -> None:
    """A JSON schema's nesting, size, $ref chains and $ref cycles."""
    check_json_depth(schema, what, limits)
    size = len(json.dumps(schema, separators=(",", ":")))
    if size > limits.max_bytes:
        raise GrammarLimitError(f"{what} is {size} bytes as JSON; the limit is "
                                f"{limits.max_bytes} (max_bytes)")
    _check_alias_cycles(schema, what)
    depth = _ref_depth(schema)
    if depth > limits.max_ref_depth:
        raise GrammarLimitError(f"{what} chains {depth} $refs; the limit is "
                                f"{limits.max_ref_depth} (max_ref_depth)")


def _resolve(root: Any, ref: str) -> Any:
    """The node a local `$ref` ("#", "#/$defs/a") points at; None for a reference this check
    does not follow (another document, an anchor, a pointer to nothing)."""
    if not ref.startswith("#"):
        return None
    pointer = unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return None  # an anchor ("#foo"): llguidance resolves those, or refuses them
    node = root
    for part in pointer.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _ref_depth(schema: Any) -> int:
    """The most $ref hops on one path of a depth-first walk, the order a recursive compiler
    follows them in. A reference back into the path is recursion, which the compiler turns into
    a grammar rule: it adds nothing."""
    def edges(node: Any) -> Iterator[tuple[Any, int]]:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            if key == "$ref" and isinstance(child, str):
                target = _resolve(schema, child)
                if isinstance(target, (dict, list)):
                    yield target, 1
            elif isinstance(child, (dict, list)):
                yield child, 0

    if not isinstance(schema, (dict, list)):
        return 0
    done: dict[int, int] = {}  # id(node) -> most hops below it
    # Frames: [node, its edges, most hops below it so far, the hop to the child being visited]
    stack: list[list[Any]] = [[schema, edges(schema), 0, 0]]
    on_path = {id(schema)}
    while stack:
        frame = stack[-1]
        for child, hop in frame[1]:
            if id(child) in on_path:
                continue
            if id(child) in done:
                frame[2] = max(frame[2], done[id(child)] + hop)
                continue
            frame[3] = hop
            stack.append([child, edges(child), 0, 0])
            on_path.add(id(child))
            break
        else:
            stack.pop()
            on_path.discard(id(frame[0]))
            done[id(frame[0])] = frame[2]
            if stack:
                stack[-1][2] = max(stack[-1][2], frame[2] + stack[-1][3])
    return done[id(schema)]


def _check_alias_cycles(schema: Any, what: str) -> None:
    """Refuse a cycle of schemas that are nothing but a `$ref` (`{"$ref": "#"}`, or a -> b ->
    a): it describes no value, and a compiler accepts it and then allows no output."""
    terminates: set[int] = set()
    nodes: list[Any] = [schema]
    while nodes:
        node = nodes.pop()
        if isinstance(node, list):
            nodes.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        nodes.extend(node.values())
        path: list[int] = []
        while isinstance(node, dict) and isinstance(node.get("$ref"), str) \
                and id(node) not in terminates:
            if id(node) in path:
                raise GrammarError(f"{what}: its $refs form a cycle that never reaches a schema "
                                   "(such as {\"$ref\": \"#\"}), which describes no value")
            path.append(id(node))
            node = _resolve(schema, node["$ref"])
        terminates.update(path)
