"""The body-size limit at the HTTP edge, as a client on a kept-alive connection sees it.

Found by the fuzz test (tests/reliability/test_rel_fuzz.py): a request that is
refused before its body is read leaves the connection stuck when the body was
larger than hypercorn's receive buffer.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

MAX_BODY_BYTES = 64 << 10
SMALL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
# Three times the limit: larger than what hypercorn buffers for an unread body.
BIG = json.dumps({**SMALL, "pad": "x" * (3 * MAX_BODY_BYTES)}).encode()
HEADERS = {"content-type": "application/json"}


def small_then_refused_then_small(base_url: str, headers: dict[str, str]) -> tuple[int, int, int | str]:
    """Three requests on one kept-alive connection; the third may time out."""
    with httpx.Client(base_url=base_url, timeout=4, headers=headers) as client:
        first = client.post("/v1/chat/completions", json=SMALL).status_code
        refused = client.post("/v1/chat/completions", content=BIG, headers=HEADERS).status_code
        try:
            after = client.post("/v1/chat/completions", json=SMALL).status_code
        except httpx.TimeoutException:
            after = "timeout"
    return first, refused, after


async def test_connection_still_serves_after_a_declared_oversize_body(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    outcome = await trio.to_thread.run_sync(small_then_refused_then_small, base_url, {})
    assert outcome == (200, 413, 200)


async def test_connection_still_serves_after_a_401_with_a_large_body(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=16 * MAX_BODY_BYTES, api_key="k")

    def run() -> tuple[int, int, int | str]:
        with httpx.Client(base_url=base_url, timeout=10) as client:
            good = {"Authorization": "Bearer k"}
            first = client.post("/v1/chat/completions", json=SMALL, headers=good).status_code
            refused = client.post("/v1/chat/completions", content=BIG, headers=HEADERS).status_code
            try:
                after = client.post("/v1/chat/completions", json=SMALL, headers=good).status_code
            except httpx.TimeoutException:
                after = "timeout"
        return first, refused, after

    assert await trio.to_thread.run_sync(run) == (200, 401, 200)


async def test_a_client_that_asks_to_close_is_not_affected(start_engine, start_server) -> None:
    """Control for the tests above: with `Connection: close` every request gets a fresh connection."""
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    outcome = await trio.to_thread.run_sync(small_then_refused_then_small, base_url, {"Connection": "close"})
    assert outcome == (200, 413, 200)


async def test_a_chunked_body_is_refused_once_it_passes_the_limit(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_body_bytes=MAX_BODY_BYTES)
    parts = urlsplit(base_url)

    def send_without_ending() -> bytes:
        # Just past the limit in chunks, then silence: the end of the body never comes.
        with socket.create_connection((parts.hostname, parts.port), timeout=3) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            chunk = b"x" * 8192
            try:
                for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
                    sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused and closed while the rest was on its way: the reply is already sent
            try:
                return sock.recv(200)
            except TimeoutError:
                return b"timeout"

    reply = await trio.to_thread.run_sync(send_without_ending)
    assert reply.startswith(b"HTTP/1.1 413"), reply
