"""Client JSON schemas made as tight as llama.cpp's json-schema-to-grammar before they become
grammars, so a small model cannot run away in the slack (a 140-digit integer, an extra `""` key).

What changes, and where it departs from JSON Schema's own reading:
- **No extra keys unless asked for.** An object schema with `properties` and no
  `additionalProperties` (nor `patternProperties` / `unevaluatedProperties`) allows only those
  properties, as llama.cpp does; JSON Schema's default would allow any others. Send
  `"additionalProperties": true` (or a schema) to allow them.
- **Bounded numbers.** Integers have at most 16 digits (|n| <= 10^16 - 1) unless the schema sets
  its own bound on that side; numbers stay within +-10^16 with at most 10 fraction digits
  (llguidance's `multipleOf` is exact for powers of ten only up to 10^-10) and no exponent:
  llama.cpp allows 16 fraction digits and an exponent of up to 16 digits, both of which a
  model uses only to run away.
- **Bounded free values.** Wherever the schema allows any value (`{}`, `true`, an object
  without `properties`, an array without `items`, `additionalProperties: true`), it gets any
  JSON value built from those bounded numbers.
- Whitespace is bounded by the grammar options (grammar.JSON_OPTIONS), not here.

The output is still validated against the client's own schema before it leaves (app.py).
"""

from __future__ import annotations

from typing import Any

ANY_NAME = "ane_spec_bounded_value"
ANY_REF = {"$ref": f"#/$defs/{ANY_NAME}"}
INT_LIMIT = 10**16 - 1
NUMBER_LIMIT = 1e16
FRACTION_STEP = 1e-10
INTEGER_BOUNDS = {"minimum": -INT_LIMIT, "maximum": INT_LIMIT}
NUMBER_BOUNDS = {"exclusiveMinimum": -NUMBER_LIMIT, "exclusiveMaximum": NUMBER_LIMIT}
ANY_VALUE = {"anyOf": [
    {"type": "null"}, {"type": "boolean"}, {"type": "string"},
    {"type": "number", **NUMBER_BOUNDS, "multipleOf": FRACTION_STEP},
    {"type": "array", "items": ANY_REF},
    {"type": "object", "additionalProperties": ANY_REF}]}

_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMAS = ("items", "additionalItems", "contains", "not", "if", "then", "else",
            "propertyNames", "unevaluatedItems", "unevaluatedProperties")
# A schema with none of these allows any value.
_CONSTRAINING = frozenset({"type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "not",
                           "properties", "items", "prefixItems", "additionalProperties",
                           "patternProperties", "if"})


def tighten(schema: Any) -> Any:
    """A copy of `schema` with the bounds above; the input is not modified."""
    used = [False]
    out = _node(schema, used)
    if used[0]:
        root = dict(out) if isinstance(out, dict) else dict(ANY_REF)
        root["$defs"] = {**root.get("$defs", {}), ANY_NAME: ANY_VALUE}
        return root
    return out


def _node(schema: Any, used: list[bool]) -> Any:
    if schema is True:
        used[0] = True
        return dict(ANY_REF)
    if not isinstance(schema, dict):
        return schema
    node = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            node[key] = {k: _node(v, used) for k, v in node[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(node.get(key), list):
            node[key] = [_node(v, used) for v in node[key]]
    for key in _SCHEMAS:
        if key in node:
            node[key] = ([_node(v, used) for v in node[key]] if isinstance(node[key], list)
                         else _node(node[key], used))
    if isinstance(node.get("additionalProperties"), dict) or node.get(
            "additionalProperties") is True:
        node["additionalProperties"] = _node(node["additionalProperties"], used)

    if not _CONSTRAINING & node.keys():
        used[0] = True
        return node | ANY_REF
    kinds = node.get("type")
    kinds = {kinds} if isinstance(kinds, str) else set(kinds or ())
    if "object" in kinds or "properties" in node:
        if not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & node.keys():
            if "properties" in node:
                node["additionalProperties"] = False
            else:
                used[0] = True
                node["additionalProperties"] = dict(ANY_REF)
    if "array" in kinds and "items" not in node:
        if "prefixItems" in node:
            node["items"] = False  # a tuple, as llama.cpp reads prefixItems
        else:
            used[0] = True
            node["items"] = dict(ANY_REF)
    if "number" in kinds:
        _bound(node, NUMBER_BOUNDS)
        node.setdefault("multipleOf", FRACTION_STEP)
    elif "integer" in kinds:
        _bound(node, INTEGER_BOUNDS)
    return node


def _bound(node: dict[str, Any], bounds: dict[str, Any]) -> None:
    """The default bound on each side the schema leaves open."""
    low, high = bounds.items()
    if "minimum" not in node and "exclusiveMinimum" not in node:
        node[low[0]] = low[1]
    if "maximum" not in node and "exclusiveMaximum" not in node:
        node[high[0]] = high[1]
