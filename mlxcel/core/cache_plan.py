"""The cache plan: how this server caches, decided once at start-up from the configuration and the model family.

Whether there is a prompt cache at all, whether it resumes from KV prefixes
(plain KV tables: the prefix store, with APC where the family allows it) or
from session snapshots (recurrent, sliding-window and snapshot-only
families), what goes with each mode (prompt donation, boundary snapshots,
checkpoints, warm-ups, the disk tier) and how large the stores are: one
``CachePlan``, made by ``plan_cache`` and handed whole to the engine's
builders and the scheduler. Nothing else looks at the flags again.

Pure: no Trio, no MLX; the log lines it explains itself with are returned, not written.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from mlxcel.cache.capacity import (
    KV_STORE_FLOOR_BYTES,
    CapacityDecision,
    plan_kv_store_capacity,
    plan_snapshot_store_capacity,
)
from mlxcel.config import EngineConfig
from mlxcel.model.family import FamilyKind, ModelFamily


class CacheMode(enum.Enum):
    # No prompt cache: no request reads or donates cache entries.
    OFF = "off"
    # Plain KV tables: a request resumes from the longest stored KV prefix.
    PREFIX = "prefix"
    # State that cannot resume from a KV prefix: a request resumes from a session snapshot.
    SNAPSHOTS = "snapshots"


@attrs.frozen(kw_only=True)
class CachePlan:
    mode: CacheMode = CacheMode.OFF
    # APC: block-hash chains over the prefix store (PREFIX families that support it).
    apc: bool = False
    # Plain KV prompts detached as their prefill ends, for requests parked on them (PREFIX only).
    prompt_donation: bool = False
    # A request may resume from another session's entries.
    cross_session: bool = False
    # Requests sharing at least this many more tokens with a running prefill than the store gives wait for it.
    share_threshold: int = 0
    # SNAPSHOTS: a snapshot at the history boundary; checkpoints every checkpoint_spacing tokens of a long
    # prompt (0: none), the last max_chunk_checkpoints of them; the sliding layers' window, checkpointed.
    boundary_snapshots: bool = False
    checkpoint_spacing: int = 0
    max_chunk_checkpoints: int = 0
    sliding_window: int | None = None
    # SNAPSHOTS: extend a session's snapshot over each reply in the background.
    warm_ups: bool = False
    # The disk tier (--prompt-cache-dir) is opened (never without a prompt cache).
    disk: bool = False
    # One log line per snapshot decision.
    trace: bool = False
    # The stores' byte budgets (0 where the store does not exist) and the model-aware decisions behind them.
    kv_capacity_bytes: int = 0
    snapshot_capacity_bytes: int = 0
    kv_capacity: CapacityDecision | None = None
    snapshot_capacity: CapacityDecision | None = None
    # Why a feature asked for is off for this model, one log line each.
    notes: tuple[str, ...] = ()

    @property
    def enabled(self) -> bool:
        return self.mode is not CacheMode.OFF

    @property
    def snapshots(self) -> bool:
        return self.mode is CacheMode.SNAPSHOTS

    @property
    def prefix(self) -> bool:
        return self.mode is CacheMode.PREFIX


CACHE_OFF = CachePlan()


def uses_snapshots(family: ModelFamily) -> bool:
    """Families whose state cannot resume from a KV prefix: they use session snapshots."""
    return family.snapshot_only or family.kind is not FamilyKind.DENSE


def plan_cache(
    config: EngineConfig, family: ModelFamily, model_config: Mapping[str, Any], *, memory_bytes: int | None = None,
) -> CachePlan:
    """The cache plan for ``config`` and a model of ``family`` (``model_config``: its config.json, for sizes).

    ``memory_bytes``: the memory the store budgets are planned in (default: the installed memory).
    """
    cache = config.prompt_cache
    if not cache.enabled:
        return CACHE_OFF
    snapshots = uses_snapshots(family)
    notes: list[str] = []
    apc = cache.apc_enabled
    if apc and not family.apc_supported:
        notes.append(f"APC disabled for model family {family.model_type} "
                     f"({family.apc_disabled_reason or 'recurrent state'}); the whole-prefix cache stays on")
        apc = False
    if apc and snapshots:
        notes.append(f"APC unused for {family.model_type}: it resumes from session snapshots, not KV prefixes")
        apc = False
    kv_capacity = snapshot_capacity = None
    if snapshots:
        # Snapshot families never donate into the KV store: it stays at its floor, unsized.
        kv_capacity_bytes = cache.capacity_bytes or KV_STORE_FLOOR_BYTES
        snapshot_capacity = plan_snapshot_store_capacity(
            model_config, ctx_size=config.ctx_size, memory_bytes=memory_bytes,
            configured=cache.snapshot_capacity_bytes)
    else:
        kv_capacity = plan_kv_store_capacity(model_config, ctx_size=config.ctx_size, memory_bytes=memory_bytes,
                                             configured=cache.capacity_bytes)
        kv_capacity_bytes = kv_capacity.recommended
    return CachePlan(
        mode=CacheMode.SNAPSHOTS if snapshots else CacheMode.PREFIX,
        apc=apc,
        # Only plain KV tables can be detached mid-flight and adopted by others.
        prompt_donation=not snapshots,
        cross_session=cache.cross_session,
        share_threshold=max(cache.min_prefix, cache.apc_block_size, 1),
        boundary_snapshots=cache.boundary_snapshots,
        checkpoint_spacing=cache.snapshot_checkpoint_tokens,
        max_chunk_checkpoints=cache.snapshot_chunk_checkpoints,
        sliding_window=family.sliding_window if snapshots else None,
        warm_ups=snapshots and cache.warmup,
        disk=cache.disk_dir is not None,
        trace=cache.trace,
        kv_capacity_bytes=kv_capacity_bytes,
        snapshot_capacity_bytes=snapshot_capacity.recommended if snapshot_capacity is not None else 0,
        kv_capacity=kv_capacity,
        snapshot_capacity=snapshot_capacity,
        notes=tuple(notes),
    )
