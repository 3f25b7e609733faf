"""A short, bounded load test: many streaming multi-turn clients against one small server.

24 concurrent streaming clients, each holding a 3-turn conversation (history
resent) over one of 6 shared system prompts, against a server with a small
queue, a small batch and a prompt-cache budget small enough that entries are
evicted. Every request must complete (200, a finish reason, `[DONE]`) or be
refused with 503 and Retry-After; the cache stays within its byte budget at
every sample taken while the load runs; afterwards nothing is running or
waiting, and the engine and server stop cleanly with no task left behind.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio

from mlxcel.config import SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.http import serve
from tests.support import evolve_cache, loopback, make_engine_config

pytestmark = pytest.mark.slow

CLIENTS = 24
SYSTEM_PROMPTS = 6
TURNS = 3
MAX_ATTEMPTS = 8  # per turn: the first try and up to seven retries after a 503
# About 512 bytes of KV per token on the llama fixture: a few conversations' worth.
CAPACITY_BYTES = 1 << 20
TIME_LIMIT = 90


def system_prompt(index: int) -> str:
    return f"Team {index} handbook. " + " ".join(f"Item {index}.{i}: be precise." for i in range(30))


@attrs.define
class Tally:
    attempts: int = 0
    completed: int = 0
    refused: int = 0
    abandoned_turns: int = 0
    cached_tokens: int = 0
    ttfts: list[float] = attrs.Factory(list)
    samples: int = 0
    peak_bytes: int = 0


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], tally: Tally) -> str | None:
    """One streaming request: the reply text, or None after a 503."""
    tally.attempts += 1
    started = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code == 503:
            await response.aread()
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "server_busy"
            tally.refused += 1
            return None
        assert response.status_code == 200, (response.status_code, await response.aread())
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                if not events:
                    tally.ttfts.append(time.monotonic() - started)
                events.append(line[len("data: "):])
    assert events, events
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert finishes in (["length"], ["stop"]), finishes
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] >= 1
    tally.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    tally.completed += 1
    return "".join(c["delta"].get("content", "") for chunk in chunks for c in chunk["choices"])


async def conversation(client: httpx.AsyncClient, index: int, tally: Tally) -> None:
    messages = [{"role": "system", "content": system_prompt(index % SYSTEM_PROMPTS)}]
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"client {index}, turn {turn}: what is item {turn}?"})
        body = {"messages": messages, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "user": f"client-{index}"}
        for attempt in range(MAX_ATTEMPTS):
            reply = await stream_one(client, body, tally)
            if reply is not None:
                messages.append({"role": "assistant", "content": reply})
                break
            await trio.sleep(0.2 * (attempt + 1))
        else:
            # Refused every time: the conversation goes on without this reply.
            tally.abandoned_turns += 1
            messages.append({"role": "assistant", "content": "(no reply)"})


async def sample_cache(client: httpx.AsyncClient, tally: Tally, done: trio.Event) -> None:
    while not done.is_set():
        stats = (await client.get("/v1/cache/stats")).json()
        assert stats["bytes"] <= stats["capacity_bytes"] == CAPACITY_BYTES, stats
        assert stats["entries"] <= stats["max_entries"], stats
        assert stats["total_blocks_stored"] >= stats["unique_block_hashes"], stats
        tally.samples += 1
        tally.peak_bytes = max(tally.peak_bytes, stats["bytes"])
        await trio.sleep(0.05)


def all_tasks() -> list[trio.lowlevel.Task]:
    found, stack = [], [trio.lowlevel.current_root_task()]
    while stack:
        task = stack.pop()
        found.append(task)
        for nursery in task.child_nurseries:
            stack.extend(nursery.child_tasks)
    return found


async def test_streaming_load_completes_or_refuses_and_stays_in_budget() -> None:
    config = make_engine_config(
        prompt_cache=evolve_cache(capacity_bytes=CAPACITY_BYTES),
        scheduler=SchedulerConfig(max_batch_size=4, max_queued_requests=12, prefill_step_size=512),
    )
    tasks_before = len(all_tasks())
    tally = Tally()
    with trio.fail_after(TIME_LIMIT):
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(run_engine, config)
            (base_url,) = await nursery.start(partial(serve, engine, loopback()))
            limits = httpx.Limits(max_connections=CLIENTS + 2)
            async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as client:
                done = trio.Event()
                async with trio.open_nursery() as sampler_nursery:
                    sampler_nursery.start_soon(sample_cache, client, tally, done)
                    async with trio.open_nursery() as clients:
                        for index in range(CLIENTS):
                            clients.start_soon(conversation, client, index, tally)
                    done.set()
                final = (await client.get("/v1/cache/stats")).json()
            scheduler = await engine.scheduler_stats()
            nursery.cancel_scope.cancel()
    # The nursery above exited: the engine's actors and hypercorn stopped on cancellation.
    assert len(all_tasks()) == tasks_before

    summary = {k: v for k, v in attrs.asdict(tally).items() if k != "ttfts"}
    assert tally.completed + tally.refused == tally.attempts, summary
    assert tally.completed + tally.abandoned_turns == CLIENTS * TURNS, summary
    assert tally.completed >= CLIENTS * TURNS // 2, summary
    assert tally.samples >= 5
    assert tally.cached_tokens > 0  # history and shared system prompts were reused
    assert final["bytes"] <= final["capacity_bytes"]
    assert final["evictions"]["capacity"] + final["evictions"]["lru"] > 0, final  # the budget bit
    assert scheduler.num_running == 0
    assert scheduler.num_waiting == 0
    assert scheduler.num_completed == tally.completed
    assert scheduler.num_failed == 0
    assert scheduler.num_cancelled == 0
    assert final["scheduler"] == {"num_waiting": 0, "num_running": 0}
