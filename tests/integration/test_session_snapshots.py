"""Session snapshots for the sliding-window and recurrent-hybrid fixtures, end to end."""

from __future__ import annotations

from functools import partial

import openai
import pytest
import trio
import trio.lowlevel

from mlxcel import CacheOptions, ChatRequest, SamplingParams
from mlxcel.core.cache_plan import CacheMode
from tests.support import evolve_cache, wait_until

pytestmark = pytest.mark.slow

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
    async def done() -> bool:
        stats = await engine.scheduler_stats()
        return stats.num_warm_completed + stats.num_warm_covered >= count

    await wait_until(done, seconds=60)


@pytest.mark.parametrize("family", ["gemma3", "hybrid"])
async def test_four_turns_resume_from_snapshots_and_match_cold_runs(start_engine, start_server, family) -> None:
    engine = await start_engine(family)
    # The plan run_engine made for this family and handed to every part.
    assert (engine.cache_plan.mode, engine.cache_plan.apc, engine.cache_plan.prompt_donation) == (
        CacheMode.SNAPSHOTS, False, False)
    assert engine.cache_plan.warm_ups
    assert (engine.cache_plan.sliding_window is not None) == (family == "gemma3")
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


async def test_a_preempted_warmup_runs_again_once_idle_and_the_next_turn_resumes_from_it(start_engine) -> None:
    from mlxcel.config import SchedulerConfig

    engine = await start_engine("hybrid", scheduler=SchedulerConfig(prefill_step_size=8))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "tell me a long story"}]
    reply = await engine.chat(ChatRequest(messages=tuple(messages), cache=CacheOptions(session_key="dave"),
                                          sampling=SamplingParams(temperature=0.0, max_tokens=60)))
    inserts_after_turn = (await engine.cache_stats())["snapshots"]["inserts"]
    with trio.fail_after(30):
        while (await engine.scheduler_stats()).num_warm_started < 1:
            await trio.lowlevel.checkpoint()
    # Foreground work arrives while the warm-up is still prefilling (~70 tokens, 8 per step).
    await engine.chat(ChatRequest(messages=({"role": "user", "content": "quick"},),
                                  sampling=SamplingParams(temperature=0.0, max_tokens=2)))
    stats = await engine.scheduler_stats()
    assert stats.num_warm_preempted == 1
    # Dropped, it stored nothing (no partial snapshot) and waits again; the idle device runs it to the end.
    assert stats.num_warm_completed == 0
    assert (await engine.cache_stats())["snapshots"]["inserts"] == inserts_after_turn

    async def dave_warmed() -> bool:
        return (await engine.scheduler_stats()).num_warm_completed >= 1
    await wait_until(dave_warmed, seconds=60)
    messages += [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "and then?"}]
    hot = await engine.chat(ChatRequest(messages=tuple(messages), cache=CacheOptions(session_key="dave"),
                                        sampling=SamplingParams(temperature=0.0, max_tokens=2)))
    new_user_tokens = len(engine.model.tokenizer.apply_chat_template([messages[-1]], add_generation_prompt=True))
    assert hot.usage.prompt_tokens - hot.usage.cached_tokens == new_user_tokens


# --- several conversations: prefix-indexed snapshots ---------------------------------------


def first_turn_tokens(engine, messages) -> int:
    return len(engine.model.tokenizer.apply_chat_template(list(messages), add_generation_prompt=False))


async def turn(client, engine, messages, **kwargs):
    """One hot turn and its cold twin: the hit's first-token logprobs must match (d)."""
    hot = await create(client, model=engine.model_id, messages=messages, **kwargs)
    if hot.usage.prompt_tokens_details.cached_tokens:
        cold = await create(client, model=engine.model_id, messages=messages, extra_body={"cache_prompt": False})
        assert_first_logprobs_close(hot, cold)
    return hot


@pytest.mark.parametrize("family", ["gemma3", "hybrid"])
async def test_interleaved_anonymous_conversations_both_keep_their_hits(start_engine, start_server, family) -> None:
    engine = await start_engine(family)
    client = client_for(await start_server(engine))
    conversations = {name: [{"role": "system", "content": SYSTEM}] for name in "AB"}
    previous_prompt = {}
    num_replies = 0
    for number in range(4):
        for name, messages in conversations.items():
            messages.append({"role": "user", "content": f"{name} turn {number}: tell me about {name * 3} {number}"})
            # No user, no prompt_cache_key: both share the anonymous session.
            hot = await turn(client, engine, messages)
            cached = hot.usage.prompt_tokens_details.cached_tokens
            if number >= 1:
                # At most the new user message plus the reply: what this turn adds to the last prompt.
                assert cached > 0, (name, number)
                assert hot.usage.prompt_tokens - cached <= hot.usage.prompt_tokens - previous_prompt[name]
                new_user = first_turn_tokens(engine, [messages[-1]]) + 3  # + the generation prompt
                assert hot.usage.prompt_tokens - cached <= new_user, (name, number, cached)
            previous_prompt[name] = hot.usage.prompt_tokens
            messages.append({"role": "assistant", "content": hot.choices[0].message.content})
            num_replies += 1
            await wait_for_warmups(engine, num_replies)
    stats = (await engine.cache_stats())["snapshots"]
    assert stats["refusals"] == {}
    assert stats["sessions"] == 1


@pytest.mark.parametrize("family", ["gemma3", "hybrid"])
async def test_eight_users_reuse_one_system_prompt_on_their_first_turn(start_engine, start_server, family) -> None:
    engine = await start_engine(family)
    client = client_for(await start_server(engine))
    system = {"role": "system", "content": "You are a careful assistant. " + " ".join(
        f"rule {i} says item{i} matters." for i in range(102))}
    system_tokens = first_turn_tokens(engine, [system])
    assert 950 <= system_tokens <= 1300
    for number in range(8):
        messages = [system, {"role": "user", "content": f"I am user {number}; what is item{number * 7}?"}]
        hot = await turn(client, engine, messages, user=f"user{number}")
        cached = hot.usage.prompt_tokens_details.cached_tokens
        assert cached == (0 if number == 0 else system_tokens), number
    stats = (await engine.cache_stats())["snapshots"]
    assert stats["cross_session_hits"] == 7
    assert stats["refusals"] == {}


@pytest.mark.parametrize("family", ["gemma3", "hybrid"])
async def test_subagents_under_one_session_key_leave_the_main_conversation_its_hits(
    start_engine, start_server, family,
) -> None:
    engine = await start_engine(family)
    client = client_for(await start_server(engine))
    main = [{"role": "system", "content": SYSTEM}]
    subagents = [[{"role": "system", "content": f"You are subagent {index}. " + " ".join(
        f"tool{index}-{i}" for i in range(40))}] for index in range(4)]
    num_replies = 0
    for number in range(3):
        main.append({"role": "user", "content": f"main task step {number}"})
        hot = await turn(client, engine, main, extra_body={"prompt_cache_key": "agent"})
        cached = hot.usage.prompt_tokens_details.cached_tokens
        if number >= 1:
            assert hot.usage.prompt_tokens - cached <= first_turn_tokens(engine, [main[-1]]) + 3, (number, cached)
        main.append({"role": "assistant", "content": hot.choices[0].message.content})
        num_replies += 1
        await wait_for_warmups(engine, num_replies)
        for index, messages in enumerate(subagents):
            messages.append({"role": "user", "content": f"subtask {index}.{number}"})
            sub = await turn(client, engine, messages, extra_body={"prompt_cache_key": "agent"})
            if number >= 1:
                assert sub.usage.prompt_tokens_details.cached_tokens > 0
            messages.append({"role": "assistant", "content": sub.choices[0].message.content})
            num_replies += 1
            await wait_for_warmups(engine, num_replies)
    stats = (await engine.cache_stats())["snapshots"]
    # Five conversations' tips and their system prompts' checkpoints live side by side.
    assert stats["entries"] >= 10
    assert stats["sessions"] == 1


async def test_sliding_window_restores_partially_at_the_common_prefix(start_engine, start_server) -> None:
    engine = await start_engine("gemma3")
    client = client_for(await start_server(engine))
    long_question = " ".join(f"word{i}" for i in range(30))
    first = [{"role": "user", "content": long_question + " first ending"}]
    reply = await create(client, model=engine.model_id, messages=first, user="erin")
    await wait_for_warmups(engine, 1)
    # The same question ending differently: it parts from the stored snapshots inside the window.
    edited = [{"role": "user", "content": long_question + " other ending"}]
    tokenizer = engine.model.tokenizer
    hot = await turn(client, engine, edited, user="erin")
    cold_tokens = tokenizer.apply_chat_template(edited, add_generation_prompt=True)
    first_tokens = tokenizer.apply_chat_template(first, add_generation_prompt=True)
    common = next(i for i, (a, b) in enumerate(zip(cold_tokens, first_tokens, strict=False)) if a != b)
    assert common < 128  # the fixture's window
    assert hot.usage.prompt_tokens_details.cached_tokens == common
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    stats = (await engine.cache_stats())["snapshots"]
    assert stats["partial_hits"] == 1


async def test_metrics_show_snapshot_bytes_entries_and_refusals_apart_from_misses(start_engine, start_server) -> None:
    import httpx

    engine = await start_engine("hybrid")
    base_url = await start_server(engine, metrics=True)
    client = client_for(base_url)
    history = [{"role": "user", "content": SYSTEM + " first question"}]
    first = await create(client, model=engine.model_id, messages=history, user="fay")
    await wait_for_warmups(engine, 1)
    edited = [{"role": "user", "content": SYSTEM + " another question"},
              {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "and then?"}]
    await create(client, model=engine.model_id, messages=edited, user="fay")
    text = (await trio.to_thread.run_sync(httpx.get, f"{base_url}/metrics")).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values['mlxcel_prompt_cache_snapshot_refusals_total{cause="history_rewritten"}'] == 1
    assert values["mlxcel_prompt_cache_misses_total"] == 1
    assert values["mlxcel_prompt_cache_snapshot_entries"] >= 1
    assert values["mlxcel_prompt_cache_snapshot_bytes"] > 0
