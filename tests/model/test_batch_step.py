"""The batched decode step normalizes the logits only when a row reads them, and otherwise is mlx-lm's own."""

from __future__ import annotations

from types import SimpleNamespace

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


def test_the_step_queues_the_logprobs_matrix_not_an_array_per_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """mlx-lm queues each row's logprobs as an array of its own (a slice and a reshape a row in every step's
    graph); here the rows are lazy views of the one matrix, and read back the same."""
    queued = []
    real = mx.async_eval

    def recording(*arrays):
        queued.append(arrays)
        return real(*arrays)

    monkeypatch.setattr(mx, "async_eval", recording)
    state = batch([None] * ROWS)
    batch_step.step(state)
    ((tokens, matrix, context),) = queued
    assert isinstance(matrix, mx.array)
    assert matrix.shape == (ROWS, VOCAB)
    assert context == []
    assert len(state._next_logprobs) == ROWS
    for e, row in enumerate(state._next_logprobs):
        assert np.array_equal(np.array(row), np.array(matrix[e]))
    assert tokens.tolist() == np.argmax(np.array(matrix), axis=-1).tolist()
