"""`strict: true` closes objects: the schema the grammar is built from allows no property beyond its own."""

from __future__ import annotations

import json

from mlxcel.core.tool_grammar import closed_objects, forced_tool_grammar, tool_parameters

NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "when": {"type": "object", "properties": {"day": {"type": "string"}}},
        "tags": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
        "extra": {"type": "object", "additionalProperties": {"type": "integer"}},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "null"}]},
    },
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}}},
}


def test_closed_objects_closes_every_object_that_says_nothing_and_keeps_order() -> None:
    closed = closed_objects(NESTED)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["when"]["additionalProperties"] is False
    assert closed["properties"]["tags"]["items"]["additionalProperties"] is False
    # An object that states its own additionalProperties keeps it.
    assert closed["properties"]["extra"]["additionalProperties"] == {"type": "integer"}
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["either"]["anyOf"][1]
    assert closed["$defs"]["point"]["additionalProperties"] is False
    assert list(closed["properties"]) == ["title", "when", "tags", "extra", "either"]
    assert "additionalProperties" not in NESTED  # a copy: the request's schema is not changed


def test_a_strict_tool_is_forced_with_closed_arguments_and_a_plain_one_is_not() -> None:
    function = {"name": "plan", "parameters": NESTED}
    assert tool_parameters(function) is NESTED
    assert tool_parameters({**function, "strict": True}) == closed_objects(NESTED)
    for strict, closed in ((True, True), (False, False)):
        grammar = forced_tool_grammar(
            format_name="json_tools", tools=[{"type": "function", "function": {**function, "strict": strict}}],
            names=["plan"], parallel=False, start_marker="<tool_call>", end_marker="</tool_call>", special_ids={})
        schema = json.loads(grammar.split("%json ", 1)[1].rsplit(' "\\n"', 1)[0])
        arguments = schema["properties"]["arguments"]
        assert ("additionalProperties" in arguments["properties"]["when"]) is closed
