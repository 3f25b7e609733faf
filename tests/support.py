"""Helpers shared by the tests (importable as ``tests.support``)."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig, ServerConfig
from mlxcel.fixtures import fixture_path

# A small budget keeps test memory low and skips the model-aware sizing.
TEST_CACHE = PromptCacheConfig(capacity_bytes=512 << 20)


def make_engine_config(family: str = "llama", **changes: Any) -> EngineConfig:
    prompt_cache = changes.pop("prompt_cache", TEST_CACHE)
    # The start-up warm-up is skipped (0.2 s per engine); test_engine covers it.
    scheduler = changes.pop("scheduler", SchedulerConfig(prefill_step_size=512, device_warmup=False))
    return EngineConfig(
        model_path=fixture_path(family), prompt_cache=prompt_cache, scheduler=scheduler, **changes
    )



async def wait_until(
    condition: Callable[[], object | Awaitable[object]], *, seconds: float = 30.0, interval: float = 0.02,
) -> Any:
    """Check ``condition`` (awaited when it is async) until it gives a true value, and return that value.

    For state with no event to wait on (an engine's statistics, a file, another
    thread's log); `trio.TooSlowError` after ``seconds``.
    """
    with trio.fail_after(seconds):
        while True:
            value = condition()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value
            await trio.sleep(interval)


def evolve_cache(**changes: Any) -> PromptCacheConfig:
    return attrs.evolve(TEST_CACHE, **changes)


def letter(token: int) -> str:
    return chr(ord("a") + token % 26)


class LetterDetokenizer:
    """Streams one letter per token; ``last_segment`` is the text added since the last read."""

    def __init__(self) -> None:
        self.text = ""
        self.tokens: list[int] = []
        self._offset = 0
        self.finalized = False

    def add_token(self, token: int) -> None:
        self.tokens.append(token)
        self.text += letter(token)

    def finalize(self) -> None:
        self.finalized = True

    @property
    def last_segment(self) -> str:
        segment = self.text[self._offset :]
        self._offset = len(self.text)
        return segment


class LetterTokenizer:
    """One letter per token id, for the scheduling core's output without a real tokenizer."""

    @property
    def detokenizer(self) -> LetterDetokenizer:
        return LetterDetokenizer()

    def decode(self, ids: list[int]) -> str:
        return "".join(letter(token) for token in ids)


def loopback(**settings: Any) -> ServerConfig:
    """The HTTP config of a test server: loopback, a free port, and ``settings`` (`ServerConfig` fields)."""
    return ServerConfig(**{"host": "127.0.0.1", "port": 0, **settings})


class Recorder:
    """A scheduling core's clients for tests that drive it directly: each request's deltas; a failure raises."""

    def __init__(self) -> None:
        self.deltas: dict[str, list[Any]] = {}

    def send(self, request_id: str, delta: Any) -> bool:
        self.deltas.setdefault(request_id, []).append(delta)
        return True

    def fail(self, request_id: str, error: Any) -> None:
        raise AssertionError(f"{request_id} failed: {error}")

    def close(self, request_id: str) -> None:
        pass


REPO = Path(__file__).resolve().parents[1]
STARTUP_SECONDS = 60


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def mlxcel_serve(*flags: str, family: str = "llama") -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A running `mlxcel serve` (the real CLI, on a fixture) on a free loopback port; killed on the way out if
    still alive."""
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", "-m", str(fixture_path(family)),
         "--host", "127.0.0.1", "--port", str(port), *flags],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_SECONDS
        while True:
            assert process.poll() is None, process.stderr.read().decode(errors="replace")[-2000:]  # type: ignore[union-attr]
            try:
                if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)
        process.stderr.close()  # type: ignore[union-attr]


async def linked_engine(nursery: trio.Nursery, engine: Any, kept: Any, *, prefix: str = "linked-",
                        ) -> tuple[Any, trio.CancelScope, trio.Event]:
    """``engine`` behind the engine link over an in-memory stream pair, its side keeping responses in ``kept``
    (a ResponseStore): the RemoteEngine an API process would hold, a scope whose cancelling ends the engine's
    side, and an event set when the RemoteEngine's link ends with LinkClosed."""
    import trio.testing

    from mlxcel.http.engine_link import EngineLink, FrameReader, LinkClosed, RemoteEngine

    engine_end, api_end = trio.testing.memory_stream_pair()

    async def ready() -> Any:
        return engine

    engine_side = trio.CancelScope()

    async def serve_engine_side() -> None:
        with engine_side:
            await EngineLink(prefix, kept).run(engine_end, ready)
        await engine_end.aclose()

    nursery.start_soon(serve_engine_side)
    reader = FrameReader(api_end)
    remote = RemoteEngine(await RemoteEngine.handshake(reader))
    link_closed = trio.Event()

    async def carry(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await remote.run(api_end, reader, task_status=task_status)
        except LinkClosed:
            link_closed.set()

    await nursery.start(carry)
    return remote, engine_side, link_closed
