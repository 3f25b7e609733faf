"""A start's logits at one position per row: the head projects those positions alone, with the same values."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.model.executor import HEAD_AFTER_INNER_MODULES, StepExecutor
from mlxcel.model.loader import LoadedModel


class _Wrapped:
    """A model of a class outside HEAD_AFTER_INNER_MODULES: the logits come from its whole forward pass."""

    def __init__(self, model: Any) -> None:
        self.model, self.calls = model, 0

    def __call__(self, tokens: Any, cache: Any = None) -> Any:
        self.calls += 1
        return self.model(tokens, cache=cache)


@pytest.mark.slow
@pytest.mark.parametrize("wrapped", [False, True])
def test_the_logits_at_each_rows_own_position_are_the_whole_passes(
        loaded_model: Callable[[str], LoadedModel], wrapped: bool) -> None:
    model = loaded_model("llama").model
    assert type(model).__module__ in HEAD_AFTER_INNER_MODULES
    tokens = mx.array([[300 + 7 * row + column for column in range(12)] for row in range(3)])
    positions = mx.array([11, 4, 7])
    reference = model(tokens, cache=make_prompt_cache(model))[mx.arange(3), positions]
    runner = _Wrapped(model) if wrapped else model
    caches = make_prompt_cache(model)
    got = StepExecutor._logits_at(types.SimpleNamespace(_model=runner), tokens, caches, positions)
    assert got.shape == reference.shape == (3, model.args.vocab_size)
    assert mx.allclose(got, reference, atol=1e-5).item()
    assert mx.argmax(got, axis=-1).tolist() == mx.argmax(reference, axis=-1).tolist()
    # Every position's keys and values are in the cache, whichever way the logits were projected.
    assert [cache.offset for cache in caches] == [12] * len(caches)
    if wrapped:
        assert runner.calls == 1
