"""In-flight prefix sharing: clients that arrive together prefill their common prefix once."""

from __future__ import annotations

import pytest
import trio

from mlxcel import CacheOptions, ChatRequest, SamplingParams

pytestmark = pytest.mark.slow

SYSTEM = "Shared instructions for every user. " + " ".join(f"clause{i}" for i in range(150))


def request(user: str, text: str) -> ChatRequest:
    return ChatRequest(
        messages=({"role": "system", "content": SYSTEM}, {"role": "user", "content": text}),
        sampling=SamplingParams(temperature=0.0, max_tokens=4),
        cache=CacheOptions(session_key=user),
    )


async def test_simultaneous_requests_share_one_prefill_of_the_common_prefix(start_engine) -> None:
    engine = await start_engine()
    usages = {}

    async def one(index: int) -> None:
        completion = await engine.chat(request(f"user{index}", f"question number {index} about topic {index * 3}"))
        usages[index] = completion.usage

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for index in range(6):
                nursery.start_soon(one, index)
    stats = await engine.scheduler_stats()
    # One leader prefilled the shared system prompt; the other five waited for it and adopted it.
    assert stats.num_shared_prefills == 5, stats
    cold = [u for u in usages.values() if u.cached_tokens == 0]
    assert len(cold) == 1
    for usage in usages.values():
        if usage.cached_tokens:
            assert usage.cached_tokens >= 150


async def test_shared_prefix_reply_equals_a_cold_run(start_engine) -> None:
    engine = await start_engine()
    replies = {}

    async def one(index: int) -> None:
        replies[index] = await engine.chat(request(f"user{index}", f"tell me about {index}"))

    async with trio.open_nursery() as nursery:
        for index in range(3):
            nursery.start_soon(one, index)
    for index in range(3):
        cold_request = request(f"user{index}", f"tell me about {index}")
        cold = await engine.chat(ChatRequest(
            messages=cold_request.messages, sampling=cold_request.sampling,
            cache=CacheOptions(cache_prompt=False),
        ))
        assert cold.text == replies[index].text
