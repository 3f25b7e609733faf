"""The disk tier end to end on the llama fixture: a conversation survives closing the engine."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
import trio

from mlxcel import ChatRequest, SamplingParams
from mlxcel.engine import open_engine
from mlxcel.types import CacheOptions
from tests.support import evolve_cache, loopback, make_engine_config, wait_until

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant for a coding agent. " + " ".join(
    f"tool_{index}(path, mode, options) edits file number {index} in place." for index in range(40))


def turn(history: list[dict[str, str]], **fields: object) -> ChatRequest:
    return ChatRequest(
        messages=tuple(history),
        sampling=SamplingParams(temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=5),
        **fields,
    )


def has_pieces(directory: Path, prefix: str = "kv-") -> bool:
    return any(path.name.startswith(prefix) for path in directory.iterdir())


def first_logprobs(completion) -> dict[str, float]:
    return dict(completion.logprobs[0].top)


async def warmed_up(engine) -> bool:
    return (await engine.scheduler_stats()).num_warm_completed >= 1


async def wait_for_writes(engine, minimum: int) -> dict:
    async def written() -> dict | None:
        disk = (await engine.cache_stats())["disk"]
        return disk if disk["writes"] + disk["duplicates"] >= minimum and disk["entries"] >= minimum else None

    return await wait_until(written)


async def test_a_conversation_resumes_from_disk_after_a_restart(tmp_path: Path) -> None:
    config = make_engine_config(prompt_cache=evolve_cache(disk_dir=tmp_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open the first file."}]
    async with open_engine(config) as engine:
        first = await engine.chat(turn(history))
        stats = await wait_for_writes(engine, 1)
        assert stats["write_errors"] == 0
        assert stats["bytes"] > 0
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now the second."}]
    assert has_pieces(tmp_path)

    async with open_engine(config) as engine:
        resumed = await engine.chat(turn(history))
        disk = (await engine.cache_stats())["disk"]
        # The disk hit counts as a prompt-cache hit, with the tokens it reused.
        metrics = (await engine.metrics_text()).decode()
        assert "mlxcel_prompt_cache_hits_total 1.0" in metrics
        assert f"mlxcel_prompt_cache_prefix_tokens_reused_total {float(resumed.usage.cached_tokens)}" in metrics
        cold = await engine.chat(turn(history, cache=CacheOptions(cache_prompt=False)))
    # The first turn's prompt is covered, to its last whole 16-token block.
    assert resumed.usage.cached_tokens >= (first.usage.prompt_tokens // 16) * 16 - 16
    assert resumed.usage.cached_tokens > 256
    assert cold.usage.cached_tokens == 0
    assert disk["hits"] == 1
    assert disk["tokens_loaded"] > 0
    hot, reference = first_logprobs(resumed), first_logprobs(cold)
    assert hot.keys() == reference.keys()
    for token, logprob in reference.items():
        assert abs(hot[token] - logprob) < 1e-4, (token, hot[token], logprob)
    assert resumed.text == cold.text


async def test_stats_metrics_and_a_reset_that_clears_the_disk(tmp_path: Path) -> None:
    config = make_engine_config(prompt_cache=evolve_cache(disk_dir=tmp_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "List the tools."}]
    async with open_engine(config) as engine:
        await engine.chat(turn(history))
        # Every piece of the conversation: [0, 16), [16, 32), the prompt's tail [32, 47) and the reply's
        # [32, 48) blocks. Waiting for fewer let a later one land after the reset (one run in three).
        written = await wait_for_writes(engine, 4)
        text = (await engine.metrics_text()).decode()
        assert f"mlxcel_prompt_cache_disk_entries {float(written['entries'])}" in text
        assert "mlxcel_prompt_cache_disk_writes_total" in text
        assert 'mlxcel_prompt_cache_disk_refusals_total{reason="checksum"} 0.0' in text
        kept = await engine.reset_cache()
        assert "disk_entries_freed" not in kept
        assert (await engine.cache_stats())["disk"]["entries"] > 0
        freed = await engine.reset_cache(disk=True)
        assert freed["disk_entries_freed"] == written["entries"]
        assert freed["disk_bytes_freed"] > 0
        assert (await engine.cache_stats())["disk"]["entries"] == 0
    assert not has_pieces(tmp_path)


@pytest.mark.parametrize("family", ["hybrid", "gemma3"])
async def test_session_snapshots_resume_from_disk_after_a_restart(tmp_path: Path, family: str) -> None:
    config = make_engine_config(family, prompt_cache=evolve_cache(disk_dir=tmp_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open the first file."}]
    async with open_engine(config) as engine:
        first = await engine.chat(turn(history))
        await wait_until(lambda: warmed_up(engine), seconds=60)
        await wait_for_writes(engine, 2)
    assert has_pieces(tmp_path, "snap-")
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now the second."}]
    async with open_engine(config) as engine:
        resumed = await engine.chat(turn(history))
        disk = (await engine.cache_stats())["disk"]
        cold = await engine.chat(turn(history, cache=CacheOptions(cache_prompt=False)))
    # The warm-up's snapshot covered turn 1's reply: only the new message is prefilled.
    assert resumed.usage.cached_tokens > first.usage.prompt_tokens
    assert disk["hits"] == 1
    assert sum(disk["refusals"].values()) == 0
    hot, reference = first_logprobs(resumed), first_logprobs(cold)
    assert hot.keys() == reference.keys()
    for token, logprob in reference.items():
        assert abs(hot[token] - logprob) < 1e-4, (token, hot[token], logprob)


async def test_a_retained_prompt_read_back_after_a_restart_is_pinned_again(tmp_path: Path) -> None:
    config = make_engine_config(prompt_cache=evolve_cache(disk_dir=tmp_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open the first file."}]
    retained = CacheOptions(retain_seconds=3600.0)
    async with open_engine(config) as engine:
        first = await engine.chat(turn(history, cache=retained))
        assert (await engine.cache_stats())["pinned_entries"] >= 1
        await wait_for_writes(engine, 1)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now the second."}]
    async with open_engine(config) as engine:
        resumed = await engine.chat(turn(history))  # not retained itself: the pin comes from disk
        stats = await engine.cache_stats()
    assert stats["disk"]["hits"] == 1
    assert resumed.usage.cached_tokens >= (first.usage.prompt_tokens // 16) * 16 - 16
    assert stats["pinned_entries"] >= 1
    assert stats["pinned_bytes"] > 0


async def test_an_image_conversation_resumes_from_disk_after_a_restart(tmp_path: Path) -> None:
    """Image prompts use the disk tier: their digest is in the fingerprint, so only the same images hit."""
    import io
    from functools import partial

    import numpy as np
    import openai
    from PIL import Image

    from mlxcel.config import EngineConfig, SchedulerConfig
    from mlxcel.engine import run_engine
    from mlxcel.fixtures import vision_fixture_path
    from mlxcel.http import serve

    def png(seed: int) -> str:
        pixels = np.random.default_rng(seed).integers(0, 256, (40, 50, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def conversation(image: str) -> list[dict]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                             {"type": "text", "text": "what is on the screen?"}]},
                {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and the button?"}]

    config = EngineConfig(model_path=vision_fixture_path("llava"), prompt_cache=evolve_cache(disk_dir=tmp_path),
                          scheduler=SchedulerConfig(prefill_step_size=512, device_warmup=False))

    async def serving(requests: list[dict], *, wait_writes: bool = False) -> tuple[list, dict]:
        async with trio.open_nursery() as nursery:
            engine = await nursery.start(run_engine, config)
            (base_url,) = await nursery.start(partial(serve, engine, loopback()))
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
            replies = []
            for request in requests:
                replies.append(await trio.to_thread.run_sync(partial(
                    client.chat.completions.create, model=engine.model_id, temperature=0, max_tokens=3,
                    logprobs=True, top_logprobs=3, **request)))
            if wait_writes:
                await wait_for_writes(engine, 1)
            stats = await engine.cache_stats()
            client.close()
            nursery.cancel_scope.cancel()
        return replies, stats

    screenshot = png(1)
    (first,), _stats = await serving([dict(messages=conversation(screenshot)[:2])], wait_writes=True)
    assert has_pieces(tmp_path)
    follow_up = conversation(screenshot)
    (resumed, other, cold), stats = await serving([
        dict(messages=follow_up), dict(messages=conversation(png(2))),
        dict(messages=follow_up, extra_body={"cache_prompt": False})])
    assert stats["disk"]["hits"] == 1
    # The image's tokens and the first turn's prompt (to its last whole block) come from disk.
    assert resumed.usage.prompt_tokens_details.cached_tokens >= (first.usage.prompt_tokens // 16) * 16 - 16
    assert other.usage.prompt_tokens_details.cached_tokens == 0  # another image: another fingerprint
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    hot = {item.token: item.logprob for item in resumed.choices[0].logprobs.content[0].top_logprobs}
    reference = {item.token: item.logprob for item in cold.choices[0].logprobs.content[0].top_logprobs}
    assert hot.keys() == reference.keys()
    assert max(abs(hot[token] - value) for token, value in reference.items()) < 1e-4


async def test_a_disk_hit_rides_its_start_with_no_message_of_its_own(tmp_path: Path, monkeypatch) -> None:
    """The read is a field of the start's plan: the device gets steps only, the hit starts in the step that reads it."""
    from mlxcel.actors import device as device_actor
    from mlxcel.actors.messages import RunStep

    received: list[object] = []
    receive = device_actor.DeviceActor._receive

    def counting(self, disk):
        message = receive(self, disk)
        if message is not None and message is not device_actor._INBOX_ENDED:
            received.append(message)
        return message

    monkeypatch.setattr(device_actor.DeviceActor, "_receive", counting)
    config = make_engine_config(prompt_cache=evolve_cache(disk_dir=tmp_path))
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Open the first file."}]
    async with open_engine(config) as engine:
        first = await engine.chat(turn(history))
        await wait_for_writes(engine, 1)
    # Turn 1's pieces went to the device inside step plans, not as messages of their own.
    assert {type(message).__name__ for message in received} == {"UseDiskTier", "RunStep"}
    assert any(message.plan.disk_writes for message in received if isinstance(message, RunStep))
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Now the second."}]

    async with open_engine(config) as engine:
        received.clear()
        resumed = await engine.chat(turn(history))
        steps = [message for message in received if isinstance(message, RunStep)]
        assert {type(message).__name__ for message in received} == {"RunStep"}
        cold = await engine.chat(turn(history, cache=CacheOptions(cache_prompt=False)))
        disk = (await engine.cache_stats())["disk"]
    reading = [step for step in steps if any(start.disk_read is not None for start in step.plan.starts)]
    # One start, in the step that read its KV: no step before it asked for the read, none after placed it again.
    assert len(reading) == 1
    assert [step for step in steps if step.plan.starts] == reading
    assert disk["hits"] == 1
    assert resumed.usage.cached_tokens > 256
    assert resumed.text == cold.text
