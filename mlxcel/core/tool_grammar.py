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
    if format_name not in FORCEABLE_FORMATS:
        raise UnforceableToolChoice(
            f"forcing a tool call needs a tool-call format with a grammar ({', '.join(FORCEABLE_FORMATS)}); "
            f"this model's is {format_name or 'unknown'}"
        )
    by_name = {tool["function"]["name"]: tool["function"] for tool in tools}
    parameters = {name: by_name[name].get("parameters") or {"type": "object"} for name in names}
    start = _literal(start_marker, special_ids)
    if format_name == "json_tools":
        body = _call_object(parameters)
        end = _literal(end_marker or "", special_ids)
        # The template's layout: the marker, a newline, the object, a newline, the end marker.
        call = f'{start} "\\n" %json {json.dumps(body)} "\\n" {end}'
        separator = '"\\n"'
    else:
        # mistral: [TOOL_CALLS]name[ARGS]{arguments}, repeated for several calls.
        alternatives = " | ".join(
            f'{json.dumps(name)} "[ARGS]" %json {json.dumps(_styled(parameters[name]))}' for name in names
        )
        call = f"{start} ({alternatives})"
        separator = ""
    rules = [f"start: call{f' ({separator} call)*' if separator else ' (call)*'}" if parallel else "start: call",
             f"call: {call}"]
    return "\n".join(rules) + "\n"


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
