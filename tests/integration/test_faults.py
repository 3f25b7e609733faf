"""Faults: a device step that fails, and what the rest of the server does about it."""

from __future__ import annotations

import httpx
import trio

CHAT = {"messages": [{"role": "user", "content": "hello " * 40}], "max_tokens": 8, "temperature": 0}


async def test_failed_step_fails_its_request_and_the_server_keeps_serving(start_engine, start_server) -> None:
    # Step 1 admits and prefills, step 2 decodes: fail the third step, mid-generation.
    engine = await start_engine(fail_step=3)
    base_url = await start_server(engine)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        failed = await client.post("/v1/chat/completions", json=CHAT)
        assert failed.status_code == 500, failed.text
        error = failed.json()["error"]
        assert error["code"] == "generation_failed" and "injected fault" in error["message"]
        stats = await engine.scheduler_stats()
        assert stats.num_failed == 1 and stats.num_running == 0 and stats.num_completed == 0
        cache = await engine.cache_stats()
        assert cache["entries"] == 0, "a failed sequence must not be donated"
        ok = await client.post("/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert (await engine.scheduler_stats()).num_completed == 1


async def test_failed_step_mid_stream_ends_the_stream_with_an_error(start_engine, start_server) -> None:
    engine = await start_engine(fail_step=4)
    base_url = await start_server(engine)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as stream:
            assert stream.status_code == 200
            lines = [line async for line in stream.aiter_lines() if line.startswith("data: ")]
        assert any('"generation_failed"' in line for line in lines)
        assert lines[-1] == "data: [DONE]"
        health = await client.get("/health")
        assert health.status_code == 200


async def test_other_requests_in_a_failed_batch_fail_cleanly(start_engine) -> None:
    from mlxcel import ChatRequest, InvalidRequest, SamplingParams

    engine = await start_engine(fail_step=5)
    outcomes = []

    async def one(index: int) -> None:
        request = ChatRequest(
            messages=({"role": "user", "content": f"request {index}"},),
            sampling=SamplingParams(temperature=0.0, max_tokens=20),
        )
        try:
            outcomes.append((await engine.chat(request)).finish_reason)
        except InvalidRequest as error:
            outcomes.append(error.status)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for index in range(4):
                nursery.start_soon(one, index)
    assert len(outcomes) == 4 and 500 in outcomes
    assert all(outcome in (500, "length", "stop") for outcome in outcomes)
    stats = await engine.scheduler_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert (await engine.cache_stats())["entries"] == sum(1 for o in outcomes if o != 500)
