"""The scheduler actor: one task between the inbox, the cache store and the device.

Each turn of its loop: take what the inbox holds (submissions, cancels,
warm-ups, released payloads, disk writes, stats requests); answer the
lookups the core asks for, one at a time, from the cache store (a disk hit
is handed over as a read for the start to carry, not loaded here); ask the
core for a ``StepPlan``; have the device carry it out; hand the
``StepResult`` to the core; send what it produced to the clients and the
other actors. While the
batch only decodes, the next plan goes to the device before the step in
flight reports (at most ``steps_ahead`` in flight), so the device starts
each step without waiting for the host to read the last one; a plan with
starts waits until every step has reported. The device replies with
``send_nowait`` into each step's own channel, so the cycle cannot deadlock.
Every decision is the core's (``mlxcel/core/scheduler.py``).

Per-client events go out with ``send_nowait``: a client whose buffer is
full, or who has gone, is cancelled. Messages to other actors go out the
same way; one whose inbox is full drops the message with a warning.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, TypeVar

import trio

from mlxcel.actors.messages import (
    CacheLookedUp,
    CacheStoreMsg,
    CancelRequest,
    DeviceMsg,
    EventSink,
    GetSchedulerStats,
    LookupPrefix,
    LookupSnapshot,
    MetricsMsg,
    PrefixFound,
    PrefixMissing,
    PrefixOnDisk,
    ReleasePayloads,
    RequestFailed,
    RunStep,
    SchedulerStats,
    SnapshotFound,
    SnapshotMissing,
    SnapshotOnDisk,
    StopRequest,
    StreamEvent,
    SubmitRequest,
    WarmerMsg,
    WarmSession,
    WriteToDisk,
)
from mlxcel.config import SchedulerConfig
from mlxcel.core.cache_plan import CACHE_OFF, CachePlan
from mlxcel.core.effects import ReplyFinished, RequestFinished
from mlxcel.core.plan import Capabilities, DiskRead, SampledToken, StepPlan, StepResult
from mlxcel.core.scheduler import Hit, Lookup, LookupResult, Miss, OnDisk, SchedulerCore
from mlxcel.errors import MlxcelError
from mlxcel.types import Delta

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

SchedulerMsg = (SubmitRequest | CancelRequest | StopRequest | GetSchedulerStats | WarmSession | ReleasePayloads
                | WriteToDisk)

# How long an idle device waits for requests the router says are right behind
# the first one, so clients that arrive together are prefilled together; it
# stops sooner once they fill the batch's rows (core's `starting_from_idle`). A
# wave of 64 reached the scheduler about one a millisecond on the 2-core box, so
# 20 ms took 17-24 of them (the H200's wave split 20-24 / 40-44 the same way),
# and the rest waited out that whole pass, where a GPU's 2,048-token step holds
# about 50.
ARRIVAL_WINDOW_SECONDS = 0.05
# With the device idle, rounds of lookups for requests submitted while the last round was answered, before
# the step is planned (each round needs new submissions; the bound only guards against an endless stream).
MAX_LOOKUP_ROUNDS = 8


class _Channels:
    """The core's ``Clients``: each request's event channel, by request id."""

    def __init__(self) -> None:
        self.events: dict[str, EventSink] = {}

    def send(self, request_id: str, delta: Delta | SampledToken) -> bool:
        return self._send(request_id, delta)

    def fail(self, request_id: str, error: MlxcelError) -> None:
        self._send(request_id, RequestFailed(error=error))

    def close(self, request_id: str) -> None:
        events = self.events.pop(request_id, None)
        if events is not None:
            events.close()

    def _send(self, request_id: str, event: StreamEvent) -> bool:
        events = self.events.get(request_id)
        if events is None:
            return False
        try:
            events.send_nowait(event)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            return False


class SchedulerActor:
    def __init__(
        self,
        *,
        config: SchedulerConfig,
        capabilities: Capabilities,
        inbox: trio.MemoryReceiveChannel[SchedulerMsg],
        to_device: trio.MemorySendChannel[DeviceMsg],
        to_cache_store: trio.MemorySendChannel[CacheStoreMsg] | None,
        to_metrics: trio.MemorySendChannel[MetricsMsg] | None,
        to_warmer: trio.MemorySendChannel[WarmerMsg] | None,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        cache: CachePlan = CACHE_OFF,
    ) -> None:
        if cache.enabled and to_cache_store is None:
            raise ValueError(f"a {cache.mode.value} cache plan needs a cache store to ask")
        self.core = SchedulerCore(
            capabilities,
            tokenizer=tokenizer,
            eos_token_ids=eos_token_ids,
            max_queued_requests=config.max_queued_requests,
            cache=cache,
            # The warmer renders the next turn from the reply's text.
            keep_reply_text=cache.snapshots and to_warmer is not None,
            on_trace=(lambda text: logger.info("apc-trace: %s", text)) if cache.trace else None,
        )
        self.inbox = inbox
        # Steps in flight at most: 2 lets the next decode step wait on the device while the host reads this one.
        self._steps_ahead = max(1, config.steps_ahead)
        self._to_device = to_device
        self._to_cache_store = to_cache_store
        self._to_metrics = to_metrics
        self._to_warmer = to_warmer
        self._clients = _Channels()
        self._num_submitted = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with self.inbox, self._to_device:
            try:
                await self._run(task_status)
            finally:
                self._hand_over_writes()

    def _hand_over_writes(self) -> None:
        """Stopping: disk writes not yet planned go to the device in a plan of their own (it flushes them)."""
        with contextlib.suppress(trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            while True:
                message = self.inbox.receive_nowait()
                if isinstance(message, WriteToDisk):
                    self.core.persist(message.writes)
        writes = self.core.take_disk_writes()
        if not writes:
            return
        reply_to, replies = trio.open_memory_channel[StepResult](1)
        replies.close()  # nobody waits for the answer
        with contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            self._to_device.send_nowait(RunStep(plan=StepPlan(disk_writes=writes), reply_to=reply_to))

    async def _run(self, task_status: trio.TaskStatus[None]) -> None:
        task_status.started()
        # Steps sent to the device and not yet reported, oldest first.
        in_flight: collections.deque[tuple[StepPlan, trio.MemoryReceiveChannel[StepResult]]] = (
            collections.deque())
        while True:
            if not self._take_inbox():
                return
            if not in_flight and not self.core.has_work():
                try:
                    message = await self.inbox.receive()
                except trio.EndOfChannel:
                    return
                self._handle(message)
                continue
            if not in_flight and self.core.starting_from_idle():
                await self._gather_arrivals()
            # Cancels that came in meanwhile apply before the plan, not a step later; with the device idle,
            # requests submitted meanwhile are looked up too, so they start in this step rather than the
            # next (20 of a wave of 64 arrived during the first step's lookups and waited out that step).
            for _round in range(MAX_LOOKUP_ROUNDS):
                await self._answer_lookups()
                submitted = self._num_submitted
                if not self._take_inbox():
                    return
                if in_flight or self._num_submitted == submitted:
                    break
            if not in_flight or (len(in_flight) < self._steps_ahead and self.core.can_plan_ahead()):
                in_flight.append(await self._send_step())
                if len(in_flight) < self._steps_ahead and self.core.can_plan_ahead():
                    continue  # plan the next decode step while this one runs
            plan, replies = in_flight[0]
            if len(in_flight) < self._steps_ahead:
                # A step could go ahead: a request arriving meanwhile is looked up (and may be planned) now.
                result = await self._result_or_message(replies)
                if result is None:
                    continue
            else:
                result = await replies.receive()
            in_flight.popleft()
            replies.close()
            self.core.update(plan, result, self._clients, trio.current_time())
            if result.grammar is not None:
                self._send_nowait(self._to_metrics, result.grammar)
            if result.speculation is not None:
                self._send_nowait(self._to_metrics, result.speculation)
            self._fan_out()

    async def _result_or_message(self, replies: trio.MemoryReceiveChannel[StepResult]) -> StepResult | None:
        """The step's result, or None once a message came first (handled; the step still runs)."""
        result: StepResult | None = None
        ended = False

        async def take_result(cancel_scope: trio.CancelScope) -> None:
            nonlocal result, ended
            try:
                result = await replies.receive()
            except trio.EndOfChannel:
                ended = True
            cancel_scope.cancel()

        async def take_message(cancel_scope: trio.CancelScope) -> None:
            try:
                message = await self.inbox.receive()
            except trio.EndOfChannel:
                return  # the loop sees the inbox closed once the step reports
            self._handle(message)
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(take_result, nursery.cancel_scope)
            nursery.start_soon(take_message, nursery.cancel_scope)
        if ended:
            raise trio.EndOfChannel  # as a plain wait on the reply would
        return result

    async def _send_step(self) -> tuple[StepPlan, trio.MemoryReceiveChannel[StepResult]]:
        plan = self.core.schedule()
        reply_to, replies = trio.open_memory_channel[StepResult](1)
        await self._to_device.send(RunStep(plan=plan, release=self.core.take_release(), reply_to=reply_to))
        return plan, replies

    def statistics(self) -> SchedulerStats:
        return self.core.statistics()

    # --- inbox ---------------------------------------------------------------

    def _take_inbox(self) -> bool:
        """Handle every message already queued; False once the inbox is closed."""
        while True:
            try:
                message = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return True
            except trio.EndOfChannel:
                return False
            self._handle(message)

    def _handle(self, message: SchedulerMsg) -> None:
        match message:
            case SubmitRequest():
                self._num_submitted += 1
                self._clients.events[message.request.request_id] = message.events
                self.core.add(message.request, self._clients)
            case CancelRequest():
                self.core.abort(message.request_id, self._clients, trio.current_time())
            case StopRequest():
                self.core.stop(message.request_id, self._clients, trio.current_time())
            case ReleasePayloads():
                self.core.release(message.payloads)
            case WriteToDisk():
                self.core.persist(message.writes)
            case WarmSession():
                self.core.warm(message)
            case GetSchedulerStats():
                with message.reply_to, contextlib.suppress(trio.BrokenResourceError):
                    message.reply_to.send_nowait(self.core.statistics())

    async def _gather_arrivals(self) -> None:
        """Starting from idle: let requests queued right behind the first join its step."""
        with trio.move_on_after(ARRIVAL_WINDOW_SECONDS):
            while self.core.starting_from_idle():
                try:
                    self._handle(await self.inbox.receive())
                except trio.EndOfChannel:
                    return

    # --- the cache store -------------------------------------------------------

    async def _answer_lookups(self) -> None:
        while (lookup := self.core.next_lookup(trio.current_time())) is not None:
            self.core.resolve(lookup, await self._lookup(lookup))

    async def _lookup(self, lookup: Lookup) -> LookupResult:
        """The cache store's answer; a disk hit becomes a read that rides the start's step (no round trip here)."""
        assert self._to_cache_store is not None
        found: PrefixFound | PrefixMissing | PrefixOnDisk | SnapshotFound | SnapshotMissing | SnapshotOnDisk
        if lookup.kind in ("snapshot", "warm"):
            snapshot_to, snapshot_replies = trio.open_memory_channel[
                SnapshotFound | SnapshotMissing | SnapshotOnDisk](1)
            await self._to_cache_store.send(LookupSnapshot(
                context=lookup.context, tokens=lookup.tokens, record=lookup.record, reply_to=snapshot_to))
            found = await _answer(snapshot_replies, SnapshotMissing())
        else:
            prefix_to, prefix_replies = trio.open_memory_channel[PrefixFound | PrefixMissing | PrefixOnDisk](1)
            await self._to_cache_store.send(LookupPrefix(
                context=lookup.context, tokens=lookup.tokens, max_len=len(lookup.tokens) - 1,
                record=lookup.record, reply_to=prefix_to))
            found = await _answer(prefix_replies, PrefixMissing())
        match found:
            case PrefixOnDisk():
                memory = _result(found.memory)
                return OnDisk(memory=memory, read=DiskRead(
                    source=found.plan, num_tokens=found.plan.num_tokens, retain_seconds=found.plan.retain_seconds,
                    memory=memory.payload if isinstance(memory, Hit) else None,
                    memory_tokens=memory.length if isinstance(memory, Hit) else 0))
            case SnapshotOnDisk():
                memory = _result(found.memory)
                return OnDisk(memory=memory, read=DiskRead(
                    source=found.name, num_tokens=found.name.num_tokens, snapshot=True,
                    memory=memory.payload if isinstance(memory, Hit) else None,
                    memory_tokens=memory.length if isinstance(memory, Hit) else 0))
        return _result(found)

    # --- out -------------------------------------------------------------------

    def _fan_out(self) -> None:
        for effect in self.core.take_effects():
            match effect:
                case RequestFinished() | CacheLookedUp():
                    self._send_nowait(self._to_metrics, effect)
                case ReplyFinished():
                    self._send_nowait(self._to_warmer, effect)
                case _:
                    self._send_nowait(self._to_cache_store, effect)

    @staticmethod
    def _send_nowait(channel: trio.MemorySendChannel[Any] | None, message: Any) -> None:
        if channel is None:
            return
        try:
            channel.send_nowait(message)
        except trio.WouldBlock:
            logger.warning("dropped %s: the receiving actor is behind", type(message).__name__)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


async def _answer(replies: trio.MemoryReceiveChannel[_T], missing: _T) -> _T:
    """The cache store's one reply; ``missing`` if it went away (shutdown)."""
    with replies:
        try:
            return await replies.receive()
        except trio.EndOfChannel:
            return missing


def _result(found: PrefixFound | PrefixMissing | SnapshotFound | SnapshotMissing) -> Hit | Miss:
    match found:
        case PrefixFound():
            return Hit(length=found.matched_len, payload=found.payload)
        case SnapshotFound():
            return Hit(length=found.num_tokens, payload=found.payload)
        case SnapshotMissing():
            return Miss(refusal=found.refusal)
    return Miss()
