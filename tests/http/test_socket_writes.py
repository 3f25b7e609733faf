"""Streamed events are written to the socket at once when they fit, hypercorn's awaited path otherwise.

``write_now`` against real socket pairs (what fits, a full buffer, a closed or
gone peer), then a real server streaming a reply far larger than the socket's
buffer to a client that reads late: every byte arrives, in order.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import trio

from mlxcel.http.serve import write_now
from mlxcel.types import Delta
from tests.fakes import FAKE_MODEL_ID, FakeEngine, finish


def _stream_pair() -> tuple[trio.SocketStream, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return trio.SocketStream(trio.socket.from_stdlib_socket(ours)), theirs


async def test_what_fits_is_written_at_once_and_a_full_buffer_takes_part_or_nothing() -> None:
    stream, peer = _stream_pair()
    with peer:
        assert write_now(stream, b"data: one\n\n") == 11
        assert peer.recv(100) == b"data: one\n\n"
        big = bytes(range(256)) * 4096  # 1 MiB: far past the buffer
        written = write_now(stream, big)
        assert 0 < written < len(big)
        assert write_now(stream, big[written:]) == 0  # full now: nothing, and no exception
        received = b""
        while len(received) < written:
            received += peer.recv(1 << 20)
        assert received == big[:written]
        await stream.aclose()
        assert write_now(stream, b"late") == 0  # closed: fileno() is -1


async def test_a_peer_that_went_away_gets_nothing_written_and_no_exception() -> None:
    stream, peer = _stream_pair()
    peer.close()
    assert write_now(stream, b"data: x\n\n" * 10) in (0, 90)  # the kernel may take one write before the reset
    assert write_now(stream, b"data: x\n\n") == 0
    await stream.aclose()
    assert write_now(object(), b"no socket") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_reply_larger_than_the_socket_buffer_reaches_a_late_reader_whole(start_server, monkeypatch,
                                                                                 path: str) -> None:
    import sys

    serving = sys.modules["mlxcel.http.serve"]  # the package's `serve` is the function of that name
    short: list[int] = []

    def recording(stream: object, data: bytes) -> int:
        written = write_now(stream, data)
        if written < len(data):
            short.append(written)
        return written

    monkeypatch.setattr(serving, "write_now", recording)
    pieces = [f"{index:05d}" + "x" * 2000 for index in range(1500)]  # ~3 MB of events
    engine = FakeEngine([Delta(text=piece, token_ids=(1,)) for piece in pieces] + [finish("stop")])
    base_url = await start_server(engine)
    body = {"model": FAKE_MODEL_ID, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}],
            "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client, client.stream(
            "POST", path, json=body) as response:
        assert response.status_code == 200
        await trio.sleep(0.3)  # the server fills the socket's buffer meanwhile
        text = (await response.aread()).decode()
    payloads = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    if path == "/v1/chat/completions":
        streamed = "".join(choice["delta"].get("content") or "" for event in payloads for choice in event["choices"])
    else:
        streamed = "".join(event["delta"].get("text", "") for event in payloads
                           if event["type"] == "content_block_delta")
    assert streamed == "".join(pieces)
    assert short  # some writes did not fit and went hypercorn's awaited way


async def test_streamed_chunks_skip_h11_and_an_http10_reply_keeps_its_framing(start_server, monkeypatch) -> None:
    # Each streamed token is one chunk: on HTTP/1.1 it is framed and written without h11 (h11 sends the head
    # and the end); an HTTP/1.0 client gets a close-delimited body that h11 writes, unframed.
    import h11

    sent: list[str] = []
    original = h11.Connection.send

    def counting(self: h11.Connection, event: object) -> bytes | None:
        if self.our_role is h11.SERVER:  # httpx, in this process, sends with h11 too
            sent.append(type(event).__name__)
        return original(self, event)

    monkeypatch.setattr(h11.Connection, "send", counting)
    pieces = [f"piece {index}" for index in range(40)]
    engine = FakeEngine([Delta(text=piece, token_ids=(1,)) for piece in pieces] + [finish("stop")])
    base_url = await start_server(engine)
    body = {"model": FAKE_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        response = await client.post("/v1/chat/completions", json=body)
    payloads = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    assert "".join(event["choices"][0]["delta"].get("content") or "" for event in payloads) == "".join(pieces)
    assert response.text.endswith("data: [DONE]\n\n")
    assert sorted(sent) == ["EndOfMessage", "Response"]

    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.0\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                          + f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
    raw = b""
    while chunk := await stream.receive_some(65536):
        raw += chunk
    await stream.aclose()
    head, _, reply = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    events = [json.loads(line[6:]) for line in reply.decode().splitlines() if line.startswith("data: {")]
    assert "".join(event["choices"][0]["delta"].get("content") or "" for event in events) == "".join(pieces)
