"""A Lark grammar without recursion as one regular expression.

A custom tool's input is a string inside the model's JSON tool call
(`{"name": "apply_patch", "arguments": {"input": "..."}}`), so its grammar
must hold for the string once its JSON escapes are undone. llguidance does
exactly that for a JSON-schema string `pattern`, so a grammar that is regular
(no rule reaches itself: Codex's `apply_patch` is one) is inlined here into
one regex for that pattern. A recursive grammar, or a construct outside the
subset below, raises `UnsupportedGrammar`.

The subset: rules and terminals (`?name`, `!name`, priorities), `|`,
grouping, `[...]`, `? * +`, `~ n` and `~ n..m`, strings (with the `i` flag),
`/regex/flags`, `"a".."z"` ranges, `-> alias`, `%import common.NAME` for
the common terminals, comments (`#`, `//`).
"""

from __future__ import annotations

import json
import re

__all__ = ["UnsupportedGrammar", "lark_to_regex"]

# lark's common.lark terminals, as regexes.
_COMMON = {
    "LF": r"\n", "CR": r"\r", "NEWLINE": r"(?:\r?\n)+", "WS_INLINE": r"[ \t]+", "WS": r"[ \t\f\r\n]+",
    "DIGIT": r"[0-9]", "HEXDIGIT": r"[a-fA-F0-9]", "INT": r"[0-9]+", "SIGNED_INT": r"[+-]?[0-9]+",
    "DECIMAL": r"(?:[0-9]+\.[0-9]*|\.[0-9]+)", "LETTER": r"[A-Za-z]", "LCASE_LETTER": r"[a-z]",
    "UCASE_LETTER": r"[A-Z]", "WORD": r"[A-Za-z]+", "CNAME": r"[A-Za-z_][A-Za-z0-9_]*",
    "NUMBER": r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "SIGNED_NUMBER": r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?",
    "ESCAPED_STRING": r'"(?:[^"\\\n]|\\.)*"', "SH_COMMENT": r"#[^\n]*", "CPP_COMMENT": r"//[^\n]*",
}
# Rust's regex crate metacharacters: the only ones a literal escapes.
_META = set("\\.+*?()|[]{}^$#&-~")
_TOKEN = re.compile(r"""
    (?P<space>[ \t]+|\\\n)
  | (?P<comment>(?://|\#)[^\n]*)
  | (?P<newline>\n)
  | (?P<string>"(?:[^"\\\n]|\\.)*"i?)
  | (?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)
  | (?P<directive>%[a-z]+)
  | (?P<arrow>->)
  | (?P<range>\.\.)
  | (?P<number>[0-9]+)
  | (?P<name>[?!]?[_a-zA-Z][_a-zA-Z0-9]*(?:\.[_a-zA-Z0-9]+)*)
  | (?P<punct>[:|()\[\]?*+~.,])
""", re.VERBOSE)


class UnsupportedGrammar(ValueError):
    """The grammar is recursive, or uses what this conversion does not take."""


def _literal(text: str) -> str:
    return "".join(f"\\{char}" if char in _META else (
        char if char.isprintable() or char in " \t" else f"\\x{{{ord(char):x}}}") for char in text).replace(
        "\t", r"\t")


def _string_value(token: str) -> tuple[str, bool]:
    insensitive = token.endswith("i")
    body = token[:-1] if insensitive else token
    try:
        value = json.loads(body)
    except ValueError as error:
        raise UnsupportedGrammar(f"the string {token} is not one this conversion reads") from error
    return value, insensitive


def _tokens(definition: str) -> list[tuple[str, str]]:
    tokens: list[tuple[str, str]] = []
    position = 0
    while position < len(definition):
        match = _TOKEN.match(definition, position)
        if match is None:
            raise UnsupportedGrammar(f"cannot read the grammar at {definition[position:position + 20]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            tokens.append((kind, match.group()))
        position = match.end()
    tokens.append(("newline", "\n"))
    return tokens


def _definitions(definition: str) -> tuple[dict[str, list[tuple[str, str]]], set[str]]:
    """Each rule's body as tokens, and the common terminals imported."""
    rules: dict[str, list[tuple[str, str]]] = {}
    imported: set[str] = set()
    lines: list[list[tuple[str, str]]] = [[]]
    for token in _tokens(definition):
        if token[0] == "newline":
            lines.append([])
        else:
            lines[-1].append(token)
    current: str | None = None
    for line in lines:
        if not line:
            continue
        if line[0] == ("punct", "|") and current is not None:
            rules[current] += line  # a continued alternative
            continue
        if line[0][0] == "directive":
            if line[0][1] != "%import":
                raise UnsupportedGrammar(f"{line[0][1]} is not supported in a custom tool's grammar")
            names = [value for kind, value in line[1:] if kind == "name"]
            # `%import common.LF` or `%import common (LF, WS)`.
            if names[:1] == ["common"] and len(names) > 1:
                names = [f"common.{name}" for name in names[1:]]
            for name in names:
                module, _, terminal = name.rpartition(".")
                if module != "common" or terminal not in _COMMON:
                    raise UnsupportedGrammar(f"%import of {name} is not supported (only common terminals)")
                imported.add(terminal)
            current = None
            continue
        if line[0][0] != "name":
            raise UnsupportedGrammar(f"a rule must start with its name, got {line[0][1]!r}")
        name = line[0][1].lstrip("?!")
        stem, _, priority = name.rpartition(".")
        if stem and priority.isdigit():
            name = stem  # a priority: order does not change what a regex matches
        rest = line[1:]
        if rest[:1] != [("punct", ":")]:
            raise UnsupportedGrammar(f"expected ':' after {name}")
        if name in rules:
            raise UnsupportedGrammar(f"{name} is defined twice")
        rules[name] = rest[1:]
        current = name
    return rules, imported


class _Converter:
    def __init__(self, rules: dict[str, list[tuple[str, str]]], imported: set[str]) -> None:
        self._rules = rules
        self._imported = imported
        self._done: dict[str, str] = {}
        self._active: list[str] = []

    def rule(self, name: str) -> str:
        if name in self._done:
            return self._done[name]
        if name in self._active:
            raise UnsupportedGrammar(f"the grammar is recursive ({' -> '.join([*self._active, name])}); only "
                                     "grammars without recursion can be enforced inside a JSON tool call")
        if name not in self._rules:
            if name in self._imported:
                return _COMMON[name]
            raise UnsupportedGrammar(f"{name} is used but not defined")
        self._active.append(name)
        tokens = self._rules[name]
        regex, position = self._alternatives(tokens, 0)
        if position != len(tokens):
            raise UnsupportedGrammar(f"unexpected {tokens[position][1]!r} in {name}")
        self._active.pop()
        self._done[name] = regex
        return regex

    def _alternatives(self, tokens: list[tuple[str, str]], position: int) -> tuple[str, int]:
        options = []
        while True:
            sequence, position = self._sequence(tokens, position)
            options.append(sequence)
            if position < len(tokens) and tokens[position] == ("punct", "|"):
                position += 1
                continue
            break
        return (options[0] if len(options) == 1 else "(?:" + "|".join(options) + ")"), position

    def _sequence(self, tokens: list[tuple[str, str]], position: int) -> tuple[str, int]:
        items = []
        while position < len(tokens):
            kind, value = tokens[position]
            if kind == "punct" and value in ("|", ")", "]"):
                break
            if kind == "arrow":
                position += 2  # `-> alias` names the tree node only
                continue
            atom, position = self._atom(tokens, position)
            items.append(atom)
        return "".join(items), position

    def _atom(self, tokens: list[tuple[str, str]], position: int) -> tuple[str, int]:
        kind, value = tokens[position]
        position += 1
        if kind == "string":
            text, insensitive = _string_value(value)
            if position + 1 < len(tokens) and tokens[position][0] == "range":
                end, _ = _string_value(tokens[position + 1][1])
                if len(text) != 1 or len(end) != 1:
                    raise UnsupportedGrammar("a range joins two one-character strings")
                regex = f"[{_literal(text)}-{_literal(end)}]"
                position += 2
            else:
                regex = f"(?i:{_literal(text)})" if insensitive else f"(?:{_literal(text)})" if len(text) > 1 \
                    else _literal(text)
        elif kind == "regex":
            body, _, flags = value[1:].rpartition("/")
            unknown = set(flags) - set("ims")
            if unknown:
                raise UnsupportedGrammar(f"regex flags {''.join(sorted(unknown))} are not supported")
            regex = f"(?{flags}:{body})" if flags else f"(?:{body})"
        elif kind == "name":
            regex = f"(?:{self.rule(value.lstrip('?!'))})"
        elif (kind, value) == ("punct", "("):
            inner, position = self._alternatives(tokens, position)
            position = self._expect(tokens, position, ")")
            regex = f"(?:{inner})"
        elif (kind, value) == ("punct", "["):
            inner, position = self._alternatives(tokens, position)
            position = self._expect(tokens, position, "]")
            regex = f"(?:{inner})?"
        else:
            raise UnsupportedGrammar(f"unexpected {value!r}")
        while position < len(tokens):
            kind, value = tokens[position]
            if kind == "punct" and value in "?*+":
                regex, position = f"(?:{regex}){value}", position + 1
            elif (kind, value) == ("punct", "~"):
                low = tokens[position + 1] if position + 1 < len(tokens) else ("", "")
                if low[0] != "number":
                    raise UnsupportedGrammar("~ takes a count")
                position += 2
                high = low[1]
                ranged = position + 1 < len(tokens) and tokens[position][0] == "range"
                if ranged and tokens[position + 1][0] == "number":
                    high = tokens[position + 1][1]
                    position += 2
                regex = f"(?:{regex}){{{low[1]},{high}}}"
            else:
                break
        return regex, position

    def _expect(self, tokens: list[tuple[str, str]], position: int, closing: str) -> int:
        if position >= len(tokens) or tokens[position] != ("punct", closing):
            raise UnsupportedGrammar(f"expected {closing!r}")
        return position + 1


def lark_to_regex(definition: str) -> str:
    """The language of the grammar's `start` rule, as one (Rust-syntax) regex."""
    rules, imported = _definitions(definition)
    if "start" not in rules:
        raise UnsupportedGrammar("the grammar has no start rule")
    return _Converter(rules, imported).rule("start")
