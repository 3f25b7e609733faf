"""plan_cache: the one place the cache mode and what goes with it are decided, for each family kind."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from mlxcel.cache.capacity import GIB, KV_STORE_FLOOR_BYTES, kv_bytes_per_token
from mlxcel.config import EngineConfig, PromptCacheConfig
from mlxcel.core.cache_plan import CACHE_OFF, CacheMode, plan_cache
from mlxcel.model.family import detect_family

LLAMA = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 8192,
         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "torch_dtype": "bfloat16", "max_position_embeddings": 8192}
QWEN3_NEXT = LLAMA | {"model_type": "qwen3_next"}
GEMMA3 = LLAMA | {"model_type": "gemma3_text", "sliding_window": 512}
MEMORY = 64 * GIB


def _plan(model_config: dict, **cache: object):
    config = EngineConfig(ctx_size=8192, prompt_cache=PromptCacheConfig(**cache))
    return plan_cache(config, detect_family(model_config), model_config, memory_bytes=MEMORY)


def test_a_plain_kv_model_resumes_from_prefixes_with_apc_and_prompt_donation() -> None:
    plan = _plan(LLAMA)
    assert plan.mode is CacheMode.PREFIX
    assert (plan.apc, plan.prompt_donation, plan.warm_ups, plan.sliding_window) == (True, True, False, None)
    assert plan.notes == ()
    # The KV store is sized from the model: at least one entry at the representative length fits.
    assert plan.kv_capacity is not None
    assert plan.kv_capacity_bytes == plan.kv_capacity.recommended >= kv_bytes_per_token(LLAMA) * 8192
    assert (plan.snapshot_capacity, plan.snapshot_capacity_bytes) == (None, 0)
    assert plan.share_threshold == 32  # max(min_prefix 32, apc block 16)
    assert _plan(LLAMA, apc_enabled=False).apc is False
    assert _plan(LLAMA, capacity_bytes=3 * GIB).kv_capacity_bytes == 3 * GIB


def test_a_recurrent_model_resumes_from_snapshots_without_apc_or_prompt_donation() -> None:
    plan = _plan(QWEN3_NEXT)
    assert plan.mode is CacheMode.SNAPSHOTS
    assert (plan.apc, plan.prompt_donation, plan.warm_ups, plan.boundary_snapshots) == (False, False, True, True)
    assert len(plan.notes) == 1
    assert "APC disabled for model family qwen3_next" in plan.notes[0]
    # Its KV store is never donated into: it stays at its floor, unsized; the snapshot store is sized.
    assert (plan.kv_capacity, plan.kv_capacity_bytes) == (None, KV_STORE_FLOOR_BYTES)
    assert plan.snapshot_capacity is not None
    assert plan.snapshot_capacity_bytes == plan.snapshot_capacity.recommended > 0
    assert (plan.checkpoint_spacing, plan.max_chunk_checkpoints) == (8192, 2)
    assert _plan(QWEN3_NEXT, warmup=False).warm_ups is False


def test_a_sliding_window_model_uses_snapshots_and_checkpoints_its_window() -> None:
    plan = _plan(GEMMA3)
    assert plan.mode is CacheMode.SNAPSHOTS
    assert plan.sliding_window == 512
    assert plan.apc is False
    assert plan.notes == ("APC unused for gemma3: it resumes from session snapshots, not KV prefixes",)
    # APC not asked for: nothing to explain.
    assert _plan(GEMMA3, apc_enabled=False).notes == ()


@pytest.mark.parametrize("model_config", [LLAMA, QWEN3_NEXT, GEMMA3])
def test_with_the_cache_off_nothing_is_cached_for_any_family(model_config: dict) -> None:
    plan = _plan(model_config, enabled=False, disk_dir=Path("/tmp/kv"))
    assert plan == CACHE_OFF
    assert not plan.enabled
    assert (plan.apc, plan.prompt_donation, plan.warm_ups, plan.disk) == (False, False, False, False)


@pytest.mark.parametrize("model_config", [LLAMA, QWEN3_NEXT])
def test_the_disk_tier_is_planned_only_with_a_directory(model_config: dict) -> None:
    assert _plan(model_config).disk is False
    assert _plan(model_config, disk_dir=Path("/tmp/kv")).disk is True


def test_the_plan_carries_the_session_settings_as_configured() -> None:
    plan = _plan(LLAMA, cross_session=False, trace=True, min_prefix=64)
    assert (plan.cross_session, plan.trace, plan.share_threshold) == (False, True, 64)
    assert attrs.evolve(plan, mode=CacheMode.OFF).enabled is False
