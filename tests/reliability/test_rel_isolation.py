"""Tenant isolation in the prompt cache: `cache_salt` and `--prompt-cache-cross-session=false`.

Every check goes through HTTP and reads `usage.prompt_tokens_details.cached_tokens`,
the figure a tenant could also infer from timing.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.support import evolve_cache

pytestmark = pytest.mark.slow

SYSTEM = "You are the support assistant of a large company. " + " ".join(
    f"Policy {i}: answer clearly and cite rule {i * 3}." for i in range(40)
)


def chat(question: str, **fields: Any) -> dict[str, Any]:
    return {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 2,
        "temperature": 0,
        **fields,
    }


async def cached_tokens(client: httpx.AsyncClient, body: dict[str, Any]) -> int:
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 300
    return usage["prompt_tokens_details"]["cached_tokens"]


async def cached_tokens_at_once(client: httpx.AsyncClient, bodies: list[dict[str, Any]]) -> list[int]:
    """Send the bodies concurrently; their cached_tokens in the same order."""
    results = [0] * len(bodies)

    async def one(index: int) -> None:
        results[index] = await cached_tokens(client, bodies[index])

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for index in range(len(bodies)):
                nursery.start_soon(one, index)
    return results


@pytest.fixture
async def serve(start_engine, start_server):
    clients: list[httpx.AsyncClient] = []

    async def start(**engine_changes: Any) -> tuple[Any, httpx.AsyncClient]:
        engine = await start_engine(**engine_changes)
        client = httpx.AsyncClient(base_url=await start_server(engine), timeout=60)
        clients.append(client)
        return engine, client

    yield start
    # Closed while the server still runs, so no pooled connection is left to the collector.
    for client in clients:
        await client.aclose()


# --- cache_salt -------------------------------------------------------------------


async def test_two_salts_never_share_a_hit(serve) -> None:
    engine, client = await serve()
    async with client:
        assert await cached_tokens(client, chat("first", cache_salt="tenant-a")) == 0
        # Same salt, root or extra_body: a hit on the shared system prompt.
        assert await cached_tokens(client, chat("second", cache_salt="tenant-a")) >= 300
        assert await cached_tokens(client, chat("third", extra_body={"cache_salt": "tenant-a"})) >= 300
        # Another salt, root or extra_body, and no salt at all: nothing.
        assert await cached_tokens(client, chat("first", cache_salt="tenant-b")) == 0
        assert await cached_tokens(client, chat("fourth", extra_body={"cache_salt": "tenant-c"})) == 0
        assert await cached_tokens(client, chat("fifth")) == 0
        # The same conversation a tenant-a request stored, under another salt: still nothing.
        assert await cached_tokens(client, chat("second", cache_salt="tenant-d")) == 0
        # The root value wins over extra_body.
        assert await cached_tokens(
            client, chat("sixth", cache_salt="tenant-e", extra_body={"cache_salt": "tenant-a"})) == 0
        # The salted tenants each hit their own entries.
        assert await cached_tokens(client, chat("again", cache_salt="tenant-b")) >= 300
    stats = await engine.cache_stats()
    assert stats["entries"] >= 5


async def test_salts_share_nothing_in_flight_either(serve) -> None:
    """Concurrent identical prompts under distinct salts: no in-flight prefix sharing between them."""
    _engine, client = await serve()
    async with client:
        salted = [chat("same question", cache_salt=f"tenant-{index}") for index in range(4)]
        assert await cached_tokens_at_once(client, salted) == [0, 0, 0, 0]
        # Control: the same four requests under one (new) salt do share a prefill in flight.
        shared = await cached_tokens_at_once(client, [chat("same question", cache_salt="tenant-z")] * 4)
    assert any(shared), shared


# --- cross-session lookups ----------------------------------------------------------


@pytest.mark.parametrize("session_field", ["user", "prompt_cache_key", "extra_body.prompt_cache_key"])
async def test_with_cross_session_off_a_second_user_never_hits_the_first_users_entry(
    serve, session_field: str
) -> None:
    engine, client = await serve(prompt_cache=evolve_cache(cross_session=False))

    def as_user(name: str, question: str) -> dict[str, Any]:
        if session_field == "extra_body.prompt_cache_key":
            return chat(question, extra_body={"prompt_cache_key": name})
        return chat(question, **{session_field: name})

    async with client:
        assert await cached_tokens(client, as_user("alice", "first")) == 0
        assert await cached_tokens(client, as_user("bob", "first")) == 0
        assert await cached_tokens(client, as_user("carol", "other")) == 0
        # The anonymous session is a session of its own.
        assert await cached_tokens(client, chat("anonymous")) == 0
        # Each user still hits their own entries.
        assert await cached_tokens(client, as_user("alice", "second")) >= 300
        assert await cached_tokens(client, as_user("bob", "second")) >= 300
    stats = await engine.cache_stats()
    assert stats["hits"] == 2


async def test_with_cross_session_off_nothing_is_shared_in_flight(serve) -> None:
    _engine, client = await serve(prompt_cache=evolve_cache(cross_session=False))
    async with client:
        users = [chat("same question", user=f"user-{index}") for index in range(4)]
        assert await cached_tokens_at_once(client, users) == [0, 0, 0, 0]


async def test_with_cross_session_on_a_second_user_hits_the_first_users_entry(serve) -> None:
    """The control: the default lets users share a common system prompt."""
    _engine, client = await serve()
    async with client:
        assert await cached_tokens(client, chat("first", user="alice")) == 0
        assert await cached_tokens(client, chat("first", user="bob")) >= 300
        assert await cached_tokens(client, chat("other", prompt_cache_key="carol")) >= 300
