"""A constrained row whose masks are slow costs its own row, not the batch (issue 33, item 3).

The device runs the real llama fixture; one grammar's matcher is wrapped so
that each of its masks takes seconds (the real matcher behind it). The
step waits for that mask only ``grammar_mask_timeout_s``: the slow row gets
EOS alone and is reported as a grammar failure, while the other rows (one
free, one under a real grammar) decode on at their usual pace.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from mlxcel.core.plan import GrammarFailure
from mlxcel.http.validation import parse_chat_request
from mlxcel.types import SamplingParams
from tests.actors.test_actor_device import GREEDY, batch, direct, running_device

pytestmark = pytest.mark.slow

# Any grammar naming this literal gets slow masks (a GBNF grammar's Lark form keeps it too); one naming
# the second, slow masks from its third on.
SLOW_MARK = "slow-masks-marker"
LATE_SLOW_MARK = "late-slowing-marker"
SLOW_GRAMMAR = f'start: "{SLOW_MARK}" "x"*\n'
SLOW_MASK_SECONDS = 3.0
BOUND_SECONDS = 0.2
EOS = 151645
JSON_OBJECT = parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}}).sampling.grammar


class SlowMasks:
    """The real matcher, whose masks take SLOW_MASK_SECONDS."""

    def __init__(self, matcher: Any, fast_masks: int = 0) -> None:
        self._matcher = matcher
        self._fast_masks = fast_masks

    def unsafe_compute_mask_ptr(self, pointer: int, nbytes: int) -> None:
        if self._fast_masks:
            self._fast_masks -= 1
        else:
            time.sleep(SLOW_MASK_SECONDS)
        self._matcher.unsafe_compute_mask_ptr(pointer, nbytes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


@pytest.fixture
def slow_masks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's matchers of grammars carrying SLOW_MARK compute their masks slowly."""
    from mlxcel.model import grammar_masks

    real = grammar_masks.new_matcher

    def new_matcher(ll_tokenizer: Any, grammar: str) -> Any:
        matcher = real(ll_tokenizer, grammar)
        if LATE_SLOW_MARK in grammar:
            return SlowMasks(matcher, fast_masks=2)
        return SlowMasks(matcher) if SLOW_MARK in grammar else matcher

    monkeypatch.setattr(grammar_masks, "new_matcher", new_matcher)


async def test_a_row_whose_mask_is_late_ends_and_the_others_decode_on_time(slow_masks: None) -> None:
    constrained = SamplingParams(temperature=0.0, grammar=JSON_OBJECT)
    slow = SamplingParams(temperature=0.0, grammar=SLOW_GRAMMAR)
    prompt = tuple(range(1000, 1012))
    async with running_device(prefill_step_size=512, grammar_mask_timeout_s=BOUND_SECONDS) as (driver, _info, _actor):
        # Warm: the shapes compile once, and the llguidance tokenizer is built (the router's check does it first).
        await driver.step(starts=(batch(9, prompt, 2, sampling=constrained),), run_batch=True)
        await driver.run_until_finished({9})
        started = time.monotonic()
        await driver.step(starts=(batch(0, prompt, 10), batch(1, prompt, 10, sampling=constrained),
                                  batch(2, prompt, 10, sampling=slow), direct(3, prompt, 10, sampling=slow)),
                          run_batch=True)
        first_step = time.monotonic() - started
        durations: list[float] = []
        tokens: dict[int, list[Any]] = {sequence_id: [] for sequence_id in range(4)}
        failures: list[GrammarFailure] = []
        for step in driver.steps[-1:]:
            failures.extend(step.grammar.failures if step.grammar else ())
            for token in step.sampled:
                tokens[token.sequence_id].append(token)
        while not all(tokens[sequence_id] and tokens[sequence_id][-1].finish_reason for sequence_id in (0, 1)):
            began = time.monotonic()
            done = await driver.step(run_batch=True)
            durations.append(time.monotonic() - began)
            assert done.error is None, done.error
            failures.extend(done.grammar.failures if done.grammar else ())
            for token in done.sampled:
                tokens[token.sequence_id].append(token)
            assert len(durations) < 40
    # Each slow mask would hold its step SLOW_MASK_SECONDS; the step waited the bound instead.
    assert first_step < SLOW_MASK_SECONDS, first_step
    assert max(durations) < SLOW_MASK_SECONDS / 2, durations
    assert [len(tokens[0]), len(tokens[1])] == [10, 10]
    assert tokens[0][-1].finish_reason == tokens[1][-1].finish_reason == "length"
    # The slow rows ended at once, with EOS, and were reported as late.
    for sequence_id in (2, 3):
        assert [token.token for token in tokens[sequence_id]] == [EOS], tokens[sequence_id]
        assert tokens[sequence_id][-1].finish_reason == "stop"
    assert sorted(failure.sequence_id for failure in failures) == [2, 3]
    assert all(failure.timed_out and "--grammar-mask-timeout-ms" in failure.reason for failure in failures)


async def test_a_grammar_past_llguidance_limits_ends_its_row_as_a_failure() -> None:
    """An ambiguous grammar's first mask needs more Earley items than llguidance allows: the matcher
    fails, the row gets EOS, and the failure is reported (not a silent 'stop')."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    ambiguous = LLMatcher.grammar_from_lark(any_to_lark('root ::= s\ns ::= s s | "a" | "aa" | "b" | [a-z]'))
    prompt = tuple(range(1000, 1012))
    async with running_device(prefill_step_size=512) as (driver, _info, _actor):
        done = await driver.step(starts=(direct(0, prompt, 8, sampling=SamplingParams(
            temperature=0.0, grammar=ambiguous)), batch(1, prompt, 4, sampling=GREEDY)), run_batch=True)
        assert done.error is None
        assert done.grammar is not None
        (failure,) = done.grammar.failures
        assert (failure.sequence_id, failure.timed_out) == (0, False)
        assert "Too many items" in failure.reason
        assert "\n" not in failure.reason
        (first,) = [token for token in done.sampled if token.sequence_id == 0]
        assert (first.token, first.finish_reason) == (EOS, "stop")
        await driver.run_until_finished({1})
