"""The names `--tool-call-parser` and `--reasoning-parser` accept (pure: the CLI checks flags before MLX loads)."""

from __future__ import annotations

import functools
import importlib.util
import pkgutil
from pathlib import Path

# vLLM's `--tool-call-parser` names for the formats mlx-lm parses.
VLLM_TOOL_PARSERS = {
    "hermes": "json_tools", "qwen": "json_tools", "mistral": "mistral", "pythonic": "pythonic",
    "qwen3_coder": "qwen3_coder", "qwen3_xml": "qwen3_coder", "glm45": "glm47", "glm47": "glm47",
    "kimi_k2": "kimi_k2", "minimax_m2": "minimax_m2", "longcat": "longcat", "functiongemma": "function_gemma",
    "gemma4": "gemma4",
}
# `--reasoning-parser` names (vLLM's) and the markers around the thinking.
REASONING_PARSERS: dict[str, tuple[str, str] | None] = {
    "deepseek_r1": ("<think>", "</think>"), "deepseek_v3": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"), "glm45": ("<think>", "</think>"), "ernie45": ("<think>", "</think>"),
    "minimax_m2": ("<think>", "</think>"), "hunyuan_a13b": ("<think>", "</think>"),
    "mistral": ("[THINK]", "[/THINK]"), "longcat": ("<longcat_think>", "</longcat_think>"),
    "gemma4": ("<|channel>thought", "<channel|>"), "none": None,
}
NO_TOOL_PARSER = "none"


@functools.cache
def tool_parser_names() -> tuple[str, ...]:
    # Found without importing mlx_lm (which loads MLX): the CLI checks flags before anything starts.
    spec = importlib.util.find_spec("mlx_lm")
    folders = [Path(folder) / "tool_parsers" for folder in (spec.submodule_search_locations or ())] if spec else []
    modules = [module.name for module in pkgutil.iter_modules([str(folder) for folder in folders])]
    return tuple(sorted({*VLLM_TOOL_PARSERS, *modules, NO_TOOL_PARSER}))


def parse_tool_call_parser(text: str) -> str:
    """A ``--tool-call-parser`` value: a known name, or a ValueError listing them."""
    name = text.strip()
    if name not in tool_parser_names():
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(tool_parser_names())}")
    return name


def parse_reasoning_parser(text: str) -> str:
    name = text.strip()
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(sorted(REASONING_PARSERS))}")
    return name
