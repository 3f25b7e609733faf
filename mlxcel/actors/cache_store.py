"""The cache-store actor: owns the prompt-prefix store and answers for it.

The store itself is pure logic (``mlxcel.cache.store``); this actor gives it a
clock, serialises access through one inbox, and reports lookups to metrics.
The store's size and evictions are not pushed: ``statistics()`` is pulled when
metrics are rendered. The payloads it holds are opaque handles that only the
device actor opens.

Which stores exist is decided once, at start-up: a store that is off is a
stand-in (``_PrefixStoreOff``, ``_SnapshotStoreOff``) that keeps nothing.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any, cast

import trio

from mlxcel.actors.messages import (
    CacheLookedUp,
    CacheStoreMsg,
    CacheStoreStats,
    DonateSequence,
    DonateSnapshot,
    GetCacheStats,
    KvEventsMsg,
    LookupPrefix,
    LookupSnapshot,
    MetricsMsg,
    PrefixFound,
    PrefixMissing,
    PrefixOnDisk,
    PublishBlockChanges,
    ReleasePayloads,
    ResetCache,
    ShedCache,
    SnapshotFound,
    SnapshotMissing,
    SnapshotOnDisk,
    SnapshotRestoreFailed,
    WriteToDisk,
)
from mlxcel.cache.key import CacheContext
from mlxcel.cache.kv_events import BlockChange
from mlxcel.cache.snapshots import SnapshotHit, SnapshotRefused, SnapshotStats, SnapshotStore
from mlxcel.cache.store import InsertOutcome, Match, PromptCacheStore, ResetOutcome, StoreStats
from mlxcel.core.plan import DiskWrite, KVHandle
from mlxcel.disk.tier import DiskTier

logger = logging.getLogger(__name__)


class _PrefixStoreOff:
    """The prompt cache is off: every lookup misses, and a donation is let go at once."""

    def lookup(self, context: CacheContext, tokens: Sequence[int], now: float, max_len: int | None = None, *,
               record: bool = True, cross_session: bool = True) -> Match | None:
        return None

    def insert(self, context: CacheContext, tokens: Sequence[int], payload: object, nbytes: int, now: float,
               prompt_len: int | None = None, retain_seconds: float = 0.0) -> InsertOutcome:
        return InsertOutcome(stored=False, reason="the prompt cache is off")

    def shed_half(self, now: float) -> tuple[int, int]:
        return 0, 0

    def reset(self) -> ResetOutcome:
        return ResetOutcome(entries_freed=0, bytes_freed=0)

    def take_released(self) -> list[object]:
        return []

    def take_block_changes(self) -> list[BlockChange]:
        return []

    def stats(self, now: float) -> StoreStats | None:
        return None


class _SnapshotStoreOff:
    """No session snapshots (the cache is off, or the family resumes from KV prefixes)."""

    def __init__(self) -> None:
        self._released: list[Any] = []

    def lookup(self, context: CacheContext, tokens: Sequence[int], now: float, *,
               record: bool = True, cross_session: bool = True) -> SnapshotHit | SnapshotRefused | None:
        return None

    def insert(self, context: CacheContext, tokens: Sequence[int], payload: Any, nbytes: int, now: float, *,
               checkpoint: bool = False, cuttable: bool = False) -> bool:
        # Taken and let go at once, so it is freed on the device thread like any other.
        self._released.append(payload)
        return True

    def record_incompatible(self) -> None:
        pass

    def shed_half(self, now: float) -> tuple[int, int]:
        return 0, 0

    def reset(self) -> tuple[int, int] | None:
        return None

    def take_released(self) -> list[Any]:
        released, self._released = self._released, []
        return released

    def stats(self, now: float) -> SnapshotStats | None:
        return None


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
        to_kv_events: trio.MemorySendChannel[KvEventsMsg] | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        # The disk tier: a lookup tier after memory, and where stored prefixes are written behind (None: off).
        # Its writes go to the scheduler, whose next step plan carries them to the device.
        self._disk = disk
        # The KV event publisher, fed the store's block changes (None: events are off).
        self._to_kv_events = to_kv_events
        # Where let-go payloads go, so MLX frees them on the device thread.
        self._to_scheduler = to_scheduler
        self._unstored: list[Any] = []
        # False: lookups never reach another session's entries (tenant isolation).
        self._cross_session = cross_session
        # None: the prompt cache is disabled; every lookup misses and donations are let go.
        self._store: PromptCacheStore | _PrefixStoreOff = store if store is not None else _PrefixStoreOff()
        # The session snapshot store, for snapshot-only model families.
        self._snapshots: SnapshotStore | _SnapshotStoreOff = (
            snapshots if snapshots is not None else _SnapshotStoreOff()
        )
        self._snapshot_capacity_bytes = snapshots.limits.capacity_bytes if snapshots is not None else 0
        self._pinned_capacity_bytes = store.limits.pinned_capacity_bytes if store is not None else 0
        self.inbox = inbox
        self._to_metrics = to_metrics

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox:
            task_status.started()
            async for message in self.inbox:
                self._handle(message)
                del message
                self._pass_on_released()
                await self._pass_on_block_changes()

    def statistics(self) -> CacheStoreStats:
        now = trio.current_time()
        return CacheStoreStats(store=self._store.stats(now), snapshots=self._snapshots.stats(now))

    def _handle(self, message: CacheStoreMsg) -> None:
        now = trio.current_time()
        match message:
            case LookupPrefix():
                found = self._store.lookup(
                    message.context, message.tokens, now, max_len=message.max_len,
                    record=message.record, cross_session=self._cross_session,
                )
                memory: PrefixFound | PrefixMissing = PrefixMissing()
                if found is not None:
                    memory = PrefixFound(
                        matched_len=found.matched_len,
                        # The store keeps payloads opaque; the device's donations are KV handles.
                        payload=cast(KVHandle, found.payload),
                        cross_session=found.cross_session,
                        partial=found.partial,
                    )
                reply = self._disk_lookup(message, memory)
                # A disk plan's outcome is known after the device loads it: the scheduler reports that one.
                if message.record and not isinstance(reply, PrefixOnDisk):
                    self._metric(CacheLookedUp(hit=found is not None, tokens_reused=found.matched_len if found else 0,
                                               tokens_queried=len(message.tokens)))
                _reply(message.reply_to, reply)
            case DonateSequence():
                outcome = self._store.insert(message.context, message.tokens, message.payload, message.nbytes, now,
                                             prompt_len=message.prompt_len, retain_seconds=message.retain_seconds)
                if not outcome.stored:
                    logger.debug("prompt-cache donation not stored (%s)", outcome.reason)
                    self._unstored.append(message.payload)
                else:
                    self._disk_persist(message)
                if outcome.pin_too_large:
                    logger.warning(
                        "a %d-byte prompt-cache entry asked to be retained for %g s is larger than the pinned "
                        "share of the KV store (%d bytes): stored unpinned; raise --prompt-cache-pinned-share "
                        "or --prompt-cache-capacity-bytes",
                        message.nbytes, message.retain_seconds, self._pinned_capacity_bytes,
                    )
            case LookupSnapshot():
                self._lookup_snapshot(message, now)
            case DonateSnapshot():
                self._donate_snapshot(message, now)
            case ShedCache():
                before, after = self._store.shed_half(now)
                if before:
                    logger.warning("out of device memory: shed the prompt cache from %d to %d bytes", before, after)
                self._snapshots.shed_half(now)
            case SnapshotRestoreFailed():
                self._snapshots.record_incompatible()
            case GetCacheStats():
                _reply(message.reply_to, self.statistics())
            case ResetCache():
                reset = self._store.reset()
                freed = {"entries_freed": reset.entries_freed, "bytes_freed": reset.bytes_freed}
                snapshots_freed = self._snapshots.reset()
                if snapshots_freed is not None:
                    freed["snapshots_freed"], freed["snapshot_bytes_freed"] = snapshots_freed
                _reply(message.reply_to, freed)

    # --- the disk tier -----------------------------------------------------------------

    def _disk_lookup(self, message: LookupPrefix, memory: PrefixFound | PrefixMissing) -> Any:
        """Memory's answer, or a disk plan when the disk tier holds more of the prompt.

        Image prompts too: their multimodal digest is in the fingerprint and in every chain hash, and
        the scheduler adopts a prefix only if it covers the request's last image token.
        """
        if self._disk is None or not message.record:
            return memory
        memory_len = memory.matched_len if isinstance(memory, PrefixFound) else 0
        plan = self._disk.probe(message.context, message.tokens, message.max_len, memory_len)
        return memory if plan is None else PrefixOnDisk(memory=memory, plan=plan)

    def _disk_persist(self, message: DonateSequence) -> None:
        """A stored prefix's pieces that are not on disk ride the next step plan; the device writes them behind."""
        if self._disk is None:
            return
        if message.retain_seconds > 0:
            self._disk.record_retention(message.context, message.tokens, message.retain_seconds)
        pieces = self._disk.plan_write(message.context, message.tokens, message.prompt_len)
        if pieces:
            self._write(DiskWrite(payload=message.payload, pieces=pieces, urgent=message.retain_seconds > 0),
                        len(pieces))

    def _write(self, write: DiskWrite, count: int) -> None:
        if self._to_scheduler is None:
            return
        try:
            self._to_scheduler.send_nowait(WriteToDisk(writes=(write,)))
        except trio.WouldBlock:
            assert self._disk is not None
            self._disk.drop(count)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # --- session snapshots ---------------------------------------------------------------

    def _lookup_snapshot(self, message: LookupSnapshot, now: float) -> None:
        reply: SnapshotFound | SnapshotMissing = SnapshotMissing()
        result = self._snapshots.lookup(message.context, message.tokens, now, record=message.record,
                                        cross_session=self._cross_session)
        if isinstance(result, SnapshotHit):
            reply = SnapshotFound(num_tokens=result.num_tokens, payload=result.payload,
                                  partial=result.partial, cross_session=result.cross_session)
        elif isinstance(result, SnapshotRefused):
            reply = SnapshotMissing(refusal=result.cause.value)
        if self._disk is not None and message.record and not message.context.is_multimodal:
            on_disk = self._disk.probe_snapshot(message.context, message.tokens,
                                                result.num_tokens if isinstance(result, SnapshotHit) else 0)
            if on_disk is not None:
                # The scheduler reports the lookup once the device has loaded it.
                _reply(message.reply_to, SnapshotOnDisk(memory=reply, name=on_disk))
                return
        if message.record:
            self._metric(CacheLookedUp(
                hit=isinstance(result, SnapshotHit),
                tokens_reused=result.num_tokens if isinstance(result, SnapshotHit) else 0,
                refusal=result.cause.value if isinstance(result, SnapshotRefused) else None,
                tokens_queried=len(message.tokens),
            ))
        _reply(message.reply_to, reply)

    def _donate_snapshot(self, message: DonateSnapshot, now: float) -> None:
        stored = self._snapshots.insert(message.context, message.tokens, message.payload, message.nbytes, now,
                                        checkpoint=message.checkpoint, cuttable=message.cuttable)
        if stored and self._disk is not None and not message.context.is_multimodal:
            name = self._disk.plan_snapshot(message.context, message.tokens)
            if name is not None:
                self._write(DiskWrite(payload=message.payload, snapshot=name), 1)
        if not stored and message.nbytes > self._snapshot_capacity_bytes:
            logger.warning(
                "a %d-byte session snapshot is larger than the whole snapshot store (%d bytes); "
                "raise --prompt-cache-snapshot-capacity-bytes",
                message.nbytes, self._snapshot_capacity_bytes,
            )

    def _pass_on_released(self) -> None:
        released = self._unstored
        self._unstored = []
        released.extend(self._store.take_released())
        released.extend(self._snapshots.take_released())
        if not released or self._to_scheduler is None:
            return
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            # When it cannot be sent it is freed here instead: correct, only off the device thread.
            self._to_scheduler.send_nowait(ReleasePayloads(payloads=tuple(released)))

    async def _pass_on_block_changes(self) -> None:
        changes = self._store.take_block_changes()
        if not changes or self._to_kv_events is None:
            return
        # Awaited, not sent with send_nowait: a dropped batch would leave routers with blocks that are gone.
        # The publisher only encodes and hands the batch to ZeroMQ, so the wait is short.
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            await self._to_kv_events.send(PublishBlockChanges(changes=tuple(changes)))

    def _metric(self, event: MetricsMsg) -> None:
        if self._to_metrics is None:
            return
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._to_metrics.send_nowait(event)


def _reply(reply_to: trio.MemorySendChannel[Any], value: Any) -> None:
    with reply_to, contextlib.suppress(trio.BrokenResourceError):  # the asker went away
        reply_to.send_nowait(value)
