"""LongRoPE: entries never cross the short/long RoPE regime, and each regime hits within itself."""

from __future__ import annotations

import pytest

from mlxcel import CacheOptions, ChatRequest, SamplingParams

pytestmark = pytest.mark.slow

SHORT_SYSTEM = "Base rules. " + " ".join(f"item{i}" for i in range(120))


def request(system: str, user: str) -> ChatRequest:
    return ChatRequest(
        messages=({"role": "system", "content": system}, {"role": "user", "content": user}),
        sampling=SamplingParams(temperature=0.0, max_tokens=3),
        cache=CacheOptions(session_key="s"),
    )


async def test_regimes_are_kept_apart_and_each_hits_within_itself(start_engine) -> None:
    engine = await start_engine("phi3-longrope")
    original = engine.model.family.longrope_original_max_positions
    assert original == 512
    short = await engine.chat(request(SHORT_SYSTEM, "first"))
    assert short.usage.prompt_tokens < original
    # Same prefix, but the whole prompt crosses the switch-over: the long regime.
    long_user = " ".join(f"detail{i}" for i in range(400))
    crossing = await engine.chat(request(SHORT_SYSTEM, long_user))
    assert crossing.usage.prompt_tokens > original
    assert crossing.usage.cached_tokens == 0
    # Within each regime, the stored prefix is reused.
    short_again = await engine.chat(request(SHORT_SYSTEM, "second"))
    assert short_again.usage.prompt_tokens < original
    assert short_again.usage.cached_tokens >= 200
    long_again = await engine.chat(request(SHORT_SYSTEM, long_user + " more"))
    assert long_again.usage.cached_tokens >= crossing.usage.prompt_tokens - 32
