"""Chat-template rendering that stops at a time limit and an output size.

A Jinja template is a program: one loop or one ``"ab " * 30000000`` can run for
a minute and fill gigabytes. Every render here runs under a deadline, checked
on each Python call and on each line of the compiled template (a trace
function, set only for the render's thread and only while it renders), and its
text is refused past ``max_chars``. A template a request supplies is compiled
in ``BoundedSandbox`` instead of transformers' environment: the same immutable
sandbox and helpers, plus checks that refuse a repetition, concatenation or
power whose result would pass the size limit before it is built. A sandbox
cannot bound everything a template can do (the deadline is what stops a loop
that builds a huge string step by step), so request templates stay off unless
the operator allows them.

Plain code: no Trio, no MLX.
"""

from __future__ import annotations

import collections
import contextlib
import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Seconds one render may take.
RENDER_TIMEOUT_S = 5.0
# Request-supplied templates kept compiled.
_COMPILED_TEMPLATES = 16
# A printf width or precision larger than this could build a huge string in one call.
_FORMAT_NUMBER = re.compile(r"%[-+ #0]*(\d+)|%[-+ #0]*\d*\.(\d+)")


class RenderOverrun(Exception):
    """A render ran past its deadline (``too_large`` False) or its size limit (True)."""

    def __init__(self, message: str, *, too_large: bool) -> None:
        super().__init__(message)
        self.too_large = too_large


@contextlib.contextmanager
def render_deadline(seconds: float, *, max_chars: int | None = None) -> Iterator[None]:
    """Raise RenderOverrun inside the calling thread's Python code once ``seconds`` pass,
    or, with ``max_chars``, once a variable of the compiled template holds a longer value."""
    end = time.monotonic() + seconds

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > end:
            raise RenderOverrun(f"the chat template took longer than {seconds:g} s to render", too_large=False)
        # Line events only in the compiled template itself, where its loops run.
        if frame.f_code.co_filename != "<template>":
            return None
        if max_chars is not None:
            for value in frame.f_locals.values():
                _check_value(value, max_chars)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def check_size(text: str, max_chars: int) -> str:
    if len(text) > max_chars:
        raise RenderOverrun(
            f"the rendered prompt is {len(text)} characters, more than this model's context can hold "
            f"({max_chars} characters at most)", too_large=True,
        )
    return text


def _sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _check_value(value: Any, max_chars: int) -> None:
    if _sized(value) and len(value) > max_chars:
        raise RenderOverrun(f"the chat template built a value of {len(value)} items, past the limit of {max_chars}",
                            too_large=True)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template sandbox, with results bounded before they are built."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, *, max_chars: int) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.filters["center"] = self._center
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_dict,
                            namespace=type("namespace", (_Namespace,), {"max_chars": max_chars}))

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        size = 0
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if _sized(sequence) and isinstance(count, int):
                    size = len(sequence) * count
        elif operator == "+" and _sized(left) and _sized(right):
            size = len(left) + len(right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
            size = right * left.bit_length() // 8  # bytes of the result
        elif operator == "%" and isinstance(left, str):
            size = max((int(number) for match in _FORMAT_NUMBER.finditer(left) for number in match.groups()
                        if number), default=0)
        if size > self.max_chars:
            raise RenderOverrun(f"the chat template builds a value of about {size} items, past the limit of "
                                f"{self.max_chars}", too_large=True)
        return super().call_binop(context, operator, left, right)

    def _center(self, value: Any, width: int = 80) -> str:
        if width > self.max_chars:
            raise RenderOverrun(f"center({width}) is past the limit of {self.max_chars}", too_large=True)
        return str(value).center(width)


class RequestTemplates:
    """Renders templates that requests supply, compiled in a BoundedSandbox (a few kept compiled)."""

    def __init__(self, *, max_chars: int) -> None:
        self._environment = BoundedSandbox(max_chars=max_chars)
        self._max_chars = max_chars
        self._compiled: collections.OrderedDict[str, jinja2.Template] = collections.OrderedDict()
        self._lock = threading.Lock()

    def render(self, source: str, variables: dict[str, Any], *, timeout_s: float = RENDER_TIMEOUT_S) -> str:
        with render_deadline(timeout_s, max_chars=self._max_chars):
            template = self._template(source)
            parts: list[str] = []
            num_chars = 0
            for part in template.generate(**variables):
                num_chars += len(part)
                if num_chars > self._max_chars:
                    check_size("".join(parts) + part, self._max_chars)
                parts.append(part)
            return "".join(parts)

    def _template(self, source: str) -> jinja2.Template:
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return template
        template = self._environment.from_string(source)
        with self._lock:
            self._compiled[source] = template
            while len(self._compiled) > _COMPILED_TEMPLATES:
                self._compiled.popitem(last=False)
        return template


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (they could reach Python internals)
    and values past the size limit (a loop can grow one a step at a time)."""

    max_chars = 0  # set on the subclass each BoundedSandbox makes

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        for name, value in dict(*args, **kwargs).items():
            type(self).check(name, value)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        type(self).check(name, value)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @classmethod
    def check(cls, name: Any, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold the name {name!r}")
        _check_value(value, cls.max_chars)


def _dict(*args: Any, **kwargs: Any) -> dict[Any, Any]:
    return dict(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like transformers' filter: no HTML escaping.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)
