"""API keys: who may call what, and a refused request leaves no trace."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow

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
    assert stats["entries"] == 0
    assert stats["hits"] == 0
    assert stats["misses"] == 0
    assert (await engine.scheduler_stats()).num_completed == 0


async def test_the_user_key_serves_and_the_admin_key_guards_admin_routes(keyed_server) -> None:
    engine, base_url = keyed_server
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        ok = await client.post("/v1/chat/completions", json=CHAT, headers=user)
        assert ok.status_code == 200
        # The stats count every tenant's reuse, so they are the admin's too.
        assert (await client.get("/v1/cache/stats", headers=user)).status_code == 401
        assert (await client.post("/v1/cache/reset", headers=user)).status_code == 401
        assert (await client.get("/metrics", headers=user)).status_code == 401
        assert (await client.get("/metrics", headers=admin)).status_code == 200
        before = (await client.get("/v1/cache/stats", headers=admin)).json()
        assert before["entries"] >= 1
        assert before["bytes"] > 0
        reset = await client.post("/v1/cache/reset", headers=admin)
        assert reset.status_code == 200
        assert reset.json()["entries_freed"] == before["entries"]
        assert reset.json()["bytes_freed"] == before["bytes"]


async def test_admin_routes_need_the_admin_key_whatever_the_spelling_of_the_path(keyed_server) -> None:
    _, base_url = keyed_server
    user = {"Authorization": "Bearer user-key"}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        for path in ("/v1//cache/reset", "/v1/cache//reset", "/v1/models/../cache/reset", "/v1/./cache/reset"):
            response = await client.post(path, headers=user)
            assert response.status_code == 401, path
            assert response.json()["error"]["code"] == "invalid_api_key"


async def test_two_authorization_headers_are_refused(keyed_server) -> None:
    engine, base_url = keyed_server
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        headers = [("Authorization", "Bearer user-key"), ("Authorization", "Bearer admin-key")]
        response = await client.post("/v1/cache/reset", headers=headers)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "duplicate_authorization"
        response = await client.post("/v1/chat/completions", json=CHAT, headers=list(reversed(headers)))
        assert response.status_code == 400
    assert (await engine.scheduler_stats()).num_completed == 0


@pytest.fixture
async def keyless_server(start_engine, start_server):
    engine = await start_engine()
    return engine, await start_server(engine, metrics=True)


async def test_a_keyless_server_refuses_what_a_web_page_could_send(keyless_server) -> None:
    engine, base_url = keyless_server
    port = base_url.rsplit(":", 1)[1]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        # DNS rebinding: a page on evil.example whose name now resolves to 127.0.0.1.
        rebound = await client.post("/v1/chat/completions", json=CHAT, headers={"Host": f"evil.example:{port}"})
        assert rebound.status_code == 403
        assert rebound.json()["error"]["code"] == "untrusted_host"
        # A cross-site fetch, and a form post that needs no CORS preflight.
        cross = await client.post("/v1/cache/reset", headers={"Origin": "https://evil.example"})
        assert cross.status_code == 403
        assert cross.json()["error"]["code"] == "untrusted_origin"
        form = await client.post("/v1/chat/completions", content=b'{"messages": []}',
                                 headers={"Content-Type": "text/plain"})
        assert form.status_code == 415
        assert "application/json" in form.json()["error"]["message"]
        assert (await engine.scheduler_stats()).num_completed == 0
        # What a local client sends still works, under any loopback name.
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            ok = await client.post("/v1/chat/completions", json=CHAT,
                                   headers={"Host": host, "Origin": f"http://{host}"})
            assert ok.status_code == 200, host
        assert (await client.post("/v1/cache/reset")).status_code == 200


async def test_http_level_errors_have_json_bodies(keyless_server, monkeypatch) -> None:
    engine, base_url = keyless_server

    async def broken() -> None:
        raise RuntimeError("a bug, not the client's fault")

    monkeypatch.setattr(engine, "cache_stats", broken)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        failed = await client.get("/v1/cache/stats")
        assert failed.status_code == 500
        assert failed.json()["error"] == {"message": "internal server error", "type": "server_error",
                                          "param": None, "code": "internal_error"}
        for response in (await client.get("/nope"), await client.delete("/v1/models")):
            assert response.headers["content-type"].startswith("application/json")
            assert response.json()["error"]["code"] in ("not_found", "method_not_allowed")
        # The server is still up.
        assert (await client.get("/health")).status_code == 200


async def test_the_access_log_names_the_request_but_never_its_prompt(start_engine, start_server, caplog) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, access_log=True)
    secret = "the launch code is 7431"
    with caplog.at_level("INFO", logger="mlxcel.access"):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            body = {"messages": [{"role": "user", "content": secret}], "max_tokens": 2}
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
            assert (await client.get("/nope")).status_code == 404
    lines = [record.getMessage() for record in caplog.records if record.name == "mlxcel.access"]
    assert any("POST /v1/chat/completions 200" in line for line in lines), lines
    assert any("GET /nope 404" in line for line in lines), lines
    assert not any(secret in line or "7431" in line for line in lines)


async def test_without_the_access_log_nothing_is_logged_per_request(keyless_server, caplog) -> None:
    _, base_url = keyless_server
    with caplog.at_level("INFO", logger="mlxcel.access"):
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            assert (await client.get("/v1/models")).status_code == 200
    assert not [record for record in caplog.records if record.name == "mlxcel.access"]
