"""Shared KV storage end to end: conversations that share a system prompt store it once.

The budget below holds about three conversations' entries unshared; with the
system prompt's piece shared it holds all eight, so every later turn resumes
from the whole previous prompt instead of only the system prompt.
"""

from __future__ import annotations

import pytest
import trio

from mlxcel.types import CacheOptions, ChatRequest, SamplingParams
from tests.support import evolve_cache

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(120))
CONVERSATIONS = 8


class Reply:
    def __init__(self, completion) -> None:
        self.content = completion.text
        self.prompt_tokens = completion.usage.prompt_tokens
        self.cached_tokens = completion.usage.cached_tokens
        self.logprobs = completion.logprobs


async def chat(engine, messages, *, cache_prompt: bool = True, session: str | None = None, **sampling) -> Reply:
    sampling.setdefault("temperature", 0.0)
    cache = CacheOptions(cache_prompt=cache_prompt, **({"session_key": session} if session else {}))
    request = ChatRequest(messages=tuple(messages), sampling=SamplingParams(max_tokens=6, **sampling), cache=cache)
    return Reply(await engine.chat(request))


async def test_conversations_sharing_a_system_prompt_all_stay_cached(start_engine) -> None:
    probe = await start_engine()
    first = await chat(probe, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello 0"}])
    one_entry = (await probe.cache_stats())["bytes"]
    assert one_entry > 0
    # Room for about three unshared conversations.
    engine = await start_engine(prompt_cache=evolve_cache(capacity_bytes=3 * one_entry + one_entry // 2))
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(CONVERSATIONS)]
    previous = [0] * CONVERSATIONS
    for turn in range(3):
        async def one(index: int, turn: int) -> None:
            messages = histories[index]
            messages.append({"role": "user", "content": f"conversation {index} turn {turn}: more about {index * 3}"})
            reply = await chat(engine, messages, session=f"user-{index}")
            if turn:
                # The whole previous prompt is reused, not just the system prompt.
                assert reply.cached_tokens >= 0.95 * previous[index], (turn, index, reply.cached_tokens)
            previous[index] = reply.prompt_tokens
            messages.append({"role": "assistant", "content": reply.content})

        async with trio.open_nursery() as nursery:
            for index in range(CONVERSATIONS):
                nursery.start_soon(one, index, turn)
        stats = await engine.cache_stats()
        assert stats["bytes"] <= stats["capacity_bytes"]
    assert stats["logical_bytes"] > 2 * stats["bytes"], stats
    assert stats["sharing_ratio"] > 2
    assert first.prompt_tokens > 250


async def test_a_hit_assembled_from_several_pieces_matches_a_cold_run(start_engine) -> None:
    engine = await start_engine()
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"turn {turn}: tell me about {turn * 11}"})
        reply = await chat(engine, messages)
        messages.append({"role": "assistant", "content": reply.content})
    other = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "a second conversation"}]
    await chat(engine, other)
    stats = await engine.cache_stats()
    assert stats["pieces"] >= 4  # the first conversation's three turns and the second's own piece
    messages.append({"role": "user", "content": "and finally?"})
    hot = await chat(engine, messages, logprobs=True, top_logprobs=5)
    cold = await chat(engine, messages, logprobs=True, top_logprobs=5, cache_prompt=False)
    assert hot.cached_tokens > 0.9 * hot.prompt_tokens
    assert cold.cached_tokens == 0
    assert hot.content == cold.content
    for hot_token, cold_token in zip(hot.logprobs, cold.logprobs, strict=True):
        assert hot_token.token == cold_token.token
        assert abs(hot_token.logprob - cold_token.logprob) < 1e-4
