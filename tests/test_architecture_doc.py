"""docs/architecture.md against the code: its actor table and its message table list what exists.

The message table names every message an actor's inbox takes (the members of
the ``*Msg`` unions of `mlxcel.actors`) and every event of a client's stream;
it may also name one-shot replies. A message added to an inbox without a row,
or a row left behind by a removed message, fails here.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import types
import typing
from pathlib import Path

import attrs
import trio

import mlxcel.actors
from mlxcel.actors import messages
from tests.test_layering import LAYERS

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]


def _members(alias: object) -> set[type]:
    if isinstance(alias, types.UnionType) or typing.get_origin(alias) is typing.Union:
        return set(typing.get_args(alias))
    return {alias} if isinstance(alias, type) else set()


def _actor_modules() -> list[types.ModuleType]:
    return [importlib.import_module(f"mlxcel.actors.{info.name}") for info in pkgutil.iter_modules(mlxcel.actors.__path__)]


def _inbox_messages() -> set[type]:
    """Every class in a ``*Msg`` inbox union of any actor module, and the client stream's events."""
    found = _members(messages.StreamEvent)
    for module in _actor_modules():
        for name, value in vars(module).items():
            if name.endswith("Msg"):
                found |= _members(value)
    return found


def _reply_messages(classes: set[type]) -> set[type]:
    """The types the ``reply_to`` channels of ``classes`` carry."""
    replies: set[type] = set()
    for cls in classes:
        if not attrs.has(cls) or "reply_to" not in attrs.fields_dict(cls):
            continue
        channel = typing.get_type_hints(cls, vars(messages) | {"trio": trio})["reply_to"]
        for carried in typing.get_args(channel):
            replies |= _members(carried)
    return replies


def _table(header: str) -> list[list[str]]:
    """The rows (cells) of the Markdown table whose header row starts with ``header``; header and rule left out."""
    lines = DOC.read_text().splitlines()
    start = next(index for index, line in enumerate(lines) if line.startswith(header))
    rows: list[list[str]] = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def _documented_messages() -> set[str]:
    # The first cell names the messages in backticks; a parenthesis after them says what they carry.
    return {name for row in _table("| message |") for name in re.findall(r"`(\w+)`", row[0].split("(")[0])}


def test_the_message_table_lists_every_inbox_message() -> None:
    inbox = {cls.__name__ for cls in _inbox_messages()}
    missing = inbox - _documented_messages()
    assert not missing, f"docs/architecture.md's message table has no row for: {', '.join(sorted(missing))}"


def test_the_message_table_names_only_messages_that_exist() -> None:
    inbox = _inbox_messages()
    known = {cls.__name__ for cls in inbox | _reply_messages(inbox)}
    stale = _documented_messages() - known
    assert not stale, f"docs/architecture.md's message table names what no inbox takes: {', '.join(sorted(stale))}"


def test_the_parser_reads_the_table() -> None:
    # The checks above are only as good as the parse: a row with two names, one with a parenthesis.
    documented = _documented_messages()
    assert {"RouteRequest", "LookupPrefix", "LookupSnapshot", "RunStep", "WriteToDisk", "StepResult"} <= documented
    assert "StepPlan" not in documented
    assert "PrefixFound" in {cls.__name__ for cls in _reply_messages({messages.LookupPrefix})}


def test_the_actor_table_and_count_match_the_actor_classes() -> None:
    actor_files = {
        f"actors/{module.__name__.rpartition('.')[2]}.py"
        for module in _actor_modules()
        for name, value in vars(module).items()
        if name.endswith("Actor") and isinstance(value, type) and value.__module__ == module.__name__
    }
    documented = {row[1].strip("`") for row in _table("| actor | file |")}
    assert documented == actor_files
    count = re.search(r"mlxcel is (\w+) Trio tasks", DOC.read_text())
    assert count is not None
    assert count.group(1) == NUMBER_WORDS[len(actor_files)]


def _drawn_layers() -> dict[int, set[str]]:
    """The packages of each row of the drawing under "## The packages" (a row may go on over lines)."""
    text = DOC.read_text().split("## The packages", 1)[1].split("```")[1]
    rows: dict[int, set[str]] = {}
    row = None
    for line in text.splitlines()[2:]:
        match = re.match(r"^\s*(\d+)?\s+(\S+(?: \S+)*?)(?:\s{2,}|$)", line)
        if match is None:
            continue
        if match.group(1) is not None:
            row = int(match.group(1))
        if row is not None and (match.group(1) is not None or line.index(match.group(2)) < 30):
            rows.setdefault(row, set()).update(name.strip("/").replace("/", ".") for name in match.group(2).split())
    return rows


def test_the_package_drawing_is_the_layering_tests_layers() -> None:
    assert _drawn_layers() == {row: set(packages) for row, packages in enumerate(LAYERS)}


def test_the_package_drawing_shows_actors_with_actors_only() -> None:
    drawing = DOC.read_text().split("## The packages", 1)[1].split("```")[1]
    (line,) = (line for line in drawing.splitlines() if "actors only:" in line)
    drawn = set(line.split("actors only:", 1)[1].split())
    files = {info.name for info in pkgutil.iter_modules(mlxcel.actors.__path__)} - {"messages"}
    assert drawn == files
