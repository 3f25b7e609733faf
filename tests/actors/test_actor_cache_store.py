"""The cache-store actor alone, over a real PromptCacheStore holding string payloads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from mlxcel.actors.cache_store import CacheStoreActor
from mlxcel.actors.messages import (
    CacheLookedUp,
    CacheStoreStats,
    DonateSequence,
    GetCacheStats,
    LookupPrefix,
    PrefixFound,
    PrefixMissing,
    ResetCache,
)
from mlxcel.cache.key import CacheContext
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

CONTEXT = CacheContext(model_id="fake-model", template_sig="sig", session_key="alice")
PROMPT = tuple(range(100, 140))  # 40 tokens


@attrs.define
class StoreHarness:
    actor: CacheStoreActor
    inbox: trio.MemorySendChannel[Any]
    metrics: trio.MemoryReceiveChannel[Any]

    async def ask(self, message_type: Any, **fields: Any) -> Any:
        reply_to, replies = trio.open_memory_channel[Any](1)
        await self.inbox.send(message_type(reply_to=reply_to, **fields))
        with trio.fail_after(2), replies:
            return await replies.receive()

    async def lookup(self, tokens: tuple[int, ...], context: CacheContext = CONTEXT) -> PrefixFound | PrefixMissing:
        return await self.ask(LookupPrefix, context=context, tokens=tokens, max_len=len(tokens) - 1)

    async def donate(self, tokens: tuple[int, ...], payload: str, nbytes: int, context: CacheContext = CONTEXT) -> None:
        await self.inbox.send(DonateSequence(context=context, tokens=tokens, payload=payload, nbytes=nbytes))
        await trio.testing.wait_all_tasks_blocked()

    def metric_events(self) -> list[Any]:
        events = []
        while True:
            try:
                events.append(self.metrics.receive_nowait())
            except trio.WouldBlock:
                return events


StartStore = Callable[..., Any]


@pytest.fixture
def start_store(nursery: trio.Nursery) -> StartStore:
    async def start(*, enabled: bool = True, **limits: Any) -> StoreHarness:
        store = None
        if enabled:
            store = PromptCacheStore(
                StoreLimits(**{"capacity_bytes": 10_000, "min_prefix": 8, **limits}),
                ApcSettings(block_size=8),
            )
        inbox_send, inbox = trio.open_memory_channel[Any](16)
        to_metrics, metrics = trio.open_memory_channel[Any](64)
        actor = CacheStoreActor(store=store, inbox=inbox, to_metrics=to_metrics)
        await nursery.start(actor.run)
        return StoreHarness(actor=actor, inbox=inbox_send, metrics=metrics)

    return start


async def test_lookup_in_an_empty_store_misses(start_store: StartStore) -> None:
    harness = await start_store()
    assert await harness.lookup(PROMPT) == PrefixMissing()
    assert CacheLookedUp(hit=False, tokens_reused=0, tokens_queried=len(PROMPT)) in harness.metric_events()


async def test_donation_is_found_by_a_longer_prompt(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    # The store's size is pulled with statistics(), never pushed to metrics.
    assert harness.metric_events() == []
    store = harness.actor.statistics().store
    assert store is not None
    assert (store.bytes, store.entries) == (400, 1)
    assert store.evictions == {"lru": 0, "ttl": 0, "capacity": 0, "superseded": 0}

    found = await harness.lookup(PROMPT + (7, 8, 9))
    assert isinstance(found, PrefixFound)
    assert found.matched_len == len(PROMPT)
    assert found.payload == "kv-1"
    assert (found.cross_session, found.partial) == (False, False)
    assert CacheLookedUp(hit=True, tokens_reused=len(PROMPT), tokens_queried=len(PROMPT) + 3) in harness.metric_events()


async def test_lookup_respects_max_len(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    # The same prompt again: one token must stay to be prefilled.
    found = await harness.lookup(PROMPT)
    assert isinstance(found, PrefixFound)
    assert found.matched_len == len(PROMPT) - 1


async def test_other_session_match_is_cross_session(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    found = await harness.lookup(PROMPT + (1,), attrs.evolve(CONTEXT, session_key="bob"))
    assert isinstance(found, PrefixFound)
    assert found.cross_session is True


async def test_other_template_never_matches(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    assert await harness.lookup(PROMPT + (1,), attrs.evolve(CONTEXT, template_sig="other")) == PrefixMissing()


async def test_stats_count_hits_misses_and_bytes(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    await harness.lookup(PROMPT + (1,))
    await harness.lookup(tuple(range(500, 540)))
    stats = await harness.ask(GetCacheStats)
    assert isinstance(stats, CacheStoreStats)
    assert stats.enabled
    assert stats.snapshots is None
    body = stats.to_json()
    assert body["enabled"] is True
    assert body["entries"] == 1
    assert body["bytes"] == 400
    assert body["capacity_bytes"] == 10_000
    assert (body["hits"], body["misses"]) == (1, 1)
    assert body["tokens_reused"] == len(PROMPT)
    assert body["apc_enabled"] is True
    assert "snapshots" not in body
    assert harness.actor.statistics() == stats


async def test_reset_frees_everything(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate(PROMPT, "kv-1", 400)
    await harness.donate(tuple(range(300, 340)), "kv-2", 250)
    assert await harness.ask(ResetCache) == {"entries_freed": 2, "bytes_freed": 650}
    stats = (await harness.ask(GetCacheStats)).store
    assert (stats.entries, stats.bytes) == (0, 0)
    assert await harness.lookup(PROMPT + (1,)) == PrefixMissing()


async def test_capacity_eviction_is_reported_cumulatively(start_store: StartStore) -> None:
    harness = await start_store(capacity_bytes=1000)
    await harness.donate(PROMPT, "kv-1", 400)
    await harness.donate(tuple(range(300, 340)), "kv-2", 400)
    await harness.donate(tuple(range(600, 640)), "kv-3", 400)  # pushes out kv-1
    stats = harness.actor.statistics().store
    assert stats is not None
    assert (stats.bytes, stats.entries) == (800, 2)
    assert stats.evictions["lru"] == 1
    assert await harness.lookup(PROMPT + (1,)) == PrefixMissing()


async def test_entries_expire_after_their_ttl(start_store: StartStore, mock_clock: trio.testing.MockClock) -> None:
    harness = await start_store(ttl_seconds=10.0)
    await harness.donate(PROMPT, "kv-1", 400)
    mock_clock.jump(11)
    assert await harness.lookup(PROMPT + (1,)) == PrefixMissing()
    stats = harness.actor.statistics().store
    assert stats is not None
    assert stats.entries == 0
    assert stats.evictions["ttl"] == 1


async def test_a_retained_donation_is_pinned_by_the_actors_clock(
    start_store: StartStore, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    harness = await start_store(ttl_seconds=10.0, capacity_bytes=1000)
    await harness.inbox.send(DonateSequence(context=CONTEXT, tokens=PROMPT, payload="kv-kept", nbytes=400,
                                            retain_seconds=300))
    await harness.donate(tuple(range(300, 340)), "kv-plain", 400)
    stats = (await harness.ask(GetCacheStats)).store
    assert (stats.pinned_entries, stats.pinned_bytes, stats.pinned_capacity_bytes) == (1, 400, 500)
    body = (await harness.ask(GetCacheStats)).to_json()
    assert (body["pinned_entries"], body["pinned_bytes"], body["pins_dropped"]) == (1, 400, 0)
    mock_clock.jump(11)  # past the TTL, within the pin
    assert isinstance(await harness.lookup(PROMPT + (1,)), PrefixFound)
    assert await harness.lookup(tuple(range(300, 341))) == PrefixMissing()
    mock_clock.jump(300)  # the pin has ended, and the entry idled past the TTL
    assert await harness.lookup(PROMPT + (1,)) == PrefixMissing()
    # Larger than the pinned share (500 bytes): stored, unpinned, and said so.
    await harness.inbox.send(DonateSequence(context=CONTEXT, tokens=PROMPT, payload="kv-big", nbytes=600,
                                            retain_seconds=3600))
    await trio.testing.wait_all_tasks_blocked()
    stats = (await harness.ask(GetCacheStats)).store
    assert (stats.entries, stats.pinned_entries, stats.pins_dropped) == (1, 0, 1)
    assert "larger than the pinned share" in caplog.text


async def test_short_donation_is_not_stored(start_store: StartStore) -> None:
    harness = await start_store()
    await harness.donate((1, 2, 3), "kv-short", 10)  # under min_prefix
    assert (await harness.ask(GetCacheStats)).store.entries == 0


async def test_disabled_store_always_misses(start_store: StartStore) -> None:
    harness = await start_store(enabled=False)
    await harness.donate(PROMPT, "kv-1", 400)
    assert await harness.lookup(PROMPT + (1,)) == PrefixMissing()
    assert harness.metric_events() == [CacheLookedUp(hit=False, tokens_reused=0, tokens_queried=len(PROMPT) + 1)]
    stats = await harness.ask(GetCacheStats)
    assert stats == CacheStoreStats(store=None)
    assert stats.to_json() == {"enabled": False, "entries": 0, "bytes": 0, "apc_enabled": False}
    assert await harness.ask(ResetCache) == {"entries_freed": 0, "bytes_freed": 0}


async def test_asker_that_went_away_does_not_break_the_actor(start_store: StartStore) -> None:
    harness = await start_store()
    reply_to, replies = trio.open_memory_channel[Any](1)
    other_reply_to = reply_to.clone()
    replies.close()
    await harness.inbox.send(GetCacheStats(reply_to=reply_to))
    await harness.inbox.send(LookupPrefix(context=CONTEXT, tokens=PROMPT, max_len=39, reply_to=other_reply_to))
    await trio.testing.wait_all_tasks_blocked()
    assert (await harness.ask(GetCacheStats)).store.misses == 1


async def test_without_a_metrics_channel(nursery: trio.Nursery) -> None:
    inbox_send, inbox = trio.open_memory_channel[Any](4)
    store = PromptCacheStore(StoreLimits(capacity_bytes=10_000, min_prefix=8))
    await nursery.start(CacheStoreActor(store=store, inbox=inbox).run)
    await inbox_send.send(DonateSequence(context=CONTEXT, tokens=PROMPT, payload="kv", nbytes=1))
    reply_to, replies = trio.open_memory_channel[Any](1)
    await inbox_send.send(LookupPrefix(context=CONTEXT, tokens=PROMPT + (1,), max_len=40, reply_to=reply_to))
    with trio.fail_after(2):
        assert (await replies.receive()).payload == "kv"


async def test_let_go_payloads_are_sent_to_the_scheduler_for_release() -> None:
    from mlxcel.actors.cache_store import CacheStoreActor
    from mlxcel.actors.messages import DonateSequence, ReleasePayloads, ResetCache
    from mlxcel.cache.key import CacheContext
    from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

    store = PromptCacheStore(StoreLimits(capacity_bytes=1000, min_prefix=4), ApcSettings())
    send, inbox = trio.open_memory_channel(8)
    to_scheduler, released = trio.open_memory_channel(8)
    actor = CacheStoreActor(store=store, inbox=inbox, to_scheduler=to_scheduler)
    context = CacheContext(model_id="m", template_sig="t")
    reply_to, replies = trio.open_memory_channel(1)
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        await send.send(DonateSequence(context=context, tokens=tuple(range(8)), payload="a", nbytes=600))
        # Evicts "a" (budget 1000), and a too-short donation is never stored.
        await send.send(DonateSequence(context=context, tokens=tuple(range(100, 108)), payload="b", nbytes=600))
        await send.send(DonateSequence(context=context, tokens=(1, 2), payload="short", nbytes=1))
        await send.send(ResetCache(reply_to=reply_to))
        await replies.receive()
        send.close()
    payloads: list[str] = []
    while True:
        try:
            message = released.receive_nowait()
        except trio.WouldBlock:
            break
        assert isinstance(message, ReleasePayloads)
        payloads.extend(message.payloads)
    assert payloads == ["a", "short", "b"]


async def test_block_changes_go_to_the_publisher_in_order(nursery: trio.Nursery) -> None:
    from mlxcel.actors.messages import PublishBlockChanges
    from mlxcel.cache.kv_events import BlocksCleared, BlocksRemoved, BlocksStored

    store = PromptCacheStore(StoreLimits(capacity_bytes=500, min_prefix=8), ApcSettings(block_size=8),
                             log_blocks=True)
    inbox_send, inbox = trio.open_memory_channel[Any](16)
    to_events, events = trio.open_memory_channel[Any](16)
    await nursery.start(CacheStoreActor(store=store, inbox=inbox, to_kv_events=to_events).run)
    harness = StoreHarness(actor=None, inbox=inbox_send, metrics=trio.open_memory_channel[Any](1)[1])  # type: ignore[arg-type]
    await harness.donate(PROMPT, "kv-1", 400)
    (stored,) = events.receive_nowait().changes
    assert isinstance(stored, BlocksStored)
    assert len(stored.hashes) == len(PROMPT) // 8
    # A lookup changes no block: nothing is published.
    await harness.lookup(PROMPT)
    with pytest.raises(trio.WouldBlock):
        events.receive_nowait()
    await harness.donate(tuple(range(500, 540)), "kv-2", 400)  # over 500 bytes: kv-1 goes
    message = events.receive_nowait()
    assert isinstance(message, PublishBlockChanges)
    assert [type(change) for change in message.changes] == [BlocksStored, BlocksRemoved]
    assert message.changes[1].hashes == stored.hashes
    await harness.ask(ResetCache)
    assert events.receive_nowait().changes == (BlocksCleared(),)
