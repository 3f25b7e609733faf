"""Slow bodies against a real server (issue 33, item 5).

Found by hostile testing: 2,100 connections that sent their bodies a byte at a
time for 120 s made 10 of 13 normal requests beside them time out on the
keyless default. A trickling socket is never idle, so the cap's "close the
longest-idle" never found room. Now a connection whose body is still arriving
is what makes room (the one that has waited longest), each client address
holds a bounded share when no key tells clients apart, and the whole body must
arrive within --body-timeout.
"""

from __future__ import annotations

import time

import attrs
import httpx
import pytest
import trio

from tests.reliability.test_rel_connections import address

pytestmark = pytest.mark.slow

NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
SLOW_HEAD = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Content-Length: 100000\r\n\r\n")


@attrs.define
class FloodTally:
    num_opened: int = 0
    num_closed_by_server: int = 0
    num_open: int = 0
    most_open: int = 0


async def trickle(host: str, port: int, tally: FloodTally, stop: trio.Event, interval: float = 0.5) -> None:
    """One slow-body client: a byte of body every ``interval`` s; when the server closes it, it reconnects."""
    while not stop.is_set():
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            await trio.sleep(0.05)
            continue
        tally.num_opened += 1
        tally.num_open += 1
        tally.most_open = max(tally.most_open, tally.num_open)
        try:
            await stream.send_all(SLOW_HEAD)
            while not stop.is_set():
                await stream.send_all(b" ")
                with trio.move_on_after(interval):
                    await stream.receive_some(1024)  # an answer (408) or the close: this client is done
                    tally.num_closed_by_server += 1
                    break
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            tally.num_closed_by_server += 1
        finally:
            tally.num_open -= 1
            await stream.aclose()


async def normal_requests(base_url: str, count: int, request_timeout: float) -> list[float | None]:
    """Each on a fresh connection, as a new client would come: its seconds, or None when it failed."""
    outcomes: list[float | None] = []
    for _ in range(count):
        started = time.monotonic()
        try:
            async with httpx.AsyncClient(base_url=base_url, timeout=request_timeout) as client:
                response = await client.post("/v1/chat/completions", json=NORMAL)
            outcomes.append(time.monotonic() - started if response.status_code == 200 else None)
        except httpx.HTTPError:
            outcomes.append(None)
        await trio.sleep(0.05)
    return outcomes


async def flood_and_measure(base_url: str, *, num_slow: int, num_normal: int, request_timeout: float = 5.0,
                            ) -> tuple[list[float | None], FloodTally]:
    host, port = address(base_url)
    tally = FloodTally()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(num_slow):
            nursery.start_soon(trickle, host, port, tally, stop)
        await trio.sleep(1.0)  # the flood fills the cap
        outcomes = await normal_requests(base_url, num_normal, request_timeout)
        stop.set()
    return outcomes, tally


async def test_normal_requests_keep_succeeding_during_a_slow_body_flood(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_connections=48)
    with trio.fail_after(120):
        outcomes, tally = await flood_and_measure(base_url, num_slow=80, num_normal=20)
    succeeded = [seconds for seconds in outcomes if seconds is not None]
    assert len(succeeded) >= 19, (outcomes, tally)  # >= 95%; 0 of 20 before (each timed out)
    assert tally.num_closed_by_server > 0


async def test_one_address_holds_a_bounded_share_without_a_key(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine, max_connections=200, max_connections_per_client=16)
    host, port = address(base_url)
    tally = FloodTally()
    stop = trio.Event()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(40):
                nursery.start_soon(trickle, host, port, tally, stop)
            await trio.sleep(2.0)
            outcomes = await normal_requests(base_url, 5, 5.0)
            stop.set()
    assert all(seconds is not None for seconds in outcomes), outcomes
    # 40 clients from one address, 16 at a time: the rest were closed to make room.
    assert tally.num_closed_by_server >= 24, tally
