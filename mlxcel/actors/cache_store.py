"""The cache-store actor: owns the prompt-prefix store and answers for it.

The store itself is pure logic (``mlxcel.cache.store``); this actor gives it a
clock, serialises access through one inbox, and reports metric events. The
payloads it holds are opaque handles that only the device actor opens.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from mlxcel.actors.messages import (
    CacheLookedUp,
    CacheStoreChanged,
    CacheStoreMsg,
    DonateSequence,
    GetCacheStats,
    LookupPrefix,
    MetricsMsg,
    DonateSnapshot,
    LookupSnapshot,
    PrefixFound,
    PrefixMissing,
    ReleasePayloads,
    ResetCache,
    ShedCache,
    SnapshotFound,
    SnapshotMissing,
    SnapshotRestoreFailed,
)
from mlxcel.cache.snapshots import SnapshotHit, SnapshotRefused, SnapshotStore
from mlxcel.cache.store import PromptCacheStore

logger = logging.getLogger(__name__)


class CacheStoreActor:
    def __init__(
        self,
        *,
        store: PromptCacheStore | None,
        inbox: trio.MemoryReceiveChannel[CacheStoreMsg],
        to_metrics: trio.MemorySendChannel[MetricsMsg] | None = None,
        snapshots: SnapshotStore | None = None,
        cross_session: bool = True,
        to_scheduler: trio.MemorySendChannel[Any] | None = None,
    ) -> None:
        # Where let-go payloads go, so MLX frees them on the device thread.
        self._to_scheduler = to_scheduler
        self._unstored: list[Any] = []
        # False: lookups never reach another session's entries (tenant isolation).
        self._cross_session = cross_session
        # None: the prompt cache is disabled; every lookup misses and donations are dropped.
        self._store = store
        # The session snapshot store, for snapshot-only model families.
        self._snapshots = snapshots
        self.inbox = inbox
        self._to_metrics = to_metrics

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                self._handle(message)
                del message
                self._pass_on_released()

    def statistics(self) -> dict[str, Any]:
        if self._store is None:
            return {"enabled": False, "entries": 0, "bytes": 0, "apc_enabled": False}
        now = trio.current_time()
        stats = attrs.asdict(self._store.stats(now))
        stats["enabled"] = True
        if self._snapshots is not None:
            stats["snapshots"] = attrs.asdict(self._snapshots.stats(now))
        return stats

    def _handle(self, message: CacheStoreMsg) -> None:
        now = trio.current_time()
        match message:
            case LookupPrefix():
                found = None
                if self._store is not None:
                    found = self._store.lookup(
                        message.context, message.tokens, now, max_len=message.max_len,
                        record=message.record, cross_session=self._cross_session,
                    )
                    self._report_store_state()
                reply: PrefixFound | PrefixMissing = PrefixMissing()
                if found is not None:
                    reply = PrefixFound(
                        matched_len=found.matched_len,
                        payload=found.payload,
                        cross_session=found.cross_session,
                        partial=found.partial,
                    )
                if message.record:
                    self._metric(CacheLookedUp(hit=found is not None, tokens_reused=found.matched_len if found else 0))
                _reply(message.reply_to, reply)
            case DonateSequence():
                if self._store is None:
                    return
                outcome = self._store.insert(message.context, message.tokens, message.payload, message.nbytes, now,
                                             prompt_len=message.prompt_len)
                if not outcome.stored:
                    logger.debug("prompt-cache donation not stored (%s)", outcome.reason)
                    self._unstored.append(message.payload)
                self._report_store_state()
            case LookupSnapshot():
                snapshot_reply: SnapshotFound | SnapshotMissing = SnapshotMissing()
                if self._snapshots is not None:
                    result = self._snapshots.lookup(message.context, message.tokens, now, record=message.record)
                    if isinstance(result, SnapshotHit):
                        snapshot_reply = SnapshotFound(num_tokens=result.num_tokens, payload=result.payload)
                    elif isinstance(result, SnapshotRefused):
                        snapshot_reply = SnapshotMissing(refusal=result.cause.value)
                    if message.record:
                        self._metric(CacheLookedUp(
                            hit=isinstance(result, SnapshotHit),
                            tokens_reused=result.num_tokens if isinstance(result, SnapshotHit) else 0,
                        ))
                _reply(message.reply_to, snapshot_reply)
            case DonateSnapshot():
                if self._snapshots is not None and not self._snapshots.insert(
                    message.context, message.tokens, message.payload, message.nbytes, now
                ):
                    self._unstored.append(message.payload)
                    logger.warning(
                        "a %d-byte session snapshot is larger than the whole snapshot store (%d bytes); "
                        "raise --prompt-cache-snapshot-capacity-bytes",
                        message.nbytes, self._snapshots.limits.capacity_bytes,
                    )
            case ShedCache():
                if self._store is not None:
                    freed_before = self._store.stats(now).bytes
                    self._store.shed(freed_before // 2)
                    logger.warning("out of device memory: shed the prompt cache from %d to %d bytes",
                                   freed_before, self._store.stats(now).bytes)
                    self._report_store_state()
                if self._snapshots is not None:
                    self._snapshots.shed(self._snapshots.stats(now).bytes // 2)
            case SnapshotRestoreFailed():
                if self._snapshots is not None:
                    self._snapshots.record_incompatible()
            case GetCacheStats():
                _reply(message.reply_to, self.statistics())
            case ResetCache():
                freed = {"entries_freed": 0, "bytes_freed": 0}
                if self._store is not None:
                    outcome = self._store.reset()
                    freed = {"entries_freed": outcome.entries_freed, "bytes_freed": outcome.bytes_freed}
                    self._report_store_state()
                if self._snapshots is not None:
                    entries, nbytes = self._snapshots.reset()
                    freed["snapshots_freed"] = entries
                    freed["snapshot_bytes_freed"] = nbytes
                _reply(message.reply_to, freed)

    def _pass_on_released(self) -> None:
        released = self._unstored
        self._unstored = []
        for store in (self._store, self._snapshots):
            if store is not None:
                released.extend(store.take_released())
        if not released or self._to_scheduler is None:
            return
        try:
            self._to_scheduler.send_nowait(ReleasePayloads(payloads=tuple(released)))
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # freed here instead: correct, only off the device thread

    def _report_store_state(self) -> None:
        if self._store is None:
            return
        stats = self._store.stats(trio.current_time())
        self._metric(CacheStoreChanged(nbytes=stats.bytes, entries=stats.entries, evictions=dict(stats.evictions)))

    def _metric(self, event: MetricsMsg) -> None:
        if self._to_metrics is None:
            return
        try:
            self._to_metrics.send_nowait(event)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _reply(reply_to: trio.MemorySendChannel[Any], value: Any) -> None:
    with reply_to:
        try:
            reply_to.send_nowait(value)
        except trio.BrokenResourceError:
            pass  # the asker went away
