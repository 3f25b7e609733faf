"""The engine embedded in a plain Trio app, on the real llama fixture model."""

from __future__ import annotations

import pytest
import trio

from mlxcel import ChatRequest, SamplingParams, ServerBusy
from mlxcel.config import SchedulerConfig
from mlxcel.core.cache_plan import CacheMode
from mlxcel.engine import open_engine
from tests.support import evolve_cache, make_engine_config, wait_until

pytestmark = pytest.mark.slow


def chat(text: str, max_tokens: int = 8, **sampling: object) -> ChatRequest:
    return ChatRequest(
        messages=({"role": "user", "content": text},),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens, **sampling),
    )


async def test_open_engine_chat_and_stream_agree() -> None:
    async with open_engine(make_engine_config()) as engine:
        # A plain KV model: resumes from prefixes, with APC and prompt donation (core/cache_plan.py).
        assert (engine.cache_plan.mode, engine.cache_plan.apc, engine.cache_plan.prompt_donation) == (
            CacheMode.PREFIX, True, True)
        completion = await engine.chat(chat("Hello there", max_tokens=6))
        assert completion.finish_reason in ("length", "stop")
        assert completion.usage.completion_tokens == 6 or completion.finish_reason == "stop"
        assert completion.usage.prompt_tokens > 5
        texts = []
        async with engine.stream(chat("Hello there", max_tokens=6)) as deltas:
            async for delta in deltas:
                texts.append(delta.text)
                last = delta
        # Greedy decoding: the stream gives the same text as the whole reply.
        assert "".join(texts) == completion.text
        assert last.usage is not None
        assert last.usage.completion_tokens == completion.usage.completion_tokens


async def test_with_the_prompt_cache_off_nothing_is_stored_or_reused(tmp_path) -> None:
    config = make_engine_config(prompt_cache=evolve_cache(enabled=False, disk_dir=tmp_path))
    async with open_engine(config) as engine:
        assert engine.cache_plan.mode is CacheMode.OFF
        first = await engine.chat(chat("Hello there, the same prompt twice", max_tokens=3))
        second = await engine.chat(chat("Hello there, the same prompt twice", max_tokens=3))
        assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, 0)
        stats = await engine.cache_stats()
        assert (stats["enabled"], stats["disk"]) == (False, {"enabled": False})
    # The disk tier was never opened: nothing was written there.
    assert not any(tmp_path.iterdir())


async def test_engine_cancelled_from_outside_stops_cleanly() -> None:
    with trio.fail_after(60):
        with trio.CancelScope() as scope:
            async with (
                open_engine(make_engine_config()) as engine,
                engine.stream(chat("a long answer please", max_tokens=2000)) as deltas,
            ):
                async for _delta in deltas:
                    scope.cancel()
        assert scope.cancelled_caught


async def test_sixteen_concurrent_streams_decode_in_batches(start_engine) -> None:
    engine = await start_engine()
    counts: dict[int, int] = {}

    async def one(index: int) -> None:
        async with engine.stream(chat(f"request number {index} " * 3, max_tokens=12)) as deltas:
            async for delta in deltas:
                if delta.usage is not None:
                    counts[index] = delta.usage.completion_tokens

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for index in range(16):
                nursery.start_soon(one, index)
    assert sorted(counts) == list(range(16))
    assert all(count == 12 for count in counts.values()), counts
    stats = await engine.scheduler_stats()
    # Decode steps ran with many sequences in one forward.
    assert stats.max_decode_batch_size >= 8, stats.decode_batch_sizes
    assert stats.num_running == 0
    assert stats.num_completed == 16


async def test_disconnect_mid_stream_frees_the_sequence(start_engine) -> None:
    engine = await start_engine()
    deltas = engine.stream(chat("keep talking", max_tokens=3000))
    received = 0
    async for _delta in deltas:
        received += 1
        if received == 3:
            break
    stats = await engine.scheduler_stats()
    assert deltas.request_id in stats.running_request_ids
    await deltas.aclose()

    async def gone() -> bool:
        stats = await engine.scheduler_stats()
        return stats.num_running == 0

    await wait_until(gone)
    stats = await engine.scheduler_stats()
    assert stats.num_cancelled == 1
    assert stats.num_completed == 0
    # A cancelled request is not a healthy completion: nothing was donated.
    cache = await engine.cache_stats()
    assert cache["entries"] == 0


async def test_full_queue_answers_busy(start_engine) -> None:
    engine = await start_engine(scheduler=SchedulerConfig(max_batch_size=1, max_queued_requests=1))
    outcomes: list[str] = []

    async def one(index: int) -> None:
        try:
            completion = await engine.chat(chat(f"question {index}", max_tokens=40))
            outcomes.append(completion.finish_reason)
        except ServerBusy as error:
            assert error.status == 503
            assert "capacity" in error.message
            outcomes.append("busy")

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for index in range(6):
                nursery.start_soon(one, index)
    assert "busy" in outcomes
    assert any(outcome != "busy" for outcome in outcomes)


async def test_long_prefill_is_chunked_and_interleaved_with_decode(start_engine) -> None:
    engine = await start_engine(scheduler=SchedulerConfig(prefill_step_size=32))
    decoding = trio.Event()
    decoded: list[int] = []

    async def decoder() -> None:
        async with engine.stream(chat("short", max_tokens=60)) as deltas:
            async for delta in deltas:
                decoding.set()
                if delta.usage is not None:
                    decoded.append(delta.usage.completion_tokens)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(decoder)
            # The long prompt arrives once the short request is decoding (not after a guessed delay).
            await decoding.wait()
            long_prompt = " ".join(f"word{i}" for i in range(300))
            await engine.chat(chat(long_prompt, max_tokens=2))
    stats = await engine.scheduler_stats()
    assert decoded == [60], "the short reply ended early: nothing left to interleave with"
    assert stats.num_interleaved_steps >= 3, stats


async def test_stop_string_ends_the_reply_without_leaking(start_engine) -> None:
    engine = await start_engine()
    request = chat("Tell me something", max_tokens=30)
    full = await engine.chat(request)
    assert len(full.text) > 10
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    cut = full.text.find(stop)
    stopped = await engine.chat(chat("Tell me something", max_tokens=30, stop=(stop,)))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut]
    assert stop not in stopped.text


async def test_logprobs_agree_with_greedy_choice(start_engine) -> None:
    engine = await start_engine()
    completion = await engine.chat(chat("Which token next?", max_tokens=5, logprobs=True, top_logprobs=3))
    assert len(completion.logprobs) == completion.usage.completion_tokens
    for item in completion.logprobs:
        assert len(item.top) == 3
        best_token, best_logprob = item.top[0]
        assert item.logprob <= 0.0
        assert abs(item.logprob - best_logprob) < 1e-5
        assert [value for _token, value in item.top] == sorted((value for _t, value in item.top), reverse=True)


async def test_the_start_up_warm_up_runs_and_leaves_nothing_behind(start_engine, caplog) -> None:
    caplog.set_level("INFO", logger="mlxcel.actors.device")
    cold = await start_engine(scheduler=SchedulerConfig(prefill_step_size=32, device_warmup=False))
    assert "device warm-up took" not in caplog.text
    warm = await start_engine(scheduler=SchedulerConfig(prefill_step_size=32, device_warmup=True))
    assert "device warm-up took" in caplog.text
    # Requests after it run as on an engine without it: same replies, and no
    # warm-up sequence left in the decode batch.
    long_prompt = " ".join(f"word{i}" for i in range(60))  # over one chunk: the batched path
    for text in ("Hello there", long_prompt):
        ours, reference = await warm.chat(chat(text)), await cold.chat(chat(text))
        assert (ours.text, ours.usage) == (reference.text, reference.usage)
    warm_stats, cold_stats = await warm.scheduler_stats(), await cold.scheduler_stats()
    assert warm_stats.decode_batch_sizes == cold_stats.decode_batch_sizes
    assert set(warm_stats.decode_batch_sizes) == {1}  # one request at a time, nothing else decoding


async def test_the_bucketed_warm_up_builds_every_cold_row_width_and_replies_stay_the_same(start_engine) -> None:
    from mlxcel.core.placement import COLD_QUERY_BUCKETS

    cold = await start_engine(scheduler=SchedulerConfig(prefill_step_size=256, device_warmup=False,
                                                        start_buckets=True, max_batch_size=4))
    warm = await start_engine(scheduler=SchedulerConfig(prefill_step_size=256, device_warmup=True,
                                                        start_buckets=True, max_batch_size=4))
    assert COLD_QUERY_BUCKETS == (32, 64)
    for words in (3, 20, 50):  # rows of the 32-, 64- and 128-token widths
        text = " ".join(f"w{i}" for i in range(words))
        ours, reference = await warm.chat(chat(text)), await cold.chat(chat(text))
        assert (ours.text, ours.usage) == (reference.text, reference.usage)
