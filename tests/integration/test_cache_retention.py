"""Retention end to end: pinned prompts outlive LRU pressure, and a cancelled retaining request is stored.

Real HTTP on the llama fixture, with a KV budget of a few conversations:
``prompt_cache_retention: "24h"`` on chat completions and a `cache_control`
ttl of 1h on /v1/messages keep their conversations while an unpinned one,
older than the traffic after it, is evicted.
"""

from __future__ import annotations

import httpx
import pytest

from tests.support import evolve_cache, wait_until

pytestmark = pytest.mark.slow

MODEL = "llama-v1-seed0"
# A conversation of this system prompt is ~160 tokens: ~80 KiB of float32 KV on the fixture.
WORDS = " ".join(f"rule{i} holds" for i in range(50))


def system(name: str) -> str:
    # Each conversation parts from every other within its first few tokens: no shared prefix.
    return f"{name} {name} {name}. You are the {name} assistant. {WORDS}"


def chat_body(name: str, question: str, **fields) -> dict:
    messages = [{"role": "system", "content": system(name)}, {"role": "user", "content": question}]
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


def messages_body(name: str, question: str) -> dict:
    block = {"type": "text", "text": system(name), "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    return {"model": MODEL, "max_tokens": 4, "temperature": 0, "system": [block],
            "messages": [{"role": "user", "content": question}]}


async def cached_chat(http: httpx.AsyncClient, body: dict) -> tuple[int, int]:
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


async def cached_messages(http: httpx.AsyncClient, body: dict) -> tuple[int, int]:
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    read = usage["cache_read_input_tokens"]
    return read, read + usage["input_tokens"] + usage["cache_creation_input_tokens"]


# Two conversations' entries (~112 KiB each) fit the pinned half; the other half holds ~3 more.
CAPACITY = 600_000


async def test_pinned_conversations_outlive_lru_pressure_an_unpinned_one_does_not(
    start_engine, start_server
) -> None:
    engine = await start_engine(prompt_cache=evolve_cache(capacity_bytes=CAPACITY))
    base_url = await start_server(engine, metrics=True)
    kept_chat = chat_body("alpha", "first question", prompt_cache_retention="24h")
    kept_messages = messages_body("beta", "first question")
    control = chat_body("gamma", "first question")
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        # The two retained conversations come first: under plain LRU they would be the first to go.
        assert (await cached_chat(http, kept_chat))[0] == 0
        assert (await cached_messages(http, kept_messages))[0] == 0
        assert (await cached_chat(http, control))[0] == 0
        for index in range(5):
            assert (await cached_chat(http, chat_body(f"other{index}", "first question")))[0] == 0
        stats = (await http.get("/v1/cache/stats")).json()
        assert stats["evictions"]["lru"] >= 3
        assert stats["bytes"] <= CAPACITY
        assert stats["pinned_entries"] == 2
        assert 0 < stats["pinned_bytes"] <= stats["pinned_capacity_bytes"] == CAPACITY // 2
        metrics = (await http.get("/metrics")).text
        assert "mlxcel_prompt_cache_pinned_entries 2.0" in metrics
        assert f"mlxcel_prompt_cache_pinned_bytes {float(stats['pinned_bytes'])}" in metrics
        assert "mlxcel_prompt_cache_pins_dropped_total 0.0" in metrics

        cached, prompt = await cached_chat(http, kept_chat)
        assert cached == prompt - 1  # all but the last token, which must run for logits
        read, prompt = await cached_messages(http, kept_messages)
        assert read == prompt - 1
        assert (await cached_chat(http, control))[0] == 0  # evicted
        reset = (await http.post("/v1/cache/reset")).json()
        assert reset["entries_freed"] >= 3
        after = (await http.get("/v1/cache/stats")).json()
        assert (after["pinned_entries"], after["pinned_bytes"]) == (0, 0)


async def first_token_then_leave(http: httpx.AsyncClient, body: dict) -> None:
    """Stream the reply and disconnect as soon as its first content token arrives."""
    async with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("data: ") and '"content":"' in line.replace(" ", ""):
                return
    raise AssertionError("the stream ended before its first token")


async def idle(engine) -> bool:
    return (await engine.scheduler_stats()).num_running == 0


async def test_a_cancelled_retaining_request_still_stores_its_prompt(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine)
    kept = chat_body("delta", "talk for a long time", max_tokens=3000, prompt_cache_retention="24h")
    plain = chat_body("epsilon", "talk for a long time", max_tokens=3000)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        for body in (kept, plain):
            await first_token_then_leave(http, body)
            await wait_until(lambda: idle(engine))
        stats = await engine.scheduler_stats()
        assert (stats.num_cancelled, stats.num_completed) == (2, 0)
        cached, prompt = await cached_chat(http, {**kept, "max_tokens": 4})
        assert cached == prompt - 1
        # Without retention, a one-chunk prompt cancelled while decoding leaves nothing behind.
        assert (await cached_chat(http, {**plain, "max_tokens": 4}))[0] == 0
