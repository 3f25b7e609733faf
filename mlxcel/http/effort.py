"""Reasoning effort, one mapping for every route: the template's reasoning switch and a thinking budget.

Responses' `reasoning.effort`, Anthropic's `output_config.effort` (and the
chat route's `reasoning_effort`) name how hard the model should think. A
template that reads `reasoning_effort` (gpt-oss) gets the level; one that
reads `enable_thinking` (Qwen3) thinks unless the effort is "none" or
"minimal". Every effort also has a thinking budget: when the model has
thought that many tokens, it is made to close its thinking
(`mlxcel.model.reasoning_budget`). A template with no switch renders as it is;
the effort is accepted there (Codex and Claude Code send it on every request)
and only its budget applies, to a model that thinks anyway.

Pure: no Trio, no MLX.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["EFFORTS", "EFFORT_BUDGETS", "ReasoningChoice", "effort_choice"]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# Thinking tokens each effort allows (None: no limit). "none" allows none: a model that
# starts thinking anyway closes at once.
EFFORT_BUDGETS: dict[str, int | None] = {
    "none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": None, "max": None,
}
# gpt-oss's template knows three levels.
_TEMPLATE_LEVELS = {"none": "low", "minimal": "low", "xhigh": "high", "max": "high"}


@attrs.frozen(kw_only=True)
class ReasoningChoice:
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    # Thinking tokens before the end of thinking is forced (None: no limit).
    budget: int | None = None


def effort_choice(effort: str, chat_template: str) -> ReasoningChoice:
    """What ``effort`` (one of EFFORTS) sets for a model whose chat template is ``chat_template``."""
    budget = EFFORT_BUDGETS[effort]
    if "reasoning_effort" in chat_template:
        return ReasoningChoice(template_kwargs={"reasoning_effort": _TEMPLATE_LEVELS.get(effort, effort)},
                               budget=budget)
    if "enable_thinking" in chat_template:
        thinks = effort not in ("none", "minimal")
        return ReasoningChoice(template_kwargs={"enable_thinking": thinks}, budget=budget if thinks else None)
    return ReasoningChoice(budget=budget)
