"""The prompt cache end to end: hits through HTTP and the openai client, equal to cold runs."""

from __future__ import annotations

from functools import partial

import httpx
import openai
import pytest
import trio

from mlxcel.config import SchedulerConfig
from mlxcel.core import placement as core_placement
from tests.support import evolve_cache

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(60))
BLOCK = 16


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def create(client: openai.OpenAI, **kwargs):
    kwargs.setdefault("model", "llama-v1-seed0")
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 4)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


def first_logprobs(completion) -> dict[str, float]:
    first = completion.choices[0].logprobs.content[0]
    return {item.token: item.logprob for item in first.top_logprobs}


def assert_same_first_token_logprobs(cached, cold) -> None:
    hot, reference = first_logprobs(cached), first_logprobs(cold)
    assert hot.keys() == reference.keys()
    for token, value in reference.items():
        assert abs(hot[token] - value) < 1e-4, (token, hot[token], value)


@pytest.fixture
def serve_family(start_engine, start_server):
    async def start(family: str = "llama", **changes):
        engine = await start_engine(family, **changes)
        return engine, await start_server(engine)

    return start


@pytest.mark.parametrize("family", ["llama", "phi3-longrope"])
async def test_cache_hit_matches_cold_run(serve_family, family) -> None:
    engine, base_url = await serve_family(family)
    client = client_for(base_url)
    model = engine.model_id
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    first = await create(client, model=model, messages=messages)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow_up = messages + [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "second question"},
    ]
    cached = await create(client, model=model, messages=follow_up, logprobs=True, top_logprobs=5)
    cold = await create(client, model=model, messages=follow_up, logprobs=True, top_logprobs=5,
                        extra_body={"cache_prompt": False})
    assert cached.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // BLOCK) * BLOCK
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert_same_first_token_logprobs(cached, cold)
    assert cached.choices[0].message.content == cold.choices[0].message.content


async def test_bucketed_starts_answer_as_the_plain_path_does(serve_family, monkeypatch) -> None:
    """CUDA's shape buckets, forced on here with small buckets: a cold prompt longer than a
    chunk (prefilled alone, its last chunk started directly, padded) and hits resumed from a cut
    prefix give the replies and first-token logprobs of the unbucketed path."""
    monkeypatch.setattr(core_placement, "START_PREFIX_ALIGN", 16)
    monkeypatch.setattr(core_placement, "START_QUERY_BUCKET", 32)
    alone = []  # whether each admission was prefilled alone (only the bucketed engine's can be)
    original = core_placement.Placement.prefills_alone
    monkeypatch.setattr(core_placement.Placement, "prefills_alone",
                        lambda where, pending: alone.append(original(where, pending)) or alone[-1])
    servers = {}
    for buckets in (False, True):
        scheduler = SchedulerConfig(prefill_step_size=64, device_warmup=False, start_buckets=buckets)
        servers[buckets] = await serve_family(scheduler=scheduler)
    histories = {buckets: [{"role": "system", "content": SYSTEM}] for buckets in servers}
    for turn in range(3):
        replies = {}
        for buckets, (engine, base_url) in servers.items():
            messages = histories[buckets]
            messages.append({"role": "user", "content": f"question {turn}: " + "and more " * (5 + 9 * turn)})
            replies[buckets] = await create(client_for(base_url), model=engine.model_id, messages=messages,
                                            logprobs=True, top_logprobs=5, user="bob")
            messages.append({"role": "assistant", "content": replies[buckets].choices[0].message.content})
        bucketed, plain = replies[True], replies[False]
        assert bucketed.usage.prompt_tokens > 64  # longer than a chunk
        assert bucketed.usage.prompt_tokens_details.cached_tokens == plain.usage.prompt_tokens_details.cached_tokens
        assert (bucketed.usage.prompt_tokens_details.cached_tokens > 0) is (turn > 0)
        assert bucketed.choices[0].message.content == plain.choices[0].message.content
        assert_same_first_token_logprobs(bucketed, plain)
    assert any(alone)


async def test_hits_arriving_together_on_one_system_prompt_share_a_pass_and_answer_as_alone(
        serve_family, monkeypatch) -> None:
    """With shape buckets (forced on, small), users arriving at once on a stored system prompt keep the same
    cut of it: their starts run in one forward pass, and each answer (reply, first-token logprobs, cached
    count) is the one the unbucketed path gives that user started alone."""
    from mlxcel.model.executor import StepExecutor

    monkeypatch.setattr(core_placement, "START_PREFIX_ALIGN", 16)
    monkeypatch.setattr(core_placement, "START_QUERY_BUCKET", 32)
    shared: list[tuple[int, int]] = []  # (kept, rows) of each shared pass
    original = StepExecutor._start_shared_rows
    monkeypatch.setattr(StepExecutor, "_start_shared_rows", lambda executor, starts, kept, width: (
        shared.append((kept, len(starts))), original(executor, starts, kept, width))[1])
    users = ["bob", "carol", "dave", "erin"]
    answers: dict[bool, dict[str, object]] = {}
    for buckets in (False, True):
        # A 512-token step: its budget holds the pass's charge (256) and the four users' new tokens.
        engine, base_url = await serve_family(
            scheduler=SchedulerConfig(prefill_step_size=512, device_warmup=False, start_buckets=buckets))
        client = client_for(base_url)
        await create(client, model=engine.model_id, user="alice",
                     messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "warm it"}])
        replies: dict[str, object] = {}

        async def ask(user: str, client=client, engine=engine, replies=replies) -> None:
            messages = [{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": f"{user} asks about item {len(user) * 3}"}]
            replies[user] = await create(client, model=engine.model_id, messages=messages, user=user,
                                         logprobs=True, top_logprobs=5)

        if buckets:
            async with trio.open_nursery() as nursery:
                for user in users:
                    nursery.start_soon(ask, user)
        else:  # the reference: one at a time
            for user in users:
                await ask(user)
        answers[buckets] = replies
    assert any(kept > 0 and rows > 1 for kept, rows in shared), shared
    for user in users:
        together, alone = answers[True][user], answers[False][user]
        assert together.usage.prompt_tokens_details.cached_tokens >= 100  # the system prompt hit
        assert together.usage.prompt_tokens_details.cached_tokens == alone.usage.prompt_tokens_details.cached_tokens
        assert together.choices[0].message.content == alone.choices[0].message.content
        assert_same_first_token_logprobs(together, alone)


async def test_four_turn_conversation_reuses_history(serve_family) -> None:
    engine, base_url = await serve_family()
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    for turn in range(4):
        messages.append({"role": "user", "content": f"turn {turn}: tell me more about item {turn * 7}"})
        reply = await create(client, messages=messages, user="alice")
        cached = reply.usage.prompt_tokens_details.cached_tokens
        if turn == 0:
            assert cached == 0
        else:
            assert cached >= (previous_prompt // BLOCK) * BLOCK, (turn, cached, previous_prompt)
            assert cached < reply.usage.prompt_tokens
        previous_prompt = reply.usage.prompt_tokens
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    stats = await engine.cache_stats()
    assert stats["hits"] >= 3
    assert stats["apc_enabled"] is True


async def test_cross_session_reuse_of_a_shared_system_prompt(serve_family) -> None:
    _engine, base_url = await serve_family()
    client = client_for(base_url)
    system = [{"role": "system", "content": SYSTEM}]
    await create(client, messages=system + [{"role": "user", "content": "alpha"}], user="alice")
    bob = await create(client, messages=system + [{"role": "user", "content": "beta"}], user="bob")
    assert bob.usage.prompt_tokens_details.cached_tokens >= 100


async def test_template_kwargs_tools_and_tool_choice_change_the_key(serve_family) -> None:
    _engine, base_url = await serve_family()
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    await create(client, messages=messages)
    again = await create(client, messages=messages + [{"role": "assistant", "content": "x"},
                                                      {"role": "user", "content": "more"}])
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    tool = {"type": "function", "function": {"name": "lookup", "description": "find", "parameters": {"type": "object"}}}
    variants = [
        dict(extra_body={"chat_template_kwargs": {"enable_thinking": False}}),
        dict(tools=[tool]),
    ]
    for variant in variants:
        reply = await create(client, messages=messages, **variant)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0, variant
    # tool_choice "none" renders no tools: the same prompt as without them, so it hits.
    reply = await create(client, messages=messages, tools=[tool], tool_choice="none")
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_apc_reuses_the_common_prefix_exactly(serve_family) -> None:
    engine, base_url = await serve_family()
    system = {"role": "system", "content": SYSTEM}
    tokenizer = engine.model.tokenizer
    tokens_a = tokenizer.apply_chat_template([system, {"role": "user", "content": "apples are red"}],
                                             add_generation_prompt=True)
    tokens_b = tokenizer.apply_chat_template([system, {"role": "user", "content": "bananas are yellow"}],
                                             add_generation_prompt=True)
    client = client_for(base_url)
    await create(client, messages=[system, {"role": "user", "content": "apples are red"}])
    second_messages = [system, {"role": "user", "content": "bananas are yellow"}]
    second = await create(client, messages=second_messages, logprobs=True, top_logprobs=5)
    # Up to the very token where the prompts part, not rounded down to an APC block.
    expected = common_prefix(tokens_a, tokens_b)
    assert expected >= 100
    assert expected % BLOCK != 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    cold = await create(client, messages=second_messages, logprobs=True, top_logprobs=5,
                        extra_body={"cache_prompt": False})
    assert_same_first_token_logprobs(second, cold)


async def test_apc_disabled_reports_no_partial_reuse(serve_family) -> None:
    _engine, base_url = await serve_family(prompt_cache=evolve_cache(apc_enabled=False))
    client = client_for(base_url)
    system = {"role": "system", "content": SYSTEM}
    await create(client, messages=[system, {"role": "user", "content": "apples are red"}])
    second = await create(client, messages=[system, {"role": "user", "content": "bananas are yellow"}])
    assert second.usage.prompt_tokens_details.cached_tokens == 0


async def test_cache_prompt_false_neither_reads_nor_donates(serve_family) -> None:
    engine, base_url = await serve_family()
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    for placement in ({"cache_prompt": False}, {"extra_body": {"cache_prompt": False}}):
        reply = await create(client, messages=messages, extra_body=placement)
        assert reply.usage.prompt_tokens_details.cached_tokens == 0
    stats = await engine.cache_stats()
    assert stats["entries"] == 0
    assert stats["hits"] == 0
    assert stats["misses"] == 0


async def test_stats_reset_and_metrics(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, metrics=True)
    client = client_for(base_url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    await create(client, messages=messages)
    await create(client, messages=messages + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}])
    async with httpx.AsyncClient(base_url=base_url) as http:
        stats = (await http.get("/v1/cache/stats")).json()
        assert stats["entries"] >= 1
        assert stats["hits"] == 1
        assert stats["bytes"] > 0
        for field in ("apc_enabled", "total_blocks_stored", "unique_block_hashes", "apc_active_entries"):
            assert field in stats
        assert stats["total_blocks_stored"] >= stats["unique_block_hashes"] > 0
        metrics = (await http.get("/metrics")).text
        assert "mlxcel_prompt_cache_hits_total 1.0" in metrics
        assert "mlxcel_prompt_cache_misses_total 1.0" in metrics
        for name in ("prefix_tokens_reused_total", "bytes", "entries"):
            assert f"mlxcel_prompt_cache_{name}" in metrics
        for reason in ("lru", "ttl", "capacity"):
            assert f'mlxcel_prompt_cache_evictions_total{{reason="{reason}"}}' in metrics
        reset = (await http.post("/v1/cache/reset")).json()
        assert reset["entries_freed"] == stats["entries"]
        assert reset["bytes_freed"] == stats["bytes"]
        after = (await http.get("/v1/cache/stats")).json()
        assert after["entries"] == 0
        assert after["bytes"] == 0
        assert after["total_blocks_stored"] == 0
