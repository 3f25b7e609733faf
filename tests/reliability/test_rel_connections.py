"""Connections that hostile or careless clients leave behind, over raw sockets against a real server.

A reply sent before its request body arrived must not strand the connection,
``Connection: close`` must close, a never-finished body must neither hang nor
crash the server, the connection cap must make room for a newcomer, and while
the engine loads every route answers 503.

Tests of the server's timers (the body deadline, the drain wait) serve a
FakeEngine and talk over Trio streams in the same run, on `autojump_clock`:
the real server code, on a clock that jumps instead of a guessed sleep.
"""

from __future__ import annotations

import json
import socket
import time
from functools import partial
from urllib.parse import urlsplit

import pytest
import trio
import trio.testing

from mlxcel.http.serve import PendingEngine, serve
from tests.fakes import FakeEngine
from tests.support import loopback

TIMEOUT = 5.0


def address(base_url: str) -> tuple[str, int]:
    parts = urlsplit(base_url)
    return parts.hostname or "127.0.0.1", parts.port or 80


Response = tuple[int, dict[str, str], bytes]


def _parse(data: bytes) -> Response | None:
    """The response in `data` (status, lower-cased headers, body), or None until all of it is there."""
    head, found, body = data.partition(b"\r\n\r\n")
    if not found:
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    if len(body) < int(headers.get("content-length", "0")):
        return None
    return int(lines[0].split(" ")[1]), headers, body


def read_response(sock: socket.socket) -> Response | None:
    """One response; None if the server closed first."""
    data = b""
    while (response := _parse(data)) is None:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    return response


async def receive_response(stream: trio.SocketStream) -> Response | None:
    """`read_response` over a Trio stream, for tests in which client and server share one clock."""
    data = b""
    while (response := _parse(data)) is None:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return None
        data += chunk
    return response


async def server_closed(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(1) == b""
    except trio.BrokenResourceError:
        return True


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def unread_body_then_follow_up(base_url: str, head: bytes, body: bytes) -> tuple[int, dict[str, str], str]:
    """Headers, a pause, the body; then GET /health on the same connection (the fuzz suite's probe).

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


@pytest.fixture
async def open_fake_server(nursery: trio.Nursery):
    """``await open_fake_server(**serve_options)`` -> a connect() to a real hypercorn over a FakeEngine.

    Client and server run in this test's Trio run, so with `autojump_clock` the
    server's timers (body deadline, drain wait) fire as soon as everything waits.
    """

    async def start(**options):
        (url,) = await nursery.start(partial(serve, FakeEngine(), loopback(**options)))
        host, port = address(url)
        return partial(trio.open_tcp_stream, host, port)

    return start


EARLY_REPLIES = [
    (post(b"/nope", b'{"model": "x"}'), 404),
    (post(b"/health", b'{"model": "x"}'), 405),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 14\r\n\r\n", 200),
    (b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 14\r\n\r\n", 200),
]


@pytest.mark.parametrize(("head", "status"), EARLY_REPLIES)
async def test_a_reply_before_the_body_arrived_keeps_the_connection_usable(
    open_fake_server, autojump_clock, head, status
) -> None:
    connect = await open_fake_server()
    async with await connect() as stream:
        await stream.send_all(head)
        # The server has the headers and waits for the body (the clock cannot jump while this waits).
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_all(b'{"model": "x"}')
        response = await receive_response(stream)
        assert response is not None
        assert response[0] == status
        assert response[1].get("connection", "").lower() != "close"
        await stream.send_all(HEALTH)
        follow_up = await receive_response(stream)
        assert follow_up is not None
        assert follow_up[0] == 200


@pytest.mark.parametrize(("head", "status"), EARLY_REPLIES)
async def test_a_reply_whose_small_body_never_comes_closes_the_connection(
    open_fake_server, autojump_clock, head, status
) -> None:
    connect = await open_fake_server()
    async with await connect() as stream:
        await stream.send_all(head)
        started = trio.current_time()
        response = await receive_response(stream)
        assert response is not None
        assert response[0] == status
        assert response[1]["connection"].lower() == "close"
        # After waiting DRAIN_SECONDS (1 s) for the body, not at once and not for the body deadline.
        assert 1.0 <= trio.current_time() - started < 60
        assert await server_closed(stream)


@pytest.mark.slow
async def test_connection_close_from_the_client_is_honoured(base_url: str) -> None:
    def exchange() -> bool:
        with socket.create_connection(address(base_url), timeout=TIMEOUT) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert read_response(sock)[0] == 200
            return closed_by_server(sock)

    assert await trio.to_thread.run_sync(exchange)


async def test_a_never_finished_chunked_body_then_close_does_not_end_the_server(open_fake_server) -> None:
    connect = await open_fake_server()
    for path in (b"/v1/chat/completions", b"/nope", b"/health"):
        streams = [await connect() for _ in range(4)]
        for stream in streams:
            await stream.send_all(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n" % path)
        await trio.testing.wait_all_tasks_blocked()  # every request is waiting for the rest of its body
        for stream in streams:
            await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()  # and every connection has seen its client go
    async with await connect() as stream:
        await stream.send_all(HEALTH)
        response = await receive_response(stream)
    assert response is not None
    assert response[0] == 200


async def test_a_body_that_never_finishes_gets_408_and_the_connection_closes(open_fake_server, autojump_clock) -> None:
    connect = await open_fake_server(body_timeout=60.0)
    async with await connect() as stream:
        await stream.send_all(post(b"/v1/chat/completions", b"x" * 100) + b'{"messages": ')
        started = trio.current_time()
        response = await receive_response(stream)
        assert response is not None
        assert response[0] == 408
        assert trio.current_time() - started == pytest.approx(60.0, abs=1.0)
        assert await server_closed(stream)


@pytest.mark.slow
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


@pytest.mark.slow
async def test_while_the_engine_loads_routes_answer_503_then_200(nursery, start_engine) -> None:
    pending = PendingEngine()
    binds = await nursery.start(partial(serve, pending, loopback()))

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
    assert status == 503
    assert headers["retry-after"] == "1"
    assert body["error"]["code"] == "model_loading"
    assert body["error"]["type"] == "server_error"
    pending.set(await start_engine())
    status, _, body = await trio.to_thread.run_sync(ask, HEALTH)
    assert status == 200
    assert body["status"] == "ok"
