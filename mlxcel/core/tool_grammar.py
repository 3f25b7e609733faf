"""Grammars that force a reply to be tool calls, in the model's own tool-call format.

``tool_choice: "required"`` or a named function turns into a llguidance Lark
grammar: the format's markers around a JSON object whose ``name`` is one of
the allowed tools and whose ``arguments`` match that tool's ``parameters``.
The text is what the model's template writes for a call (``tojson``'s
``": "`` and ``", "`` separators), so mlx-lm's tool parser and the next
turn's rendering see what they expect. Pure string building: llguidance
checks and runs the result elsewhere.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

# The mlx_lm.tool_parsers modules whose call syntax is a JSON object (or name + JSON arguments).
FORCEABLE_FORMATS = ("json_tools", "mistral")
# A function key holding the schema its calls are held to when it differs from the one the
# template shows (a custom tool's grammar as its input's pattern); the router strips it before rendering.
ENFORCED_PARAMETERS = "x-mlxcel-enforced-parameters"

# The whitespace Jinja's tojson (and Python's json.dumps) writes, and no other: free
# whitespace lets an unsure model pad a call until max_tokens.
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


class UnforceableToolChoice(ValueError):
    """The model's tool-call format has no grammar here."""


def tool_format_name(tool_parser: Any) -> str | None:
    """The mlx_lm.tool_parsers module a ``parse_tool_call`` comes from (``json_tools``...)."""
    module = getattr(tool_parser, "__module__", None) or ""
    prefix = "mlx_lm.tool_parsers."
    return module[len(prefix):] if module.startswith(prefix) else None


def forced_tool_grammar(
    *,
    format_name: str | None,
    tools: Sequence[Mapping[str, Any]],
    names: Sequence[str],
    parallel: bool,
    start_marker: str,
    end_marker: str | None,
    special_ids: Mapping[str, int],
) -> str:
    """A Lark grammar whose every string is one call (``parallel``: one or more) to a tool in ``names``.

    ``special_ids`` maps a marker that is one special token to its id: such a
    token is never spelled out by text, so the grammar names it by id.
    """
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    parameters = {name: tool_parameters(by_name[name]) for name in names}
    start, body, separator = _call_parts(format_name, parameters, start_marker, end_marker, special_ids)
    rules = [f"start: call ({separator} call)*" if parallel else "start: call", f"call: {start} {body}"]
    return "\n".join(rules) + "\n"


def strict_tools_grammar(
    *,
    format_name: str | None,
    tools: Sequence[Mapping[str, Any]],
    parallel: bool,
    start_marker: str,
    end_marker: str | None,
    special_ids: Mapping[str, int],
) -> str:
    """Free text, but a call the model starts must match: OpenAI's `strict` tools under `tool_choice: auto`.

    The call's marker is a lazy trigger (llguidance's structural tags): text
    is free until the marker appears, then the call follows the grammar; a
    `strict` tool's arguments match its `parameters`, another tool's are any
    JSON object.
    """
    parameters = {
        tool["function"]["name"]: tool_parameters(tool["function"])
        if is_enforced(tool["function"]) else {"type": "object"}
        for tool in tools
    }
    start, body, _separator = _call_parts(format_name, parameters, start_marker, end_marker, special_ids)
    # A special-token marker cannot occur in text, so it needs no lazy lexeme.
    if start.startswith("<["):
        call_rules = [f"call: TEXT {start} {body}"]
    else:
        call_rules = [f"call: trigger {body}", f"trigger[lazy]: TEXT {start}"]
    calls = "call*" if parallel else "call?"
    return "\n".join(["%llguidance {}", f"start: {calls} tail", "tail: TEXT", "TEXT: /(.|\\n)*/", *call_rules]) + "\n"


def is_enforced(function: Mapping[str, Any]) -> bool:
    """Whether a function's calls are held to its schema under `tool_choice: auto` (strict, or a grammar)."""
    return function.get("strict") is True or ENFORCED_PARAMETERS in function


def tool_parameters(function: Mapping[str, Any]) -> Any:
    """The schema a call's arguments must match: a custom tool's enforced one, else `parameters`; closed when
    the tool is `strict`."""
    parameters = function.get(ENFORCED_PARAMETERS) or function.get("parameters") or {"type": "object"}
    return closed_objects(parameters) if function.get("strict") is True else parameters


def _call_parts(
    format_name: str | None, parameters: Mapping[str, Mapping[str, Any]], start_marker: str, end_marker: str | None,
    special_ids: Mapping[str, int],
) -> tuple[str, str, str]:
    """A call in the model's format: its start marker, what follows it, and what separates two calls."""
    if format_name not in FORCEABLE_FORMATS:
        raise UnforceableToolChoice(
            f"enforcing a tool call needs a tool-call format with a grammar ({', '.join(FORCEABLE_FORMATS)}); "
            f"this model's is {format_name or 'unknown'}"
        )
    start = _literal(start_marker, special_ids)
    if format_name == "json_tools":
        end = _literal(end_marker or "", special_ids)
        # The template's layout: the marker, a newline, the object, a newline, the end marker.
        return start, f'"\\n" %json {json.dumps(_call_object(parameters))} "\\n" {end}', '"\\n"'
    # mistral: [TOOL_CALLS]name[ARGS]{arguments}, repeated for several calls.
    alternatives = " | ".join(
        f'{json.dumps(name)} "[ARGS]" %json {json.dumps(_styled(schema))}' for name, schema in parameters.items()
    )
    return start, f"({alternatives})", ""


# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames",
              "unevaluatedItems", "additionalProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """The schema with every object closed (`additionalProperties: false` where it says nothing): OpenAI's `strict`.

    An object's properties are the schema's alone; one that states its own
    `additionalProperties` keeps it. Key order is kept (it is the order the JSON is written in).
    """
    if not isinstance(schema, Mapping):
        return schema
    closed: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA:
            closed[key] = closed_objects(value)
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            closed[key] = [closed_objects(item) for item in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, Mapping):
            closed[key] = {name: closed_objects(item) for name, item in value.items()}
        else:
            closed[key] = value
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in schema
    if is_object and "additionalProperties" not in schema and "patternProperties" not in schema:
        closed["additionalProperties"] = False
    return closed


def _call_object(parameters: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    choices = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in parameters.items()
    ]
    body: dict[str, Any] = choices[0] if len(choices) == 1 else {"anyOf": choices}
    return _styled(body)


def _styled(schema: Mapping[str, Any]) -> dict[str, Any]:
    return {**schema, "x-guidance": _JSON_STYLE}


def _literal(text: str, special_ids: Mapping[str, int]) -> str:
    if text in special_ids:
        return f"<[{special_ids[text]}]>"
    return json.dumps(text)
