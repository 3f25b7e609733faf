"""Connections that hostile or careless clients leave behind, over raw sockets against a real server.

A reply sent before its request body arrived must not strand the connection,
``Connection: close`` must close, a never-finished body must neither hang nor
crash the server, the connection cap must make room for a newcomer, and while
the engine loads every route answers 503.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

import pytest
import trio

from mlxcel.http.serve import PendingEngine

TIMEOUT = 5.0


def address(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes] | None:
    """One response (status, lower-cased headers, body); None if the server closed first."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split(" ")[1]), headers, body


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def unread_body_then_follow_up(base_url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], str]:
    """Headers, a pause, the body; then GET /health on the same connection.

    Returns the first status and headers, and what became of the follow-up:
    "answered", or "closed" (allowed only after a reply that said Connection: close).
    A hang raises TimeoutError.
    """
    with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
        sock.sendall(head)
        time.sleep(0.05)  # the server sees the headers before the body, as with most clients
        sock.sendall(body)
        first = read_response(sock)
        assert first is not None, "closed before the first reply"
        status, headers, _ = first
        try:
            sock.sendall(HEALTH)
            follow_up = read_response(sock)
        except (BrokenPipeError, ConnectionResetError):
            follow_up = None
        if follow_up is None:
            assert headers.get("connection", "").lower() == "close", (status, headers)
            return status, headers, "closed"
        assert follow_up[0] == 200, follow_up
        return status, headers, "answered"


def post(path: str, body: bytes, *extra: bytes) -> bytes:
    return b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        path, len(body), b"".join(line + b"\r\n" for line in extra))


@pytest.fixture
async def base_url(start_engine, start_server) -> str:
    return await start_server(await start_engine())


@pytest.mark.parametrize(("head", "status"), [
    (post(b"/nope", b'{"model": "x"}'), 404),
    (post(b"/health", b'{"model": "x"}'), 405),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 14\r\n\r\n", 200),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 14\r\n\r\n", 200),
])
async def test_a_reply_before_the_body_arrived_keeps_the_connection_usable(base_url, head, status) -> None:
    result = await trio.to_thread.run_sync(unread_body_then_follow_up, base_url, head, b'{"model": "x"}')
    assert result[0] == status
    assert result[2] == "answered"


async def test_connection_close_from_the_client_is_honoured(base_url: str) -> None:
    def exchange() -> bool:
        with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_response(sock)[0] == 200
            return closed_by_server(sock)

    assert await trio.to_thread.run_sync(exchange)


async def test_a_never_finished_chunked_body_then_close_does_not_end_the_server(base_url: str) -> None:
    def abandon_then_ask() -> int:
        for path in (b"/v1/chat/completions", b"/nope", b"/health"):
            sockets = []
            for _ in range(4):
                sock = socket.create_connection(address(base_url), timeout=TIMEOUT)
                sock.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n" % path)
                sockets.append(sock)
            time.sleep(0.3)
            for sock in sockets:
                sock.close()
        time.sleep(0.3)
        with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
            sock.sendall(HEALTH)
            return read_response(sock)[0]

    assert await trio.to_thread.run_sync(abandon_then_ask) == 200


async def test_a_body_that_never_finishes_gets_408_and_the_connection_closes(start_engine, start_server) -> None:
    base_url = await start_server(await start_engine(), body_timeout=0.5)

    def stall() -> tuple[int, bool]:
        with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
            sock.sendall(post(b"/v1/chat/completions", b"x" * 100) + b'{"messages": ')
            response = read_response(sock)
            assert response is not None
            return response[0], closed_by_server(sock)

    status, closed = await trio.to_thread.run_sync(stall)
    assert status == 408 and closed


async def test_at_the_connection_cap_the_longest_idle_connection_makes_room(start_engine, start_server) -> None:
    base_url = await start_server(await start_engine(), max_connections=3)

    def hold_then_ask() -> tuple[int, bool]:
        held = [socket.create_connection(address(base_url), timeout=TIMEOUT) for _ in range(3)]
        try:
            for sock in held:
                sock.sendall(HEALTH)
                assert read_response(sock)[0] == 200
            with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
                sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status = read_response(sock)[0]
            return status, closed_by_server(held[0])
        finally:
            for sock in held:
                sock.close()

    status, oldest_closed = await trio.to_thread.run_sync(hold_then_ask)
    assert status == 200
    assert oldest_closed


async def test_while_the_engine_loads_routes_answer_503_then_200(nursery, start_engine) -> None:
    from functools import partial

    from mlxcel.http import serve

    pending = PendingEngine()
    binds = await nursery.start(partial(serve, pending, "127.0.0.1", 0))

    def ask(head: bytes) -> tuple[int, dict[str, str], dict]:
        with socket.create_connection(address(binds[0]), timeout=TIMEOUT) as sock:
            sock.sendall(head)
            status, headers, body = read_response(sock)
            # The same connection serves again: loading replies do not strand it either.
            sock.sendall(HEALTH)
            assert read_response(sock) is not None
            return status, headers, json.loads(body)

    status, headers, body = await trio.to_thread.run_sync(ask, HEALTH)
    assert (status, body) == (503, {"status": "loading"})
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    status, headers, body = await trio.to_thread.run_sync(ask, post(b"/v1/chat/completions", chat) + chat)
    assert status == 503 and headers["retry-after"] == "1"
    assert body["error"]["code"] == "model_loading" and body["error"]["type"] == "server_error"
    pending.set(await start_engine())
    status, _, body = await trio.to_thread.run_sync(ask, HEALTH)
    assert status == 200 and body["status"] == "ok"
