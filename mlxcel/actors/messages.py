"""Every message the actors exchange.

Commands are verbs, replies and events are nouns or past tense. A message
that wants an answer carries its own one-shot ``reply_to`` channel. MLX arrays
never travel here except inside opaque payload handles that only the device
actor opens.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import trio

from mlxcel.cache.key import CacheContext
from mlxcel.cache.kv_events import BlockChange
from mlxcel.cache.snapshots import SnapshotStats
from mlxcel.cache.store import StoreStats

# The messages that carry the scheduling core's values are defined there (pure), named here.
from mlxcel.core.effects import (
    CacheLookedUp as CacheLookedUp,
    DonateSequence as DonateSequence,
    DonateSnapshot as DonateSnapshot,
    ReplyFinished as ReplyFinished,
    RequestFinished as RequestFinished,
    SchedulerStats as SchedulerStats,
    ShedCache as ShedCache,
    SnapshotRestoreFailed as SnapshotRestoreFailed,
)
from mlxcel.core.plan import DiskWrite, GrammarWork, KVHandle, SampledToken, SpeculationWork, StepPlan, StepResult
from mlxcel.core.scheduler import NewRequest, WarmSession as WarmSession
from mlxcel.disk.index import DiskPlan, SnapshotName
from mlxcel.errors import MlxcelError
from mlxcel.model.prompt import RenderedPrompt
from mlxcel.types import ChatRequest, CompletionRequest, Delta

# --- engine handle -> router ---------------------------------------------------


@attrs.frozen(kw_only=True)
class RouteRequest:
    """A validated API request; the router answers on ``reply_to`` with stream events."""

    request: ChatRequest | CompletionRequest
    request_id: str
    events: EventSink = attrs.field(repr=False)
    # The prompt rendered already (an API process renders its own requests); None: the router renders it.
    rendered: RenderedPrompt | None = attrs.field(default=None, repr=False)
    # The sender processes the output itself (NewRequest.edge_output).
    edge_output: bool = False


@attrs.frozen(kw_only=True)
class RenderPrompt:
    """Render and tokenize a request without generating; the reply is the prompt's token ids or the 4xx."""

    request: ChatRequest | CompletionRequest
    reply_to: trio.MemorySendChannel[tuple[int, ...] | MlxcelError] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class AdapterScales:
    """Read (``scales`` None) or set the server-wide LoRA scales: (id, scale) pairs, the rest at 0.

    The reply is every adapter's (id, path, scale) after the change, or the 4xx.
    """

    scales: tuple[tuple[int, float], ...] | None = None
    reply_to: trio.MemorySendChannel[list[dict[str, Any]] | MlxcelError] = attrs.field(repr=False)


RouterMsg = RouteRequest | RenderPrompt | AdapterScales


# --- router -> scheduler ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class SubmitRequest:
    """A routed request, and where its events go."""

    request: NewRequest
    events: EventSink = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class ReleasePayloads:
    """Evicted or unstored payloads, to be freed on the device thread (cache store -> scheduler)."""

    payloads: tuple[Any, ...] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class WriteToDisk:
    """Stored payloads the disk tier lacks (cache store -> scheduler): they ride the next step's plan."""

    writes: tuple[DiskWrite, ...] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class CancelRequest:
    """The client went away or gave up: free the sequence, donate nothing."""

    request_id: str


@attrs.frozen(kw_only=True)
class StopRequest:
    """The edge found a stop string in a reply it processes (NewRequest.edge_output): end it, donating."""

    request_id: str


@attrs.frozen(kw_only=True)
class GetSchedulerStats:
    reply_to: trio.MemorySendChannel[SchedulerStats] = attrs.field(repr=False)


# --- scheduler -> client stream ----------------------------------------------------


@attrs.frozen(kw_only=True)
class RequestFailed:
    """The request ended with an error; ``error`` is what the client sees."""

    error: MlxcelError


# SampledToken: only to an edge that processes the output itself (NewRequest.edge_output).
StreamEvent = Delta | RequestFailed | SampledToken


class EventSink(Protocol):
    """Where a request's events go: a Trio memory channel, or ``mlxcel.http.engine_link``'s sink for a client in another
    process. ``send_nowait`` raises ``trio.WouldBlock`` (buffer full) or ``trio.BrokenResourceError`` /
    ``trio.ClosedResourceError`` (the client is gone); the sender then cancels the request."""

    def send_nowait(self, value: StreamEvent) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> Any: ...

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any, /) -> Any: ...


# --- scheduler <-> device -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class RunStep:
    """Carry out one step of the scheduling core (the plan holds every decision)."""

    plan: StepPlan = attrs.field(repr=False)
    # Payloads the cache stores let go of: dropped with this message, on the device thread.
    release: tuple[Any, ...] = attrs.field(default=(), repr=False)
    reply_to: trio.MemorySendChannel[StepResult] = attrs.field(repr=False)


# --- the disk tier: configuration only; its reads and writes ride RunStep's plan (mlxcel/disk/device.py) ---


@attrs.frozen(kw_only=True)
class UseDiskTier:
    """From the engine at start-up: the device writes and reads this disk tier (``disk/tier.py``)."""

    tier: Any = attrs.field(repr=False)


DeviceMsg = RunStep | UseDiskTier


# --- scheduler <-> cache store ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class LookupPrefix:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    max_len: int
    # False: a peek that neither counts as a hit or miss nor refreshes recency.
    record: bool = True
    reply_to: trio.MemorySendChannel[PrefixFound | PrefixMissing | PrefixOnDisk] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class PrefixFound:
    matched_len: int
    payload: KVHandle = attrs.field(repr=False)
    cross_session: bool
    partial: bool


@attrs.frozen(kw_only=True)
class PrefixMissing:
    pass


@attrs.frozen(kw_only=True)
class PrefixOnDisk:
    """The disk tier holds more of the prompt than memory: the device loads ``plan`` (else ``memory`` stands)."""

    memory: PrefixFound | PrefixMissing
    plan: DiskPlan


@attrs.frozen(kw_only=True)
class LookupSnapshot:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    # False: a peek for the warmer that counts nothing.
    record: bool = True
    reply_to: trio.MemorySendChannel[SnapshotFound | SnapshotMissing | SnapshotOnDisk] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class SnapshotFound:
    num_tokens: int
    payload: Any = attrs.field(repr=False)
    # Cut back from a longer snapshot (partial restore), or another session's.
    partial: bool = False
    cross_session: bool = False


@attrs.frozen(kw_only=True)
class SnapshotMissing:
    # None: no snapshot for the session; else why the stored one was refused.
    refusal: str | None = None


@attrs.frozen(kw_only=True)
class SnapshotOnDisk:
    """A longer snapshot is on disk: the device loads ``name`` (else ``memory`` stands)."""

    memory: SnapshotFound | SnapshotMissing
    name: SnapshotName


@attrs.frozen(kw_only=True)
class GetCacheStats:
    reply_to: trio.MemorySendChannel[CacheStoreStats] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class ResetCache:
    reply_to: trio.MemorySendChannel[dict[str, int]] = attrs.field(repr=False)


CacheStoreMsg = (
    LookupPrefix | DonateSequence | LookupSnapshot | DonateSnapshot | SnapshotRestoreFailed | ShedCache
    | GetCacheStats | ResetCache
)


# --- anyone -> metrics ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class RenderMetrics:
    # The prompt-prefix store as it is now (None: the prompt cache is off), pulled
    # by the asker so the store's gauges and eviction counters are current.
    store: StoreStats | None = None
    # The scheduler's queue as it is now, for the running and waiting gauges.
    scheduler: SchedulerStats | None = None
    # The session snapshot store (None: not a snapshot family, or the cache is off).
    snapshots: SnapshotStats | None = None
    # The disk tier (disk/directory.py's DiskStats; None: off).
    disk: Any = None
    reply_to: trio.MemorySendChannel[bytes] = attrs.field(repr=False)


MetricsMsg = CacheLookedUp | RequestFinished | RenderMetrics | GrammarWork | SpeculationWork


# --- cache store -> KV event publisher ---------------------------------------------------


@attrs.frozen(kw_only=True)
class PublishBlockChanges:
    """The store's APC block changes after one message, in order: one KVEventBatch."""

    changes: tuple[BlockChange, ...] = attrs.field(repr=False)


KvEventsMsg = PublishBlockChanges


@attrs.frozen(kw_only=True)
class KvEventsStats:
    num_batches: int
    num_events: int
    num_replays: int


# --- scheduler -> warmer -------------------------------------------------------------------


WarmerMsg = ReplyFinished


# --- statistics() of the other actors ---------------------------------------------------


@attrs.frozen(kw_only=True)
class RouterStats:
    num_routed: int
    num_rejected: int


@attrs.frozen(kw_only=True)
class WarmerStats:
    num_replies_seen: int
    num_warmups_requested: int


@attrs.frozen(kw_only=True)
class MetricsStats:
    num_events: int


@attrs.frozen(kw_only=True)
class CacheStoreStats:
    """The cache store's ``statistics()`` and its answer to ``GetCacheStats``."""

    # None: the prompt cache is off.
    store: StoreStats | None
    # None: this model family does not use session snapshots (or the cache is off).
    snapshots: SnapshotStats | None = None

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def to_json(self) -> dict[str, Any]:
        """The body of ``/v1/cache/stats`` (before the engine and the app add to it)."""
        if self.store is None:
            return {"enabled": False, "entries": 0, "bytes": 0, "apc_enabled": False}
        body = attrs.asdict(self.store)
        body["enabled"] = True
        # ``bytes`` counts each shared piece once; ``logical_bytes`` what the entries would take unshared.
        body["unique_bytes"] = self.store.bytes
        body["sharing_ratio"] = round(self.store.sharing_ratio, 4)
        if self.snapshots is not None:
            body["snapshots"] = attrs.asdict(self.snapshots)
        return body
