"""Helpers shared by the tests (importable as ``tests.support``)."""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig
from mlxcel.model.fixtures import fixture_path

# A small budget keeps test memory low and skips the model-aware sizing.
TEST_CACHE = PromptCacheConfig(capacity_bytes=512 << 20)


def make_engine_config(family: str = "llama", **changes: Any) -> EngineConfig:
    prompt_cache = changes.pop("prompt_cache", TEST_CACHE)
    # The start-up warm-up is skipped (0.2 s per engine); test_engine covers it.
    scheduler = changes.pop("scheduler", SchedulerConfig(prefill_step_size=512, device_warmup="false"))
    return EngineConfig(
        model_path=fixture_path(family), prompt_cache=prompt_cache, scheduler=scheduler, **changes
    )



def evolve_cache(**changes: Any) -> PromptCacheConfig:
    return attrs.evolve(TEST_CACHE, **changes)
