"""Cheap bounds on grammars before anything compiles them, and a memo bounded by bytes.

Grammar compilation grows much faster than its input (measured on llguidance
1.9 here: 100 `patternProperties` validate in 0.3 s, 200 in 19 s; 1,000
properties in 0.2 s, 10,000 in 16 s; llguidance's GBNF converter, pure
Python, takes 1 s for 500 rules and 33 s for 2,000). So each shape that grows
fast is counted first, in one pass over the parsed JSON or the GBNF text, and
a grammar over a bound is refused before any compiler sees it. What passes
still compiles under a time limit (``mlxcel.model.grammar_check``).
"""

from __future__ import annotations

import collections
import re
import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

import attrs

# JSON Schema keywords whose values map names to subschemas.
_NAMED_SUBSCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# A GBNF rule definition: `name ::=`.
_GBNF_RULE = re.compile(r"(?m)^[ \t]*[A-Za-z0-9_.-]+[ \t]*::=")


@attrs.frozen(kw_only=True)
class GrammarBounds:
    """The largest grammar a request may send; a grammar past one is refused with a 400 naming its field."""

    # A JSON Schema's canonical JSON, or a GBNF grammar's text.
    max_bytes: int = attrs.field(default=256 << 10, validator=attrs.validators.ge(1))
    # Properties (and $defs, and other named subschemas) in one schema, however nested, and in all
    # of a request's tools together (jsonschema's meta-schema check alone takes ~1 s per 1,000 here).
    max_schema_properties: int = attrs.field(default=2_000, validator=attrs.validators.ge(1))
    # patternProperties: each is a regex the compiler intersects with every other.
    max_pattern_properties: int = attrs.field(default=64, validator=attrs.validators.ge(0))
    # JSON values of any kind in one schema (enum members, nested schemas, ...).
    max_schema_nodes: int = attrs.field(default=50_000, validator=attrs.validators.ge(1))
    # Rules of a GBNF grammar.
    max_gbnf_rules: int = attrs.field(default=512, validator=attrs.validators.ge(1))


DEFAULT_GRAMMAR_BOUNDS = GrammarBounds()


def num_properties(schema: Any) -> int:
    """Properties (and other named subschemas) in a schema, however nested: what a request's tools sum."""
    total = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            for keyword in _NAMED_SUBSCHEMAS:
                named = value.get(keyword)
                if isinstance(named, Mapping):
                    total += len(named)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return total


def schema_overrun(schema: Any, schema_json: str, bounds: GrammarBounds) -> str | None:
    """Why a JSON Schema is too large to compile (None: within bounds); ``schema_json`` is its JSON text."""
    nbytes = len(schema_json.encode())
    if nbytes > bounds.max_bytes:
        return f"the schema is {nbytes} bytes; the limit is {bounds.max_bytes}"
    num_nodes = num_named = num_patterns = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        num_nodes += 1
        if num_nodes > bounds.max_schema_nodes:
            return f"the schema has more than {bounds.max_schema_nodes} values"
        if isinstance(value, Mapping):
            for keyword in _NAMED_SUBSCHEMAS:
                named = value.get(keyword)
                if isinstance(named, Mapping):
                    num_named += len(named)
                    if keyword == "patternProperties":
                        num_patterns += len(named)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    if num_patterns > bounds.max_pattern_properties:
        return f"the schema has {num_patterns} patternProperties; the limit is {bounds.max_pattern_properties}"
    if num_named > bounds.max_schema_properties:
        return f"the schema has {num_named} properties; the limit is {bounds.max_schema_properties}"
    return None


def gbnf_overrun(text: str, bounds: GrammarBounds) -> str | None:
    """Why a GBNF grammar is too large to convert and compile (None: within bounds)."""
    nbytes = len(text.encode())
    if nbytes > bounds.max_bytes:
        return f"the grammar is {nbytes} bytes; the limit is {bounds.max_bytes}"
    num_rules = len(_GBNF_RULE.findall(text))
    if num_rules > bounds.max_gbnf_rules:
        return f"the grammar has {num_rules} rules; the limit is {bounds.max_gbnf_rules}"
    return None


Value = TypeVar("Value")


def _key_nbytes(key: Hashable) -> int:
    if isinstance(key, str):
        return len(key)
    if isinstance(key, tuple):
        return sum(_key_nbytes(part) for part in key) + 8
    return 8


class BoundedMemo(Generic[Value]):
    """An LRU memo bounded by entries and by the characters its keys and values hold; thread-safe.

    Requests are validated in worker threads at once, so every read and write takes the lock;
    ``compute`` runs outside it (two threads may compute one key: both get the same answer).
    """

    def __init__(self, *, max_entries: int, max_bytes: int, value_nbytes: Callable[[Value], int]) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._value_nbytes = value_nbytes
        self._entries: collections.OrderedDict[Hashable, tuple[Value, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> tuple[bool, Value | None]:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False, None
            self._entries.move_to_end(key)
            return True, entry[0]

    def put(self, key: Hashable, value: Value) -> None:
        nbytes = _key_nbytes(key) + self._value_nbytes(value)
        if nbytes > self.max_bytes:
            return  # larger than the whole memo: not kept
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.nbytes -= old[1]
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.nbytes -= dropped

    def get_or_compute(self, key: Hashable, compute: Callable[[], Value]) -> Value:
        found, value = self.get(key)
        if found:
            return value  # type: ignore[return-value]
        value = compute()
        self.put(key, value)
        return value

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0


def text_nbytes(value: Any) -> int:
    """The characters of a memo value made of strings (a str, None, or a tuple of them)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, tuple):
        return sum(text_nbytes(part) for part in value) + 8
    return 8
