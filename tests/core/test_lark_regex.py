"""Lark grammars without recursion as one regex: the language is the grammar's."""

from __future__ import annotations

import re

import pytest

from mlxcel.core.lark_regex import UnsupportedGrammar, lark_to_regex
from tests.integration.client_shapes import APPLY_PATCH_LARK

PATCHES = [
    "*** Begin Patch\n*** Add File: README.md\n+hello\n+\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: src/a.py\n*** Move to: src/b.py\n@@ def f():\n-    return 1\n+    return 2\n"
    "     pass\n*** End of File\n*** Delete File: old.txt\n*** End Patch",
]
NOT_PATCHES = [
    "", "*** Begin Patch\n*** End Patch\n", "*** Begin Patch\n*** Add File: a\n*** End Patch\n",
    "*** Begin Patch\n*** Update File: a\nx line\n*** End Patch\n", "{\"input\": \"*** Begin Patch\"}",
    "*** Begin Patch\n*** Delete File: a\n*** End Patch\n\n",
]


@pytest.mark.parametrize("text", PATCHES)
def test_apply_patch_grammar_accepts_patches(text: str) -> None:
    assert re.fullmatch(lark_to_regex(APPLY_PATCH_LARK), text)


@pytest.mark.parametrize("text", NOT_PATCHES)
def test_apply_patch_grammar_refuses_what_is_not_a_patch(text: str) -> None:
    assert not re.fullmatch(lark_to_regex(APPLY_PATCH_LARK), text)


@pytest.mark.parametrize(("grammar", "matches", "misses"), [
    ('start: "a"i ("b" | "c")+ DIGIT~2\n%import common.DIGIT', ["Ab12", "abcb00"], ["ab1", "a12"]),
    ('start: x [y]\nx: "a".."c"\ny.2: /z+/', ["a", "bzz"], ["d", "az y"]),
    ("start: WORD\n    | NUMBER // a comment\n%import common (WORD, NUMBER)", ["hi", "4.5e3"], ["hi5"]),
])
def test_operators_and_imports(grammar: str, matches: list[str], misses: list[str]) -> None:
    regex = lark_to_regex(grammar)
    assert all(re.fullmatch(regex, text) for text in matches)
    assert not any(re.fullmatch(regex, text) for text in misses)


@pytest.mark.parametrize(("grammar", "why"), [
    ('start: a\na: "(" a ")" | "x"', "recursive"),
    ('start: "a"\n%ignore " "', "%ignore is not supported"),
    ("start: b", "b is used but not defined"),
    ('a: "x"', "no start rule"),
    ('start: "x"\n%import other.X', "only common terminals"),
])
def test_what_cannot_be_one_regex_is_refused(grammar: str, why: str) -> None:
    with pytest.raises(UnsupportedGrammar, match=why):
        lark_to_regex(grammar)
