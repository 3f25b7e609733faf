"""A reasoning budget: once a reply has thought for its budget, its thinking is closed.

As vLLM's and llama.cpp's reasoning budgets do: when the tokens since the
model's start-of-thinking marker reach the budget, the logits of the next
steps allow only the end-of-thinking marker's tokens, one per step, so a
runaway think ends and the reply goes on to its answer.

It is an mlx-lm logits processor (``processor(history, logits)``, the history
being every token of the sequence so far), built per request from its
`SamplingParams.reasoning_budget`. The history is read back only at the few
steps where the budget may be spent (its length is known without a read), so
a budgeted sequence syncs with the device about once per budget, not per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxcel.types import ReasoningBudget

__all__ = ["ReasoningBudgetProcessor", "thinking_spent"]


def _rfind(tokens: Sequence[int], pattern: Sequence[int]) -> int:
    """Where ``pattern`` last starts in ``tokens`` (-1: nowhere, or an empty pattern)."""
    size = len(pattern)
    if not size:
        return -1
    for start in range(len(tokens) - size, -1, -1):
        if tokens[start] == pattern[0] and list(tokens[start:start + size]) == list(pattern):
            return start
    return -1


def thinking_spent(tokens: Sequence[int], budget: ReasoningBudget, *, generated_from: int = 0) -> int | None:
    """Tokens of thinking the model wrote (those from ``generated_from`` on) since the last open
    start marker (None: no thinking is open)."""
    start = _rfind(tokens, budget.start_tokens)
    end = _rfind(tokens, budget.end_tokens)
    if start < 0 or end > start:
        return None
    return len(tokens) - max(start + len(budget.start_tokens), generated_from)


class ReasoningBudgetProcessor:
    """The logits processor of one budgeted sequence (it keeps that sequence's state)."""

    def __init__(self, budget: ReasoningBudget) -> None:
        self.budget = budget
        # The history length at which to look again (None: at the first call).
        self._next_check: int | None = None
        # How many of the end marker's tokens have been forced; None while not forcing.
        self._forced: int | None = None
        # The history's length at the first call: the prompt's (its tokens are not the model's thinking).
        self._prompt_length: int | None = None
        self.num_forced_closes = 0

    def __call__(self, history: Any, logits: Any) -> Any:
        length = int(history.shape[-1])
        if self._forced is not None:
            return self._force(logits)
        if self._prompt_length is None:
            self._prompt_length = length
        if self._next_check is None:
            # The prompt may end inside thinking (templates that open it for the model).
            self._next_check = length
        if length < self._next_check:
            return logits
        # The one read-back: is thinking open, and for how long?
        window = history.reshape(-1)[-(self.budget.max_tokens + 4096):]
        offset = length - int(window.shape[0])
        spent = thinking_spent(window.tolist(), self.budget, generated_from=max(0, self._prompt_length - offset))
        if spent is None:
            # Not thinking now: a start marker may still come, so look again a budget later
            # (a late think can overrun its budget by at most that much).
            self._next_check = length + max(1, self.budget.max_tokens)
            return logits
        if spent < self.budget.max_tokens:
            self._next_check = length + self.budget.max_tokens - spent
            return logits
        self._forced = 0
        self.num_forced_closes += 1
        return self._force(logits)

    def _force(self, logits: Any) -> Any:
        import mlx.core as mx

        assert self._forced is not None
        token = self.budget.end_tokens[self._forced]
        self._forced += 1
        if self._forced == len(self.budget.end_tokens):
            # Closed: a later think (a second block) gets a budget of its own.
            self._forced = None
            self._next_check = None
        allowed = mx.arange(logits.shape[-1]) == token
        return mx.where(allowed, logits, mx.array(-float("inf"), dtype=logits.dtype))
