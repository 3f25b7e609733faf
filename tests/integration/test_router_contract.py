"""vLLM's router contract against a real engine: KV events on a real ZMQ socket, vllm: metrics, render."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable

import httpx
import msgpack
import pytest
import trio
import zmq

from mlxcel.bench.kv_consumer import KvEventLog, KvEventSubscriber, block_keys, decode_event
from mlxcel.config import KvEventsConfig
from tests.support import evolve_cache, wait_until

pytestmark = pytest.mark.slow

BLOCK = 16
SYSTEMS = [f"You are assistant {name}. " + " ".join(f"{name}{i} holds" for i in range(50)) for name in "abc"]


def chat(system: str, user: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


@pytest.fixture
def serve_with_events(start_engine, start_server, tmp_path):
    async def start(form: str = "positional", **changes):
        events = KvEventsConfig(endpoint=f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay",
                                topic="kv@test", format=form)
        engine = await start_engine("llama", kv_events=events, **changes)
        base_url = await start_server(engine, metrics=True)
        subscriber = KvEventSubscriber(events.endpoint, block_size=BLOCK, topic="kv@test",
                                       replay_endpoint=events.replay_endpoint)
        return engine, base_url, subscriber

    return start


async def post(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    response = await client.post(url, json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def settle(subscriber: KvEventSubscriber, num_batches: int) -> None:
    await wait_until(lambda: len(subscriber.log.seqs) >= num_batches, seconds=10)


async def subscribed(client: httpx.AsyncClient, num_received: Callable[[], int]) -> None:
    """Reset the cache until its batch reaches the subscriber: then the subscription is through.

    ZeroMQ drops what a PUB socket sends before a SUB's subscription has reached
    it, and says nothing when that happens; a batch that arrives is the handshake.
    """
    with trio.fail_after(10):
        while True:
            before = num_received()
            await post(client, "/v1/cache/reset", {})
            with trio.move_on_after(0.5):
                await wait_until(lambda before=before: num_received() > before)
                return


@pytest.mark.parametrize("form", ["positional", "map"])
async def test_events_announce_stores_evictions_and_resets(serve_with_events, form) -> None:
    # About two 250-token entries fit (512 bytes a token): the third conversation evicts the first.
    engine, base_url, subscriber = await serve_with_events(form, prompt_cache=evolve_cache(capacity_bytes=300_000))
    prompts = [chat(system, "first question") for system in SYSTEMS]
    with subscriber:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            # The subscriber joined after start-up: batch 0 (AllBlocksCleared) it only gets by replay.
            await subscribed(client, lambda: len(subscriber.log.seqs))
            rendered = [(await post(client, "/v1/chat/completions/render", {"messages": p}))["token_ids"]
                        for p in prompts]
            for number, messages in enumerate(prompts, 1):
                before = len(subscriber.log.seqs)
                reply = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                                    "temperature": 0})
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                await settle(subscriber, before + 1)
                stored = [event for event in subscriber.log.events if event["type"] == "BlockStored"]
                assert len(stored) == number
                # The whole donated sequence (prompt and reply) in prefix order, from the root.
                assert stored[-1]["parent_block_hash"] is None
                prompt_blocks = len(rendered[number - 1]) // BLOCK * BLOCK
                assert stored[-1]["token_ids"][:prompt_blocks] == rendered[number - 1][:prompt_blocks]
                assert stored[-1]["medium"] == "GPU"
                assert stored[-1]["lora_id"] is None
            removed = [event for event in subscriber.log.events if event["type"] == "BlockRemoved"]
            assert removed, "the third entry should have evicted the first"
            # The first conversation's blocks went, all of them (it shares no block with the others).
            first_ids = set(stored[0]["block_hashes"])
            assert first_ids <= {block for event in removed for block in event["block_hashes"]}
            stats = (await client.get("/v1/cache/stats")).json()
            assert stats["evictions"]["lru"] >= 1
            assert len(subscriber.log.held) == stats["unique_block_hashes"]

            # A hit is on blocks announced before it (the follow-up of the third conversation).
            follow_up = prompts[2] + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
            tokens = (await post(client, "/v1/chat/completions/render", {"messages": follow_up}))["token_ids"]
            hit = await post(client, "/v1/chat/completions", {"messages": follow_up, "max_tokens": 2,
                                                              "temperature": 0})
            cached = hit["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= BLOCK * 10
            assert subscriber.log.announced_before(tokens, cached, time.time())

            await post(client, "/v1/cache/reset", {})
            # The hit's donation is stored before the reset, but its batch may reach the subscriber just
            # after the count was taken: wait for the clear to be the last event, not for one more batch.
            await wait_until(lambda: bool(subscriber.log.events)
                             and subscriber.log.events[-1]["type"] == "AllBlocksCleared", seconds=10)
            assert subscriber.log.held == {}

        assert subscriber.log.problems == []
        live_seqs = list(subscriber.log.seqs)
        # Replay from 0 gives every batch, the start-up AllBlocksCleared first, with no gaps.
        replayed = await trio.to_thread.run_sync(subscriber.replay, 0)
    assert [seq for seq, _ in replayed] == list(range(len(replayed)))
    assert [seq for seq, _ in replayed][-len(live_seqs):] == live_seqs
    first_batch = msgpack.unpackb(replayed[0][1])
    assert [decode_event(event)["type"] for event in first_batch[1]] == ["AllBlocksCleared"]
    assert first_batch[2] == 0  # data_parallel_rank
    # The raw encoding is the one asked for.
    raw_event = msgpack.unpackb(replayed[1][1])[1][0]
    assert isinstance(raw_event, dict if form == "map" else list)
    # Replayed batches rebuild the same state as the live stream.
    rebuilt = KvEventLog(block_size=BLOCK)
    for seq, payload in replayed:
        rebuilt.feed(seq, payload)
    assert rebuilt.problems == []
    assert rebuilt.held == {}
    assert rebuilt.counts["blocks_stored"] == subscriber.log.counts["blocks_stored"]


async def test_events_are_framed_as_vllm_sends_them(serve_with_events) -> None:
    """A bare SUB socket: [topic, 8-byte big-endian seq, msgpack [ts, events, rank]]."""
    engine, base_url, subscriber = await serve_with_events()
    subscriber.close()
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv@test")
    socket.setsockopt(zmq.RCVTIMEO, 20_000)
    socket.connect(engine.config.kv_events.endpoint)
    received: list[list[bytes]] = []

    def num_received() -> int:
        with contextlib.suppress(zmq.Again):
            while True:
                received.append(socket.recv_multipart(zmq.NOBLOCK))
        return len(received)

    try:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            await subscribed(client, num_received)
            await post(client, "/v1/chat/completions", {"messages": chat(SYSTEMS[0], "q"), "max_tokens": 2})
        frames = await trio.to_thread.run_sync(socket.recv_multipart)
    finally:
        socket.close(linger=0)
        context.term()
    topic, seq, payload = frames
    assert topic == b"kv@test"
    assert len(seq) == 8
    # The sequence number counts on from the handshake's reset batch.
    assert int.from_bytes(seq, "big") == int.from_bytes(received[-1][1], "big") + 1
    ts, events, rank = msgpack.unpackb(payload)
    assert isinstance(ts, float)
    assert rank == 0
    kind, hashes, parent, token_ids, block_size, lora_id, medium, lora_name = events[0]
    assert (kind, parent, block_size, lora_id, medium, lora_name) == ("BlockStored", None, BLOCK, None, "GPU", None)
    assert all(isinstance(block, int) and 0 <= block < 1 << 64 for block in hashes)
    assert len(token_ids) == len(hashes) * BLOCK
    assert block_keys(token_ids, BLOCK)  # the consumer can key them


def series(text: str, name: str) -> dict[str, float]:
    """Every sample of one series: labels text -> value."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


async def test_vllm_metrics_and_render_agree_with_a_real_request(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine, metrics=True)
    messages = chat(SYSTEMS[1], "what now")
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        render = await post(client, "/v1/chat/completions/render", {"messages": messages, "max_tokens": 3})
        first = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                             "temperature": 0})
        second = await post(client, "/v1/chat/completions", {"messages": messages, "max_tokens": 3,
                                                              "temperature": 0})
        completion_render = await post(client, "/v1/completions/render", {"prompt": "hello there", "max_tokens": 2})
        tokenized = await post(client, "/tokenize", {"content": "hello there"})
        text = (await client.get("/metrics")).text

    # Render: vLLM's GenerateRequest shape, the ids the real request prefilled.
    assert len(render["token_ids"]) == first["usage"]["prompt_tokens"]
    assert render["sampling_params"]["max_tokens"] == 3
    assert render["model"] == engine.model_id
    assert isinstance(completion_render, list)
    assert completion_render[0]["token_ids"] == tokenized["tokens"]

    labels = f'{{engine="0",model_name="{engine.model_id}"}}'
    prompt_tokens = first["usage"]["prompt_tokens"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    assert series(text, "vllm:prefix_cache_queries_total") == {labels: 2 * prompt_tokens}
    assert series(text, "vllm:prefix_cache_hits_total") == {labels: cached}
    assert series(text, "vllm:gpu_prefix_cache_hit_rate")[labels] == pytest.approx(cached / (2 * prompt_tokens))
    assert series(text, "vllm:num_requests_running") == {labels: 0.0}
    assert series(text, "vllm:num_requests_waiting") == {labels: 0.0}
    usage = series(text, "vllm:kv_cache_usage_perc")[labels]
    assert 0 < usage < 0.01  # one ~130 KB entry in a 512 MiB budget
    assert series(text, "vllm:gpu_cache_usage_perc")[labels] == usage
    (info_labels, value), = series(text, "vllm:cache_config_info").items()
    assert value == 1
    assert 'block_size="16"' in info_labels
    assert 'num_gpu_blocks="262144"' in info_labels
    # mlxcel's own series are still there.
    assert series(text, "mlxcel_prompt_cache_hits_total") == {"": 1.0}
