"""The batched decode step normalizes the logits only when a row reads them, and otherwise is mlx-lm's own."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import GenerationBatch

from mlxcel.model import batch_step, patches
from mlxcel.model.sampling import greedy_reporting_logprobs, make_sampler, make_sampling
from mlxcel.types import SamplingParams

ROWS, VOCAB = 3, 50


def greedy(logprobs):
    return mx.argmax(logprobs, axis=-1)


def batch(samplers) -> SimpleNamespace:
    """What ``_step`` reads of a GenerationBatch: a model whose logits move with the input token."""
    table = mx.array(np.random.default_rng(0).standard_normal((100, VOCAB)).astype(np.float32) * 4 + 7)
    return SimpleNamespace(
        _next_tokens=mx.array([3, 14, 15]), _next_logprobs=[mx.zeros((VOCAB,))] * ROWS,
        model=lambda inputs, cache: table[inputs], prompt_cache=None, logits_processors=[None] * ROWS,
        uids=[0, 1, 2], samplers=samplers, fallback_sampler=greedy, _token_context=[None] * ROWS,
        tokens=[[] for _ in range(ROWS)])


def run(step, samplers) -> tuple[list[int], np.ndarray]:
    state = batch(samplers)
    step(state)
    mx.eval(state._next_tokens, state._next_logprobs)
    return state._next_tokens.tolist(), np.stack([np.array(row) for row in state._next_logprobs])


def test_greedy_rows_get_their_tokens_without_the_normalization() -> None:
    tokens, values = run(batch_step.step, [None] * ROWS)
    theirs, normalized = run(patches.original(GenerationBatch, "_step"), [None] * ROWS)
    assert tokens == theirs
    assert not np.allclose(np.log(np.exp(values).sum(axis=-1)), 0.0)  # the logits as they came
    assert np.allclose(np.log(np.exp(normalized).sum(axis=-1)), 0.0, atol=1e-5)


@pytest.mark.parametrize("reading", [greedy_reporting_logprobs, make_sampler(SamplingParams(temperature=0.7, top_p=0.9))])
def test_a_row_that_reads_logprobs_makes_the_step_mlx_lms_own(reading) -> None:
    samplers = [None, reading, None]
    mx.random.seed(3)
    tokens, values = run(batch_step.step, samplers)
    original = patches.original(GenerationBatch, "_step")
    mx.random.seed(3)
    theirs, normalized = run(original, samplers)
    assert tokens == theirs
    assert np.array_equal(values, normalized)


def test_which_samplers_read_normalized_logprobs() -> None:
    def reads(sampling: SamplingParams) -> bool:
        sampler, _processors = make_sampling(sampling)
        return batch_step.reads_logprobs(sampler if sampler is not None else greedy, greedy)

    assert not reads(SamplingParams(temperature=0.0))
    assert reads(SamplingParams(temperature=0.0, logprobs=True))
    assert not reads(SamplingParams(temperature=0.8, min_p=0.1, top_k=20))
    assert reads(SamplingParams(temperature=0.8, top_p=0.95))
    assert reads(SamplingParams(temperature=0.8, logprobs=True))
    assert batch_step.reads_logprobs(lambda logprobs: logprobs, greedy)  # a sampler it does not know: yes


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """The arguments of every ``mx.async_eval`` call from here on (each still queued)."""
    calls: list[tuple[Any, ...]] = []
    real = mx.async_eval

    def recording(*arrays: Any) -> None:
        calls.append(arrays)
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", recording)
    return calls


def test_the_step_queues_the_logprobs_matrix_not_an_array_per_row(queued) -> None:
    """mlx-lm queues each row's logprobs as an array of its own (a slice and a reshape a row in every step's
    graph); here the rows are lazy views of the one matrix, and read back the same."""
    state = batch([None] * ROWS)
    batch_step.step(state)
    ((tokens, matrix, context, riders),) = queued
    assert riders == []
    assert isinstance(matrix, mx.array)
    assert matrix.shape == (ROWS, VOCAB)
    assert context == []
    assert len(state._next_logprobs) == ROWS
    for e, row in enumerate(state._next_logprobs):
        assert np.array_equal(np.array(row), np.array(matrix[e]))
    assert tokens.tolist() == np.argmax(np.array(matrix), axis=-1).tolist()


def test_finished_rows_copies_ride_with_the_next_step_and_stale_ones_are_flushed(queued):
    """A finished row's KV copy is queued with the next decode step (not alone, behind the step in flight);
    one that no step took by the executor's next step is queued by itself, and nothing is queued twice."""
    first, second = mx.arange(4) * 2, mx.arange(3) + 1
    batch_step.evaluate_with_next_step([first], queued_at=7)
    batch_step.flush_older_than(7)  # the same executor step: still waiting for a decode step
    assert queued == []
    batch_step.step(batch([None] * ROWS))
    ((_tokens, _matrix, _context, riders),) = queued
    assert [id(array) for array in riders] == [id(first)]
    assert first.tolist() == [0, 2, 4, 6]

    queued.clear()
    batch_step.evaluate_with_next_step([second], queued_at=8)
    batch_step.flush_older_than(9)  # a whole executor step went by without a decode step
    assert [[id(array) for array in call[0]] for call in queued] == [[id(second)]]
    batch_step.step(batch([None] * ROWS))
    assert queued[-1][3] == []
    assert second.tolist() == [1, 2, 3]


def test_a_wave_of_copies_is_spread_over_the_next_steps(queued, monkeypatch):
    """More copies than a step's budget go a share a step, the oldest first, each group within
    RIDER_SPREAD_STEPS steps; what is left when no step takes it is flushed, once."""
    monkeypatch.setattr(batch_step, "RIDER_BUDGET", 2)
    monkeypatch.setattr(batch_step, "RIDER_SPREAD_STEPS", 4)
    wave = [mx.arange(3) + value for value in range(10)]  # a share of 3 a step
    late = [mx.arange(3) - value for value in range(4)]  # a share of 1
    batch_step.evaluate_with_next_step(wave, queued_at=1)
    taken = []
    for step in range(3):
        if step == 1:
            batch_step.evaluate_with_next_step(late, queued_at=2)
        batch_step.step(batch([None] * ROWS))
        taken.append([id(array) for array in queued[-1][3]])
    assert taken == [[id(a) for a in wave[0:3]], [id(a) for a in wave[3:7]], [id(a) for a in wave[7:10] + late[:1]]]
    queued.clear()
    batch_step.flush_older_than(2)  # only groups queued before step 2
    assert queued == []
    batch_step.flush_older_than(3)
    assert [[id(array) for array in call[0]] for call in queued] == [[id(a) for a in late[1:]]]
    batch_step.step(batch([None] * ROWS))
    assert queued[-1][3] == []
    assert [array.tolist() for array in wave + late] == [[v, v + 1, v + 2] for v in range(10)] + [
        [-v, 1 - v, 2 - v] for v in range(4)]


GRAMMAR_VOCAB = 151646


def grammar_batch(sampling: list[SamplingParams]) -> SimpleNamespace:
    """A batch of the fixture tokenizer's vocabulary whose rows' grammars (a JSON object) have started: each
    grammar row's first token sampled under its first mask, as a start pass does."""
    from mlx_lm.models.cache import TokenBuffer
    from mlx_lm.utils import load_tokenizer

    from mlxcel.fixtures.text import fixture_path
    from mlxcel.model.grammar_masks import Grammars

    tokenizer = load_tokenizer(fixture_path("llama"))
    grammars = Grammars(tokenizer, frozenset({tokenizer.eos_token_id}))
    table = mx.array(np.random.default_rng(1).standard_normal((64, GRAMMAR_VOCAB)).astype(np.float32) * 3)
    samplers, processors, first = [], [], []
    for row, params in enumerate(sampling):
        sampler, row_processors = make_sampling(params, grammars, sequence_id=row)
        logits = table[row : row + 1]
        for processor in row_processors or ():
            logits = processor(mx.array([1, 2, 3]), logits)
        first.append(int((sampler or greedy)(logits).item()))
        samplers.append(sampler)
        processors.append(row_processors)
    rows = len(sampling)
    return SimpleNamespace(
        _next_tokens=mx.array(first), _next_logprobs=[mx.zeros((GRAMMAR_VOCAB,))] * rows,
        model=lambda inputs, cache: table[inputs % 64], prompt_cache=None, logits_processors=processors,
        uids=list(range(rows)), samplers=samplers, fallback_sampler=greedy,
        _token_context=[TokenBuffer([1, 2, 3]) for _ in range(rows)], tokens=[[] for _ in range(rows)])


def grammar_replies(step, sampling: list[SamplingParams], steps: int) -> list[list[int]]:
    mx.random.seed(5)
    state = grammar_batch(sampling)
    for _ in range(steps):
        step(state)
    mx.eval(state._next_tokens)
    return [row + [token] for row, token in zip(state.tokens, state._next_tokens.tolist(), strict=True)]


@functools.cache
def json_object_grammar() -> str:
    from mlxcel.http.validation import parse_chat_request

    grammar = parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_object"}}).sampling.grammar
    assert grammar is not None
    return grammar


@pytest.mark.slow
@pytest.mark.parametrize("form", ["additive", "boolean"])
@pytest.mark.parametrize("mix", ["all constrained", "mixed"])
def test_grammar_rows_masked_together_sample_what_mlx_lms_step_samples_row_by_row(
        mix: str, form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The step masks its grammar rows in one operation and samples them with their own samplers; mlx-lm's
    step runs each row's processor and masked sampler alone. Same tokens, step after step, with the masks in
    either form (additive on the CPU; boolean, unpacked on the device, on a GPU)."""
    if form == "boolean":
        monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    grammar = json_object_grammar()
    if mix == "all constrained":
        sampling = [SamplingParams(temperature=0.0, grammar=grammar)] * 3
    else:
        sampling = [SamplingParams(temperature=0.0, grammar=grammar), SamplingParams(temperature=0.0),
                    SamplingParams(temperature=0.9, seed=4, grammar=grammar),
                    SamplingParams(temperature=0.0, grammar=grammar, repetition_penalty=1.3),
                    SamplingParams(temperature=0.0, logprobs=True)]
    ours = grammar_replies(batch_step.step, sampling, 12)
    theirs = grammar_replies(patches.original(GenerationBatch, "_step"), sampling, 12)
    assert ours == theirs
    from mlx_lm.utils import load_tokenizer

    from mlxcel.fixtures.text import fixture_path

    tokenizer = load_tokenizer(fixture_path("llama"))
    for row, params in enumerate(sampling):
        if params.grammar is not None:
            assert tokenizer.decode(ours[row]).lstrip().startswith("{")


@pytest.mark.slow
def test_a_steps_masks_start_before_its_forward_pass_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    """The masks follow the tokens read back at the step's start, so they compute on their threads while the
    host queues the forward pass (on a GPU most of a step's host time), not after it."""
    from mlxcel.model.grammar_masks import Grammars

    state = grammar_batch([SamplingParams(temperature=0.0, grammar=json_object_grammar())] * 2)
    events: list[str] = []
    real_start, real_queue = Grammars.start_masks, mx.async_eval

    def start_masks(self, *args):
        events.append("masks")
        return real_start(self, *args)

    def queue(*arrays):
        events.append("queue")
        return real_queue(*arrays)

    monkeypatch.setattr(Grammars, "start_masks", start_masks)
    monkeypatch.setattr(mx, "async_eval", queue)
    batch_step.step(state)
    assert events[0] == "masks"
    assert "queue" in events[1:]
