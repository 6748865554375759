"""Client JSON schemas compile to grammars as tight as llama.cpp's json-schema-to-grammar:
bounded numbers, no extra keys unless asked for, bounded free values; unsupported keywords are
refused by name. Checked on the mask itself: this tokenizer's tokens of each text, one by one."""

from __future__ import annotations

import pytest

from ane_spec.daemon.protocol import Tool
from ane_spec.daemon.tools import tool_call_grammar
from ane_spec.decode.grammar import Grammar, GrammarError, json_schema_grammar, lark_grammar
from ane_spec.decode.json_tightening import tighten
from ane_spec.model.tokenizer import Tokenizer
from ane_spec.model.vocab import build_synthetic_vocab

BIG = "9" * 17  # 17 digits: one past llama.cpp's integral-part cap


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(build_synthetic_vocab(1024))


def accepts(tok: Tokenizer, grammar: Grammar, text: str) -> bool:
    state = grammar.start()
    for t in tok.encode(text, special=True):
        if not state.allows(t):
            return False
        state.advance(t)
    return state.accepting


@pytest.mark.parametrize("schema, good, bad", [
    ({"type": "integer"}, ["0", "-5", "9" * 16], [BIG, "1.5"]),
    ({"type": "integer", "minimum": 0}, ["9" * 16], ["-1", BIG]),
    ({"type": "integer", "maximum": 10**18}, ["9" * 18], ["-" + BIG]),  # its own bound holds
    ({"type": "number"}, ["1.5", "-0.25", "3", "9" * 16 + ".5", "1." + "0" * 9 + "1"],
     [BIG, "1e5", "1." + "0" * 10 + "1"]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}},
     ['{"a": 1}', "{}"], ['{"a": 1, "b": 2}', '{"a": 1, "": "s"}']),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     ['{"a": 1, "b": [2]}'], ['{"a": 1, "b": ' + BIG + "}"]),
    ({"type": "object"}, ['{"a": 1, "b": [1, {"c": null}]}', "{}"], ['{"a": ' + BIG + "}"]),
    ({}, ['[1, "x"]', "1.5", "null"], [BIG]),
    ({"type": "array"}, ['[1, "x"]'], ["[" + BIG + "]"]),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, ["[1]"], ["[1, 2]"]),
    ({"type": "string", "minLength": 2, "maxLength": 3}, ['"ab"', '"abc"'], ['"a"', '"abcd"']),
    ({"type": "string", "pattern": "^[a-c]+$"}, ['"abc"'], ['"abd"']),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     ["[1]", "[1, 2]"], ["[]", "[1, 2, 3]"]),
    ({"type": "string", "format": "date"}, ['"2024-01-31"'], ['"yesterday"']),
    # bounded whitespace: at most one space after ',' and ':', none elsewhere
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "required": ["a", "b"]}, ['{"a":1,"b":2}', '{"a": 1, "b": 2}'],
     ['{"a":  1, "b": 2}', '{ "a": 1, "b": 2}', '{"a": 1,\n"b": 2}']),
])
def test_schemas_are_as_tight_as_llama_cpp(tok, schema, good, bad) -> None:
    grammar = Grammar(tok, json_schema_grammar(schema))
    for text in good:
        assert accepts(tok, grammar, text), text
    for text in bad:
        assert not accepts(tok, grammar, text), text


def test_the_clients_schema_is_not_modified() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tight = tighten(schema)
    assert schema == {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert tight["additionalProperties"] is False and tight["properties"]["a"]["maximum"]


def test_tool_arguments_are_tight_too(tok) -> None:
    tool = Tool.model_validate({"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}})
    grammar = Grammar(tok, lark_grammar(tool_call_grammar([tool], "required", False)))
    call = '<|tool_call|>[{"name": "f", "arguments": {"x": %s}}]<|/tool_call|>'
    assert accepts(tok, grammar, call % "12")
    assert not accepts(tok, grammar, call % BIG)
    assert not accepts(tok, grammar, call.replace("}}]", ', "": "s"}}]') % "1")


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"), ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "string", "format": "color"}, "color")])
def test_unsupported_keywords_are_refused_by_name(tok, schema, keyword) -> None:
    with pytest.raises(GrammarError, match=keyword):
        Grammar(tok, json_schema_grammar(schema))
