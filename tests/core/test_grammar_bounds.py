"""The cheap grammar bounds and the byte-bounded memo (mlxcel.core.grammar_bounds)."""

from __future__ import annotations

import json

from mlxcel.core.grammar_bounds import (
    DEFAULT_GRAMMAR_BOUNDS,
    BoundedMemo,
    GrammarBounds,
    gbnf_overrun,
    schema_overrun,
    text_nbytes,
)


def overrun(schema: object, bounds: GrammarBounds = DEFAULT_GRAMMAR_BOUNDS) -> str | None:
    return schema_overrun(schema, json.dumps(schema), bounds)


def test_schemas_within_the_bounds_pass() -> None:
    assert overrun({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}) is None


def test_each_fast_growing_shape_is_counted_however_nested() -> None:
    nested = {"type": "object", "properties": {"outer": {"type": "array", "items": {
        "patternProperties": {f"^p{i}": {} for i in range(65)}}}}}
    assert "65 patternProperties" in overrun(nested)
    assert "2001 properties" in overrun({"$defs": {f"d{i}": {} for i in range(2001)}})
    assert "more than 50000 values" in overrun({"enum": [0] * 60_000})
    assert "bytes; the limit is 100" in overrun({"description": "x" * 200}, GrammarBounds(max_bytes=100))


def test_gbnf_rules_and_bytes_are_counted_before_conversion() -> None:
    rules = "root ::= a\n" + "".join(f'a{i} ::= "{i}"\n' for i in range(600))
    assert "601 rules" in gbnf_overrun(rules, GrammarBounds())
    assert gbnf_overrun('root ::= "yes" | "no"', GrammarBounds()) is None
    assert "the limit is 10" in gbnf_overrun('root ::= "a long one"', GrammarBounds(max_bytes=10))


def test_the_memo_is_bounded_by_bytes_as_well_as_entries() -> None:
    memo: BoundedMemo[str | None] = BoundedMemo(max_entries=4096, max_bytes=1 << 20, value_nbytes=text_nbytes)
    for index in range(70):
        memo.put(("tenant", f"{index}" + "x" * (100 << 10)), None)  # 100 KiB keys
    assert memo.nbytes <= 1 << 20
    assert len(memo) == 10
    assert memo.get(("tenant", "69" + "x" * (100 << 10))) == (True, None)  # the newest are kept
    assert memo.get(("tenant", "0" + "x" * (100 << 10))) == (False, None)
    memo.put(("tenant", "y" * (2 << 20)), None)  # larger than the whole memo: not kept, nothing evicted
    assert len(memo) == 10


def test_schema_memo_keeps_its_byte_bound_under_many_large_schemas() -> None:
    """70 requests of 8 MB tool schemas left +655 MB in the memo; now it holds its byte bound."""
    from mlxcel.http import validation

    validation._SCHEMA_MEMO.clear()
    for index in range(140):  # 35 MB of distinct schemas, past the memo's 32 MiB
        parameters = {"type": "object", "description": f"{index}" + "d" * (250 << 10)}
        validation.parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": parameters}}]})
    assert 0 < validation._SCHEMA_MEMO.nbytes <= validation.SCHEMA_MEMO_BYTES
    assert len(validation._SCHEMA_MEMO) < 140
