"""Session snapshots for the sliding-window and recurrent-hybrid fixtures, end to end."""

from __future__ import annotations

from functools import partial

import openai
import pytest
import trio
import trio.lowlevel

from mlxcel import CacheOptions, ChatRequest, SamplingParams
from tests.support import evolve_cache

SYSTEM = "You are helpful. " + " ".join(f"rule{i}" for i in range(80))


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def create(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 5)
    kwargs.setdefault("logprobs", True)
    kwargs.setdefault("top_logprobs", 4)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


def assert_first_logprobs_close(hot, cold) -> None:
    hot_top = {item.token: item.logprob for item in hot.choices[0].logprobs.content[0].top_logprobs}
    cold_top = {item.token: item.logprob for item in cold.choices[0].logprobs.content[0].top_logprobs}
    assert hot_top.keys() == cold_top.keys()
    for token, value in cold_top.items():
        assert abs(hot_top[token] - value) < 1e-4


async def wait_for_warmups(engine, count: int) -> None:
    with trio.fail_after(60):
        while (await engine.scheduler_stats()).num_warm_completed < count:
            await trio.sleep(0.02)


@pytest.mark.parametrize("family", ["gemma3", "hybrid"])
async def test_four_turns_resume_from_snapshots_and_match_cold_runs(start_engine, start_server, family) -> None:
    engine = await start_engine(family)
    base_url = await start_server(engine)
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}]
    new_user_tokens = None
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: what about item {turn * 13}?"})
        hot = await create(client, model=engine.model_id, messages=messages, user="alice")
        cold = await create(client, model=engine.model_id, messages=messages, extra_body={"cache_prompt": False})
        cached = hot.usage.prompt_tokens_details.cached_tokens
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        assert_first_logprobs_close(hot, cold)
        assert hot.choices[0].message.content == cold.choices[0].message.content
        if turn == 0:
            assert cached == 0
        else:
            assert cached > 0
        if turn >= 2:
            # The warmer covered the previous reply: only the new user message is left.
            new_user_tokens = len(engine.model.tokenizer.apply_chat_template(
                [messages[-1]], add_generation_prompt=True))
            assert hot.usage.prompt_tokens - cached == new_user_tokens, (turn, cached)
        messages.append({"role": "assistant", "content": hot.choices[0].message.content})
        await wait_for_warmups(engine, turn + 1)
    stats = await engine.cache_stats()
    assert stats["apc_enabled"] is False
    # The conversation's tip and the system prompt's checkpoint (gemma3: and the one taken before
    # its 128-token window wrapped); each tip superseded the one before.
    num_checkpoints = 2 if family == "gemma3" else 1
    assert stats["snapshots"]["checkpoints"] == num_checkpoints
    assert stats["snapshots"]["entries"] == num_checkpoints + 1
    scheduler = await engine.scheduler_stats()
    assert scheduler.num_warm_steps_with_foreground == 0


async def test_editing_history_is_refused_counted_and_still_correct(start_engine, start_server) -> None:
    engine = await start_engine("hybrid")
    base_url = await start_server(engine)
    client = client_for(base_url)
    # No system prompt: the only snapshot is the warm-up's tip, which the edit diverges from.
    history = [{"role": "user", "content": SYSTEM + " first question"}]
    first = await create(client, model=engine.model_id, messages=history, user="bob")
    history.append({"role": "assistant", "content": first.choices[0].message.content})
    await wait_for_warmups(engine, 1)
    edited = [{"role": "user", "content": SYSTEM + " a rewritten first question"}, history[1],
              {"role": "user", "content": "second question"}]
    hot = await create(client, model=engine.model_id, messages=edited, user="bob")
    cold = await create(client, model=engine.model_id, messages=edited, extra_body={"cache_prompt": False})
    assert hot.usage.prompt_tokens_details.cached_tokens == 0
    assert_first_logprobs_close(hot, cold)
    stats = await engine.cache_stats()
    assert stats["snapshots"]["refusals"].get("history_rewritten") == 1
    # The first request found nothing (a miss); the refusal is not a miss.
    assert stats["snapshots"]["misses"] == 1


async def test_warmups_yield_to_foreground_requests(start_engine) -> None:
    engine = await start_engine("hybrid")
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"})
    request = ChatRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=3),
                          cache=CacheOptions(session_key="carol"))
    # A stream of foreground requests back to back: warm-ups wait or give way.
    async with trio.open_nursery() as nursery:
        for index in range(4):
            nursery.start_soon(engine.chat, ChatRequest(
                messages=messages[:1] + ({"role": "user", "content": f"q{index}"},),
                sampling=request.sampling, cache=CacheOptions(session_key=f"user{index}")))
    await engine.chat(request)
    stats = await engine.scheduler_stats()
    assert stats.num_warm_steps_with_foreground == 0
    assert stats.num_warm_started >= 1


async def test_boundary_snapshots_can_be_turned_off(start_engine) -> None:
    engine = await start_engine("hybrid", prompt_cache=evolve_cache(boundary_snapshots=False, warmup=False))
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"})
    request = ChatRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=3))
    await engine.chat(request)
    stats = await engine.cache_stats()
    assert stats["snapshots"]["entries"] == 0


async def test_a_preempted_warmup_stores_no_partial_snapshot(start_engine) -> None:
    from mlxcel.config import SchedulerConfig

    engine = await start_engine("hybrid", scheduler=SchedulerConfig(prefill_step_size=8))
    messages = ({"role": "system", "content": SYSTEM}, {"role": "user", "content": "tell me a long story"})
    request = ChatRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=60),
                          cache=CacheOptions(session_key="dave"))
    await engine.chat(request)
    inserts_after_turn = (await engine.cache_stats())["snapshots"]["inserts"]
    with trio.fail_after(30):
        while (await engine.scheduler_stats()).num_warm_started < 1:
            await trio.lowlevel.checkpoint()
    # Foreground work arrives while the warm-up is still prefilling (~70 tokens, 8 per step).
    await engine.chat(ChatRequest(messages=({"role": "user", "content": "quick"},),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=2)))
    stats = await engine.scheduler_stats()
    assert stats.num_warm_preempted == 1
    assert stats.num_warm_completed == 0
    assert (await engine.cache_stats())["snapshots"]["inserts"] == inserts_after_turn
