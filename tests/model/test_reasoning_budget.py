"""The reasoning budget's logits processor: thinking closes when its budget is spent, and only then."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.model.reasoning_budget import ReasoningBudgetProcessor, thinking_spent
from mlxcel.types import ReasoningBudget

START, END_1, END_2, WORD = 10, 11, 12, 5
VOCAB = 16


def run(processor: ReasoningBudgetProcessor, prompt: list[int], *, steps: int, model: list[int] | None = None,
        ) -> list[int]:
    """Decode ``steps`` tokens: the "model" writes WORD (or the scripted ``model`` tokens), unless the
    processor leaves it only one token."""
    history = list(prompt)
    for step in range(steps):
        preferred = (model or [])[step] if model and step < len(model) else WORD
        logits = mx.zeros((1, VOCAB))
        logits[0, preferred] = 5.0
        processed = processor(mx.array(history)[None], logits)
        history.append(int(mx.argmax(processed, axis=-1).item()))
    return history[len(prompt):]


BUDGET = ReasoningBudget(max_tokens=3, start_tokens=(START,), end_tokens=(END_1, END_2))


def test_a_prompt_that_opens_thinking_closes_after_the_budget() -> None:
    reply = run(ReasoningBudgetProcessor(BUDGET), [1, 2, START], steps=8)
    assert reply == [WORD, WORD, WORD, END_1, END_2, WORD, WORD, WORD]


def test_a_think_the_model_opens_is_counted_from_its_marker() -> None:
    processor = ReasoningBudgetProcessor(BUDGET)
    reply = run(processor, [1, 2], steps=12, model=[WORD, WORD, START])
    assert reply[:3] == [WORD, WORD, START]
    # Opened at the third token: checked a budget after the start of the reply, closed at most a
    # budget later than its own budget.
    closed = reply.index(END_1)
    assert 3 + 3 <= closed <= 3 + 3 + 3
    assert reply[closed + 1] == END_2
    assert processor.num_forced_closes == 1


def test_thinking_the_model_closes_itself_is_left_alone() -> None:
    processor = ReasoningBudgetProcessor(BUDGET)
    reply = run(processor, [1, START], steps=8, model=[WORD, END_1, END_2, WORD, WORD, WORD, WORD, WORD])
    assert reply == [WORD, END_1, END_2, WORD, WORD, WORD, WORD, WORD]
    assert processor.num_forced_closes == 0


def test_a_zero_budget_closes_at_once() -> None:
    reply = run(ReasoningBudgetProcessor(ReasoningBudget(max_tokens=0, start_tokens=(START,), end_tokens=(END_1,))),
                [1, START], steps=3)
    assert reply == [END_1, WORD, WORD]


@pytest.mark.parametrize(("tokens", "generated_from", "spent"), [
    ([1, START, 5, 5], 0, 2), ([1, START, 5, END_1, END_2], 0, None), ([1, 2], 0, None), ([START], 0, 0),
    # The prompt's own tokens after its start marker are not the model's thinking.
    ([1, START, 7, 5, 5], 3, 2)])
def test_thinking_spent(tokens: list[int], generated_from: int, spent: int | None) -> None:
    assert thinking_spent(tokens, BUDGET, generated_from=generated_from) == spent


def test_the_prompts_tokens_after_its_start_marker_are_not_counted() -> None:
    # A template that opens thinking with "<think>\n": the newline is the prompt's.
    reply = run(ReasoningBudgetProcessor(BUDGET), [1, START, 7], steps=6)
    assert reply == [WORD, WORD, WORD, END_1, END_2, WORD]
