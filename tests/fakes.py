"""Fakes with the Engine's public surface, for testing the HTTP app without a model.

    engine = FakeEngine(reply=[Delta(text="Hi"), finish("stop")])
    app = create_app(engine)

Each request the app starts gets the same scripted reply: a list of deltas,
exceptions and `trio.Event`s, handed out in order (an exception is raised where
it stands, as a `RequestFailed` surfaces from the real `DeltaStream`; an event
is waited on, standing for a slow step). `stream_error` is raised
by `stream()` itself, as the real engine raises `ServerBusy` on a full router.
The engine records every request it was given and how each stream ended.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio
import trio.testing
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer
from quart.typing import TestClientProtocol as Client

from mlxcel.actors.device import ModelInfo
from mlxcel.actors.messages import SchedulerStats
from mlxcel.config import EngineConfig, ServerConfig
from mlxcel.engine import DeltaStream, Engine
from mlxcel.http.app import create_app
from mlxcel.http.llamacpp import _byte_decoder
from mlxcel.model.family import detect_family
from mlxcel.types import ChatRequest, CompletionRequest, Delta, Usage

__all__ = ["FakeDeltaStream", "FakeEngine", "FakeTokenizer", "client_for", "finish", "leave_mid_stream"]

FAKE_MODEL_ID = "fake-model"

Script = Delta | BaseException | trio.Event


def finish(
    reason: str = "stop", *, text: str = "", prompt_tokens: int = 7, completion_tokens: int = 2,
    cached_tokens: int = 0, stop_string: str | None = None, **fields: Any,
) -> Delta:
    """The last delta of a reply: finish reason and usage."""
    usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=cached_tokens,
                  prompt_seconds=0.5, decode_seconds=0.25)
    return Delta(text=text, finish_reason=reason, usage=usage, stop_string=stop_string, **fields)


class FakeTokenizer:
    """A byte-level vocabulary: token id `b` is the byte `b`, so every piece is known in advance."""

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    @property
    def detokenizer(self) -> NaiveStreamingDetokenizer:
        return NaiveStreamingDetokenizer(self)

    def convert_ids_to_tokens(self, token_id: int) -> str:
        # Pieces are written in GPT-2's byte-to-character table, as byte-level BPE vocabularies are.
        return {byte: character for character, byte in _byte_decoder().items()}[token_id]


@attrs.define
class StreamRecord:
    """How one request's stream went: closed by the app, and whether before its finish."""

    request: ChatRequest | CompletionRequest
    num_deltas_sent: int = 0
    closed: bool = False
    closed_before_finish: bool = False


class FakeDeltaStream(DeltaStream):
    """The `DeltaStream` surface over a scripted list of deltas and exceptions."""

    def __init__(self, script: Sequence[Script], record: StreamRecord) -> None:
        self._script = list(script)
        self._record = record
        self._finished = False

    def __aiter__(self) -> FakeDeltaStream:
        return self

    async def __anext__(self) -> Delta:
        if self._finished or not self._script:
            self._finished = True
            raise StopAsyncIteration
        item = self._script.pop(0)
        while isinstance(item, trio.Event):
            await item.wait()
            item = self._script.pop(0)
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        self._record.num_deltas_sent += 1
        if item.finish_reason is not None:
            self._finished = True
        return item

    async def aclose(self) -> None:
        if not self._record.closed:
            self._record.closed = True
            self._record.closed_before_finish = not self._finished
        self._finished = True

    async def __aenter__(self) -> FakeDeltaStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


class FakeEngine(Engine):
    """Scripted stand-in for `mlxcel.engine.Engine` as `create_app` and `serve` use it.

    A subclass only so that it passes where an Engine is checked for; it starts no
    actors, and every method the app calls is overridden here.
    """

    def __init__(
        self,
        reply: Sequence[Script] = (),
        *,
        model_id: str = FAKE_MODEL_ID,
        context_size: int = 4096,
        stream_error: BaseException | None = None,
        cache_stats: dict[str, Any] | None = None,
        scheduler_stats: SchedulerStats | None = None,
        metrics_text: bytes = b"# HELP mlxcel_fake 1\n",
        num_prompt_tokens: int = 7,
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        # What count_prompt_tokens answers, and the requests it was asked about.
        self.num_prompt_tokens = num_prompt_tokens
        self.counted: list[ChatRequest] = []
        self.reply = list(reply) or [Delta(text="Hello"), finish("stop", text=" world")]
        self.stream_error = stream_error
        self.model = ModelInfo(
            model_id=model_id,
            path=Path("/nonexistent") / model_id,
            config={"model_type": "llama"},
            family=detect_family({"model_type": "llama"}),
            tokenizer=FakeTokenizer(),
            chat_template="",
            eos_token_ids=frozenset({0}),
            context_size=context_size,
        )
        self._cache_stats = cache_stats if cache_stats is not None else {"apc_enabled": False, "num_entries": 3}
        self._scheduler_stats = scheduler_stats or fake_scheduler_stats()
        self._metrics_text = metrics_text
        self.streams: list[StreamRecord] = []
        self.num_resets = 0
        self.num_stats_calls = 0

    @property
    def model_id(self) -> str:
        return self.model.model_id

    @property
    def requests(self) -> list[ChatRequest | CompletionRequest]:
        """Every request `stream()` was given, in order (also those it refused)."""
        return [record.request for record in self.streams]

    def stream(self, request: ChatRequest | CompletionRequest) -> FakeDeltaStream:
        record = StreamRecord(request=request)
        self.streams.append(record)
        if self.stream_error is not None:
            record.closed = True
            raise self.stream_error
        return FakeDeltaStream(self.reply, record)

    async def count_prompt_tokens(self, request: ChatRequest) -> int:
        self.counted.append(request)
        if self.stream_error is not None:
            raise self.stream_error
        return self.num_prompt_tokens

    async def cache_stats(self) -> dict[str, Any]:
        self.num_stats_calls += 1
        return dict(self._cache_stats)

    async def scheduler_stats(self) -> SchedulerStats:
        return self._scheduler_stats

    async def reset_cache(self, *, disk: bool = False) -> dict[str, int]:
        self.num_resets += 1
        self.reset_disk = disk
        return {"num_entries_removed": 3}

    async def metrics_text(self) -> bytes:
        return self._metrics_text


def fake_scheduler_stats(**changes: Any) -> SchedulerStats:
    fields: dict[str, Any] = {
        "num_waiting": 2, "num_running": 1, "num_steps": 10, "num_completed": 4, "num_cancelled": 0,
        "num_failed": 0, "max_decode_batch_size": 1, "decode_batch_sizes": {1: 10},
        "num_interleaved_steps": 0, "num_parked": 0, "num_shared_prefills": 0, "running_request_ids": ("req-0",),
    }
    return SchedulerStats(**{**fields, **changes})


def client_for(engine: Engine, *, trusted_hosts: frozenset[str] | None = None, **settings: Any) -> Client:
    """A test client of the app serving ``engine``; ``settings`` are `ServerConfig` fields."""
    return create_app(engine, ServerConfig(**settings), trusted_hosts=trusted_hosts).test_client()


async def leave_mid_stream(client: Client, path: str, body: Any) -> bytes:
    """POST a streaming request, read its first chunk, then go away as a client that disconnects does."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    with trio.CancelScope() as leave:
        async with client.request(path, method="POST", headers=headers) as connection:
            await connection.send(data)
            await connection.send_complete()
            first = await connection.receive()
            await connection.disconnect()
            await trio.testing.wait_all_tasks_blocked()
            # Quart's test connection would wait for a body end that a cancelled response never sends.
            leave.cancel()
    return first
