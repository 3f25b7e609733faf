"""Graceful shutdown through the real CLI: `mlxcel serve` in a subprocess, then SIGTERM.

With a long grace period an in-flight stream finishes normally while new
connections are refused; with a short one a long generation is cut off and the
process still exits promptly. Either way the exit status is 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from mlxcel.fixtures import fixture_path
from tests.support import REPO, STARTUP_SECONDS, free_port, mlxcel_serve

pytestmark = pytest.mark.slow


class StreamReader(threading.Thread):
    """Reads one streaming chat request in a thread, noting when the first chunk arrived."""

    def __init__(self, base_url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.first_chunk = threading.Event()
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", f"{self.base_url}/v1/chat/completions", json=body, timeout=120) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first_chunk.set()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            self.first_chunk.set()


def connection_refused(base_url: str) -> bool:
    try:
        httpx.get(f"{base_url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.TransportError:
        return False
    return False


def run_in_thread(function):
    """Blocking subprocess work runs off the Trio thread."""
    import trio

    return trio.to_thread.run_sync(function)


async def test_sigterm_lets_the_in_flight_stream_finish_then_exits_0() -> None:
    def scenario() -> None:
        with mlxcel_serve("--shutdown-grace-seconds", "20") as (process, base_url):
            # Long enough to outlast the listener's close even with decode steps planned ahead.
            reader = StreamReader(base_url, max_tokens=600)
            reader.start()
            assert reader.first_chunk.wait(60)
            assert reader.error is None
            assert reader.status == 200
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            # New connections are refused while the stream is still going.
            deadline = signalled + 5
            while not connection_refused(base_url):
                assert time.monotonic() < deadline, "still accepting connections 5 s after SIGTERM"
                time.sleep(0.05)
            refused_while_streaming = reader.is_alive()
            reader.join(60)
            assert not reader.is_alive()
            assert reader.error is None, reader.error
            assert reader.events[-1] == "[DONE]", reader.events[-3:]
            chunks = [json.loads(event) for event in reader.events[:-1]]
            finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
            assert finishes in (["length"], ["stop"])
            usage = chunks[-1]["usage"]
            assert usage["completion_tokens"] == 600 or finishes == ["stop"]
            status = process.wait(timeout=20)
            exited_after = time.monotonic() - signalled
            assert status == 0
            assert exited_after < 20
            assert refused_while_streaming, "the stream ended before the listener closed; raise max_tokens"

    await run_in_thread(scenario)


async def test_a_short_grace_cancels_a_long_generation_and_exits_promptly() -> None:
    def scenario() -> None:
        with mlxcel_serve("--shutdown-grace-seconds", "1") as (process, base_url):
            reader = StreamReader(base_url, max_tokens=4000)
            reader.start()
            assert reader.first_chunk.wait(60)
            assert reader.status == 200
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=15)
            exited_after = time.monotonic() - signalled
            reader.join(15)
            assert status == 0
            assert exited_after < 10, exited_after
            # The stream was cut off mid-generation: the connection closed with no [DONE].
            assert not reader.is_alive()
            assert reader.events
            assert "[DONE]" not in reader.events
            assert len(reader.events) < 4000

    await run_in_thread(scenario)


async def test_sigint_when_idle_exits_0() -> None:
    def scenario() -> None:
        with mlxcel_serve("--shutdown-grace-seconds", "5") as (process, base_url):
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=15) == 0
            assert connection_refused(base_url)

    await run_in_thread(scenario)


async def test_sigterm_closes_an_idle_kept_alive_connection_at_once() -> None:
    from tests.reliability.test_rel_connections import HEALTH, read_response

    def scenario() -> None:
        with mlxcel_serve("--shutdown-grace-seconds", "20") as (process, base_url):
            host, port = base_url.removeprefix("http://").split(":")
            with socket.create_connection((host, int(port)), timeout=10) as idle:
                idle.sendall(HEALTH)
                assert read_response(idle)[0] == 200
                signalled = time.monotonic()
                process.send_signal(signal.SIGTERM)
                # The kept-alive connection is closed, not served, during the drain.
                assert idle.recv(1) == b""
                assert process.wait(timeout=20) == 0
                # Before: the idle connection held the process for the whole 20 s grace.
                assert time.monotonic() - signalled < 10

    await run_in_thread(scenario)


async def test_health_answers_while_the_model_loads_then_turns_200() -> None:
    def scenario() -> None:
        port = free_port()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
        process = subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", "-m", str(fixture_path("llama")), "--port", str(port)],
            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        try:
            statuses: list[int] = []
            deadline = time.monotonic() + STARTUP_SECONDS
            while 200 not in statuses:
                assert time.monotonic() < deadline
                assert process.poll() is None
                try:
                    response = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                    if response.status_code == 503:
                        assert response.json() == {"status": "loading"}
                    statuses.append(response.status_code)
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
            # The port answered before the engine was ready (the model load takes over a second).
            assert statuses[0] == 503, statuses[:3]
        finally:
            process.kill()
            process.wait(timeout=10)

    await run_in_thread(scenario)


async def test_sigterm_exits_promptly_while_a_grammar_compiles() -> None:
    """Issue 33: with grammars compiling (the first builds llguidance's tokenizer tables, seconds on
    2 cores; each schema of 2,000 required properties adds more), SIGTERM still ends the process within
    the grace period; before, compiles held worker threads that shutdown could not cancel and it needed
    SIGKILL. (Strict tools of that size are refused for the context before any compile starts, so the
    grammars come as response formats, which are not rendered into the prompt.)"""

    def body(variant: int) -> dict[str, object]:
        names = [f"v{variant}p{i}" for i in range(2000)]
        schema = {"type": "object", "properties": {name: {"type": "integer"} for name in names}, "required": names}
        return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}

    def scenario() -> None:
        with mlxcel_serve("-m", str(fixture_path("llama")), "--shutdown-grace-seconds", "2",
                          "--grammar-timeout", "300") as (process, base_url):
            outcome: list[object] = []

            def post(variant: int) -> None:
                try:
                    outcome.append(httpx.post(f"{base_url}/v1/chat/completions", json=body(variant),
                                              timeout=120).status_code)
                except httpx.HTTPError as error:
                    outcome.append(type(error).__name__)

            senders = [threading.Thread(target=post, args=(variant,), daemon=True) for variant in range(4)]
            for sender in senders:
                sender.start()
            time.sleep(0.5)
            # Still in flight: none has had its grammar compiled and its reply sent.
            assert all(sender.is_alive() for sender in senders), outcome
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            status = process.wait(timeout=30)
            assert status == 0
            assert time.monotonic() - signalled < 12
            for sender in senders:
                sender.join(10)
            # Each was answered or cut off by the shutdown; none got a grammar error.
            assert 400 not in outcome, outcome
            assert 500 not in outcome, outcome

    await run_in_thread(scenario)
