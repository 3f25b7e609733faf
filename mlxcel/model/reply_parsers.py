"""`--tool-call-parser` and `--reasoning-parser`: how replies are split into calls and thinking.

mlx-lm's tokenizer wrapper picks a tool parser (a module of
``mlx_lm.tool_parsers``) from the model's own chat template and its thinking
markers from the vocabulary. A server-wide ``--chat-template`` changes the
format the model is prompted in, so the parser is inferred again from the
template in effect, and either can be named outright (vLLM's names where
vLLM has one, or mlx-lm's module names). The result is a copy of the wrapper
with those settings (the loaded one is shared between engines of a process).
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import types
from typing import Any

from mlxcel.model.parser_names import (
    NO_TOOL_PARSER,
    REASONING_PARSERS,
    VLLM_TOOL_PARSERS,
    parse_reasoning_parser,
    parse_tool_call_parser,
    tool_parser_names,
)

__all__ = ["NO_TOOL_PARSER", "REASONING_PARSERS", "VLLM_TOOL_PARSERS", "parse_reasoning_parser",
           "parse_tool_call_parser", "tool_parser_names", "with_reply_parsers"]


def with_reply_parsers(tokenizer: Any, *, chat_template: str | None, tool_call_parser: str | None,
                       reasoning_parser: str | None) -> Any:
    """The tokenizer wrapper to split replies with: unchanged when nothing was asked for.

    ``chat_template`` is the server-wide template that replaces the model's (None: the model's).
    """
    if chat_template is None and tool_call_parser is None and reasoning_parser is None:
        return tokenizer
    chosen = copy.copy(tokenizer)
    if reasoning_parser is not None and hasattr(type(tokenizer), "has_thinking"):
        # The template still gets the model's own thinking switch: the parser changes how replies are read.
        chosen._template_thinking = bool(tokenizer.has_thinking)
        chosen.__class__ = _keeping_template_thinking(type(tokenizer))  # type: ignore[arg-type]
    module_name = _tool_module(tokenizer, chat_template, tool_call_parser)
    if module_name is not None or tool_call_parser == NO_TOOL_PARSER or chat_template is not None:
        _set_tool_parser(chosen, module_name)
    if reasoning_parser is not None:
        _set_thinking(chosen, REASONING_PARSERS[reasoning_parser])
    return chosen


@functools.cache
def _keeping_template_thinking(cls: type) -> type:
    return type(f"{cls.__name__}WithReplyParsers", (cls,), {
        "has_thinking": property(lambda self: self._template_thinking)})


def _tool_module(tokenizer: Any, chat_template: str | None, name: str | None) -> str | None:
    if name == NO_TOOL_PARSER:
        return None
    if name is not None:
        return VLLM_TOOL_PARSERS.get(name, name)
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    # mlx-lm's own inference (template first, then vocabulary), over the template in effect.
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    view = types.SimpleNamespace(chat_template=chat_template, get_vocab=backend.get_vocab)
    inferred: str | None = _infer_tool_parser(view)
    return inferred


def _set_tool_parser(wrapper: Any, module_name: str | None) -> None:
    # The attributes mlx-lm's TokenizerWrapper keeps them in (mlx-lm is pinned).
    if module_name is None:
        wrapper._tool_parser = wrapper._tool_call_start = wrapper._tool_call_end = None
        wrapper._tool_call_start_tokens = wrapper._tool_call_end_tokens = None
        return
    module = importlib.import_module(f"mlx_lm.tool_parsers.{module_name}")
    wrapper._tool_parser = module.parse_tool_call
    wrapper._tool_call_start = module.tool_call_start
    wrapper._tool_call_end = module.tool_call_end
    backend = getattr(wrapper, "_tokenizer", wrapper)
    def encode(marker: str | None) -> tuple[int, ...] | None:
        return tuple(backend.encode(marker, add_special_tokens=False)) if marker else None

    wrapper._tool_call_start_tokens = encode(module.tool_call_start)
    wrapper._tool_call_end_tokens = encode(module.tool_call_end)


def _set_thinking(wrapper: Any, markers: tuple[str, str] | None) -> None:
    if markers is None:
        wrapper._think_start = wrapper._think_end = None
        wrapper._think_start_tokens = wrapper._think_end_tokens = None
        return
    backend = getattr(wrapper, "_tokenizer", wrapper)
    start, end = markers
    wrapper._think_start, wrapper._think_end = start, end
    wrapper._think_start_tokens = tuple(backend.encode(start, add_special_tokens=False))
    wrapper._think_end_tokens = tuple(backend.encode(end, add_special_tokens=False))
