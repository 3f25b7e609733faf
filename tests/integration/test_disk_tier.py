"""The disk tier end to end on the llama fixture: a conversation survives closing the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxcel import ChatRequest, SamplingParams
from mlxcel.engine import open_engine
from mlxcel.types import CacheOptions
from tests.support import evolve_cache, make_engine_config, wait_until

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
        written = await wait_for_writes(engine, 2)
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
