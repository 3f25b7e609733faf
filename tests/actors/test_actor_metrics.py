"""The metrics actor alone: events in, Prometheus text out."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from mlxcel.actors.messages import CacheLookedUp, RenderMetrics, RequestFinished
from mlxcel.actors.metrics import MetricsActor
from mlxcel.cache.store import StoreStats


async def start_metrics(nursery: trio.Nursery) -> tuple[MetricsActor, trio.MemorySendChannel[Any]]:
    send, inbox = trio.open_memory_channel[Any](64)
    actor = MetricsActor(inbox=inbox)
    await nursery.start(actor.run)
    return actor, send


async def render(to_metrics: trio.MemorySendChannel[Any], store: StoreStats | None = None) -> str:
    reply_to, replies = trio.open_memory_channel[bytes](1)
    await to_metrics.send(RenderMetrics(store=store, reply_to=reply_to))
    with trio.fail_after(2), replies:
        return (await replies.receive()).decode()


def store_stats(*, nbytes: int, entries: int, evictions: dict[str, int]) -> StoreStats:
    return StoreStats(
        entries=entries, bytes=nbytes, capacity_bytes=1 << 20, max_entries=0, hits=0, misses=0, tokens_reused=0,
        evictions=evictions, inserts=0, refusals=0, duplicates=0, aliases=0, apc_enabled=False, apc_block_cap=0,
        total_blocks_stored=0, unique_block_hashes=0, apc_active_entries=0,
    )


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for metric in family.samples:
            if metric.name == name and metric.labels == labels:
                return metric.value
    raise AssertionError(f"no sample {name}{labels} in\n{text}")


async def test_lookups_count_hits_misses_and_reused_tokens(nursery: trio.Nursery) -> None:
    _, to_metrics = await start_metrics(nursery)
    for event in (
        CacheLookedUp(hit=True, tokens_reused=100),
        CacheLookedUp(hit=False),
        CacheLookedUp(hit=True, tokens_reused=28),
    ):
        await to_metrics.send(event)
    text = await render(to_metrics)
    assert "mlxcel_prompt_cache_hits_total 2.0" in text
    assert "mlxcel_prompt_cache_misses_total 1.0" in text
    assert sample(text, "mlxcel_prompt_cache_prefix_tokens_reused_total") == 128


async def test_store_stats_set_gauges_and_grow_eviction_counters(nursery: trio.Nursery) -> None:
    _, to_metrics = await start_metrics(nursery)
    text = await render(to_metrics)
    # Every reason is exported from the start, at zero.
    for reason in ("lru", "ttl", "capacity"):
        assert sample(text, "mlxcel_prompt_cache_evictions_total", reason=reason) == 0

    first = store_stats(nbytes=4096, entries=3, evictions={"lru": 2, "ttl": 0, "superseded": 5})
    text = await render(to_metrics, first)
    assert sample(text, "mlxcel_prompt_cache_bytes") == 4096
    assert sample(text, "mlxcel_prompt_cache_evictions_total", reason="lru") == 2
    second = store_stats(nbytes=1024, entries=1, evictions={"lru": 3, "ttl": 4, "superseded": 6})
    await render(to_metrics, second)
    # The same cumulative totals again add nothing.
    text = await render(to_metrics, second)
    assert sample(text, "mlxcel_prompt_cache_bytes") == 1024
    assert sample(text, "mlxcel_prompt_cache_entries") == 1
    assert sample(text, "mlxcel_prompt_cache_evictions_total", reason="lru") == 3
    assert sample(text, "mlxcel_prompt_cache_evictions_total", reason="ttl") == 4
    assert sample(text, "mlxcel_prompt_cache_evictions_total", reason="capacity") == 0
    # Superseded entries became aliases; they are not evictions.
    assert 'reason="superseded"' not in text
    # Without the store's statistics (the cache is off) the gauges keep their values.
    assert sample(await render(to_metrics), "mlxcel_prompt_cache_bytes") == 1024


async def test_pinned_gauges_and_the_pins_dropped_counter(nursery: trio.Nursery) -> None:
    _, to_metrics = await start_metrics(nursery)
    text = await render(to_metrics)
    assert sample(text, "mlxcel_prompt_cache_pins_dropped_total") == 0
    plain = store_stats(nbytes=4096, entries=3, evictions={})
    await render(to_metrics, attrs.evolve(plain, pinned_entries=2, pinned_bytes=2048, pins_dropped=3))
    text = await render(to_metrics, attrs.evolve(plain, pinned_entries=1, pinned_bytes=1024, pins_dropped=3))
    assert sample(text, "mlxcel_prompt_cache_pinned_entries") == 1
    assert sample(text, "mlxcel_prompt_cache_pinned_bytes") == 1024
    assert sample(text, "mlxcel_prompt_cache_pins_dropped_total") == 3


async def test_finished_requests_and_time_to_first_token(nursery: trio.Nursery) -> None:
    _, to_metrics = await start_metrics(nursery)
    await to_metrics.send(RequestFinished(
        finish_reason="stop", prompt_tokens=10, cached_tokens=4, completion_tokens=3, seconds_to_first_token=0.25,
    ))
    await to_metrics.send(RequestFinished(
        finish_reason="length", prompt_tokens=10, cached_tokens=0, completion_tokens=0, seconds_to_first_token=None,
    ))
    await to_metrics.send(RequestFinished(
        finish_reason="stop", prompt_tokens=10, cached_tokens=0, completion_tokens=3, seconds_to_first_token=0.5,
    ))
    text = await render(to_metrics)
    assert sample(text, "mlxcel_requests_total", finish_reason="stop") == 2
    assert sample(text, "mlxcel_requests_total", finish_reason="length") == 1
    assert sample(text, "mlxcel_time_to_first_token_seconds_count") == 2
    assert sample(text, "mlxcel_time_to_first_token_seconds_sum") == pytest.approx(0.75)


async def test_two_actors_do_not_share_a_registry(nursery: trio.Nursery) -> None:
    first, to_first = await start_metrics(nursery)
    second, to_second = await start_metrics(nursery)
    assert first.registry is not second.registry
    await to_first.send(CacheLookedUp(hit=True, tokens_reused=1))
    assert "mlxcel_prompt_cache_hits_total 1.0" in await render(to_first)
    assert "mlxcel_prompt_cache_hits_total 0.0" in await render(to_second)


async def test_render_for_an_asker_that_went_away(nursery: trio.Nursery) -> None:
    _, to_metrics = await start_metrics(nursery)
    reply_to, replies = trio.open_memory_channel[bytes](1)
    replies.close()
    await to_metrics.send(RenderMetrics(reply_to=reply_to))
    assert "mlxcel_prompt_cache_hits_total" in await render(to_metrics)
