"""API keys: who may call what, and a refused request leaves no trace."""

from __future__ import annotations

import httpx
import pytest

CHAT = {"messages": [{"role": "system", "content": "rules " * 60}, {"role": "user", "content": "hi"}],
        "max_tokens": 2, "temperature": 0}


@pytest.fixture
async def keyed_server(start_engine, start_server):
    engine = await start_engine()
    base_url = await start_server(engine, metrics=True, api_key="user-key", admin_api_key="admin-key")
    return engine, base_url


async def test_requests_without_the_key_get_401_and_leave_no_trace(keyed_server) -> None:
    engine, base_url = keyed_server
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "user-key"}):
            response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status_code == 401
        assert (await client.get("/health")).status_code == 200
    stats = await engine.cache_stats()
    assert stats["entries"] == 0 and stats["hits"] == 0 and stats["misses"] == 0
    assert (await engine.scheduler_stats()).num_completed == 0


async def test_the_user_key_serves_and_the_admin_key_guards_admin_routes(keyed_server) -> None:
    engine, base_url = keyed_server
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        ok = await client.post("/v1/chat/completions", json=CHAT, headers=user)
        assert ok.status_code == 200
        assert (await client.get("/v1/cache/stats", headers=user)).status_code == 200
        assert (await client.post("/v1/cache/reset", headers=user)).status_code == 401
        assert (await client.get("/metrics", headers=user)).status_code == 401
        assert (await client.get("/metrics", headers=admin)).status_code == 200
        before = (await client.get("/v1/cache/stats", headers=user)).json()
        assert before["entries"] >= 1 and before["bytes"] > 0
        reset = await client.post("/v1/cache/reset", headers=admin)
        assert reset.status_code == 200
        assert reset.json()["entries_freed"] == before["entries"] and reset.json()["bytes_freed"] == before["bytes"]
