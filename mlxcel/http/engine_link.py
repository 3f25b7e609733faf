"""The engine across a socket, for an HTTP edge in processes of its own (``mlxcel serve --api-processes N``).

The engine's process runs the actors; each API process runs hypercorn and
the routes, and talks to it over a Unix socket pair. Why: the event loop
beside the device thread shares its GIL, and the HTTP edge (hypercorn, h11,
Quart, the JSON of every chunk) was most of that loop's work per request
and a third of it per streamed token (docs/architecture.md, "The HTTP edge
in processes of its own").

On the wire, each frame is a 4-byte big-endian length and a pickle of a
list of messages: everything one side queued since its last write goes in
one frame, so a decode step's deltas for one API process cross in one
write. Pickle is safe here because both ends are this program, started by
the engine's process over a socket pair no one else holds.

Output processing (detokenizing, stop strings, reasoning and tool-call
parsing, logprobs) runs in the API process for the requests it rendered,
as vLLM's output processor runs in its API server: the engine's loop only
counts and forwards the sampled tokens. A stop string found here ends the
reply in the engine one step late (``stop``); the tokens sampled meanwhile
are dropped here, never sent.

API process -> engine:
    ("submit", request_id, request, rendered)  a ChatRequest or CompletionRequest, and its prompt
                                       rendered (a RenderedPrompt; None: the engine's router renders it); a
                                       request rendered here has its output processed here too (below)
    ("cancel", request_id)             the client went away
    ("stop", request_id)               a stop string ended the reply (output processed here)
    ("finished", RequestFinished)      a reply processed here has finished, for the engine's metrics
    ("call", call_id, name, args, kwargs)  one of ENGINE_CALLS or RESPONSE_CALLS, answered by "answer"
engine -> API process:
    ("ready", EngineFacts)             once, when the engine has loaded
    ("event", request_id, event)       a Delta or RequestFailed
    ("text", request_id, text, token_ids, reasoning)  a Delta with nothing else (most of a stream's)
    ("tok", request_id, token, logprob, top_logprobs, finish_reason)  a sampled token of a reply whose
                                       output this API process processes (then the last "event" is the
                                       engine's usage, whose cached_tokens it takes)
    ("end", request_id)                no more events for it
    ("answer", call_id, ok, value)     the call's result, or the MlxcelError it raised
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import pickle
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from mlxcel.actors.messages import RequestFailed, SchedulerStats, StreamEvent
from mlxcel.actors.router import LARGE_PROMPT_CHARS, MAX_CONCURRENT_ROUTES
from mlxcel.config import EngineConfig
from mlxcel.core.cache_plan import CachePlan
from mlxcel.core.effects import RequestFinished
from mlxcel.core.output import ReplyFormat, RequestOutput
from mlxcel.core.plan import SampledToken
from mlxcel.engine import DeltaStream, EngineHandle, prompt_renderer
from mlxcel.errors import InternalError, MlxcelError, ServerBusy
from mlxcel.http.responses import ResponseStore, StoredResponse
from mlxcel.model.info import ModelInfo
from mlxcel.model.prompt import RenderedPrompt, prompt_chars
from mlxcel.types import ChatRequest, CompletionRequest, Delta

logger = logging.getLogger(__name__)

_LENGTH_BYTES = 4
# A frame over this is a fault of the sender, not a message (a request body is bounded far below it).
MAX_FRAME_BYTES = 1 << 30
_READ_BYTES = 1 << 20

# The calls an API process may make, each an EngineHandle coroutine, or the engine side's response store.
ENGINE_CALLS = frozenset({"render_prompt", "lora_adapters", "cache_stats", "reset_cache", "scheduler_stats",
                          "metrics_text"})
RESPONSE_CALLS = frozenset({"responses_put", "responses_get", "responses_delete"})


class LinkClosed(Exception):
    """The other end went away (its process ended)."""


# --- frames ------------------------------------------------------------------------------------------------


class FrameReader:
    """Reads the frames of a stream, one list of messages each."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = bytearray()

    async def receive(self) -> list[Any]:
        """The next frame's messages; LinkClosed at the end of the stream."""
        buffer = self._buffer
        while True:
            if len(buffer) >= _LENGTH_BYTES:
                size = int.from_bytes(buffer[:_LENGTH_BYTES], "big")
                if size > MAX_FRAME_BYTES:
                    raise LinkClosed(f"a frame of {size} bytes")
                end = _LENGTH_BYTES + size
                if len(buffer) >= end:
                    messages: list[Any] = pickle.loads(memoryview(buffer)[_LENGTH_BYTES:end])
                    del buffer[:end]
                    return messages
            try:
                data = await self._stream.receive_some(_READ_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise LinkClosed(str(error)) from error
            if not data:
                raise LinkClosed("end of stream")
            buffer += data


def frame(messages: list[Any]) -> bytes:
    payload = pickle.dumps(messages, protocol=pickle.HIGHEST_PROTOCOL)
    return len(payload).to_bytes(_LENGTH_BYTES, "big") + payload


class Outbox:
    """Messages for the other end, written by one task (``pump``), in one frame per write."""

    def __init__(self) -> None:
        self._messages: list[Any] = []
        self._wake = trio.Event()
        self.closed = False

    def put(self, message: Any) -> None:
        if self.closed:
            raise trio.BrokenResourceError("the link is closed")
        self._messages.append(message)
        self._wake.set()

    async def pump(self, stream: trio.abc.SendStream) -> None:
        """Write what is queued until the stream breaks (then LinkClosed) or the task is cancelled."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                messages, self._messages = self._messages, []
                await stream.send_all(frame(messages))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise LinkClosed(str(error)) from error
        finally:
            self.closed = True


# --- the engine's side -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class EngineFacts:
    """What an API process needs to know of the engine: the values an EngineHandle carries."""

    model: ModelInfo
    config: EngineConfig
    cache_plan: CachePlan
    served_model_names: tuple[str, ...]


class LinkSink:
    """A request's events, queued for the API process that sent it (an ``EventSink``)."""

    __slots__ = ("_outbox", "_request_id", "_open", "cancelled")

    def __init__(self, outbox: Outbox, request_id: str, open_sinks: dict[str, LinkSink]) -> None:
        # The API process's id for the request (the engine knows it by the link's prefix and this).
        self._outbox = outbox
        self._request_id = request_id
        self._open = open_sinks
        self.cancelled = False

    def send_nowait(self, value: StreamEvent) -> None:
        if self.cancelled:
            raise trio.BrokenResourceError("the client cancelled")
        if self._open.get(self._request_id) is not self:
            raise trio.ClosedResourceError("closed")
        if type(value) is SampledToken:
            self._outbox.put(("tok", self._request_id, value.token, value.logprob, value.top_logprobs,
                              value.finish_reason))
        elif type(value) is Delta and _plain(value):
            # Most deltas: a plain tuple pickles in 0.2 us where the attrs class takes 5 (CPU box).
            self._outbox.put(("text", self._request_id, value.text, value.token_ids, value.reasoning))
        else:
            self._outbox.put(("event", self._request_id, value))

    def close(self) -> None:
        if self._open.get(self._request_id) is self:
            del self._open[self._request_id]
            if not self._outbox.closed:
                self._outbox.put(("end", self._request_id))

    def __enter__(self) -> LinkSink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _plain(delta: Delta) -> bool:
    """Only text, ids and reasoning: what most deltas of a stream carry."""
    return (delta.finish_reason is None and not delta.logprobs and not delta.tool_call_parts and not delta.tool_calls
            and delta.progress is None and delta.usage is None and delta.stop_string is None)


class EngineLink:
    """Serves one API process's link from the engine's process.

    ``responses``: the store behind ``previous_response_id``, one for all API
    processes (so a follow-up finds its response whichever process takes it).
    """

    def __init__(self, prefix: str, responses: ResponseStore) -> None:
        # The engine's ids for this link's requests: the prefix, then the API process's own id.
        self._prefix = prefix
        self._responses = responses
        self._engine: Any = None
        self._outbox = Outbox()
        self._sinks: dict[str, LinkSink] = {}

    async def run(self, stream: trio.abc.Stream, engine_ready: Callable[[], Awaitable[Any]]) -> None:
        """Until the API process closes its end (or the task is cancelled); its requests are then cancelled.

        ``engine_ready``: gives the engine handle once it has loaded (a PendingEngine's ``wait``).
        """
        reader = FrameReader(stream)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._pump, stream, nursery.cancel_scope)
                engine = await engine_ready()
                self._engine = engine
                self._outbox.put(("ready", EngineFacts(
                    model=engine.model, config=engine.config, cache_plan=engine.cache_plan,
                    served_model_names=engine.served_model_names)))
                while True:
                    try:
                        messages = await reader.receive()
                    except LinkClosed:
                        nursery.cancel_scope.cancel()
                        return
                    for message in messages:
                        self._handle(message, nursery)
        finally:
            # The API process has gone: its requests end here.
            self._outbox.closed = True
            for request_id in list(self._sinks):
                self._sinks.pop(request_id).cancelled = True
                self._engine._cancel(self._prefix + request_id)

    async def _pump(self, stream: trio.abc.SendStream, scope: trio.CancelScope) -> None:
        try:
            await self._outbox.pump(stream)
        except LinkClosed:
            scope.cancel()

    def _handle(self, message: tuple[Any, ...], nursery: trio.Nursery) -> None:
        kind = message[0]
        if kind == "submit":
            _, request_id, request, rendered = message
            sink = self._sinks[request_id] = LinkSink(self._outbox, request_id, self._sinks)
            try:
                self._engine.submit(request, self._prefix + request_id, sink, rendered,
                                    edge_output=rendered is not None)
            except ServerBusy as error:
                sink.send_nowait(RequestFailed(error=error))
                sink.close()
        elif kind == "cancel":
            cancelled = self._sinks.pop(message[1], None)
            if cancelled is not None:
                cancelled.cancelled = True
                self._engine._cancel(self._prefix + message[1])
        elif kind == "stop":
            stopped = self._sinks.get(message[1])
            if stopped is not None and not self._engine.stop(self._prefix + message[1]):
                # The scheduler's inbox is full: the reply's next token finds its sink shut and cancels it.
                stopped.cancelled = True
        elif kind == "finished":
            self._engine.record_finished(message[1])
        elif kind == "call":
            nursery.start_soon(self._answer, *message[1:])
        else:
            logger.error("unexpected message on an API process's link: %r", kind)

    async def _answer(self, call_id: int, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        try:
            if name in ENGINE_CALLS:
                value = await getattr(self._engine, name)(*args, **kwargs)
            elif name in RESPONSE_CALLS:
                value = getattr(self._responses, name.removeprefix("responses_"))(*args, **kwargs)
            else:
                raise InternalError(f"no call {name!r} on the engine's link")
            answer = ("answer", call_id, True, value)
        except MlxcelError as error:
            answer = ("answer", call_id, False, error)
        except Exception:
            logger.exception("a call from an API process failed: %s", name)
            answer = ("answer", call_id, False, InternalError("internal server error"))
        if not self._outbox.closed:
            self._outbox.put(answer)


# --- the API process's side --------------------------------------------------------------------------------


@attrs.define
class _EdgeReply:
    """A reply whose output this API process processes (it rendered the request)."""

    # Made at its first sampled token (the engine processes the output itself when it needs the reply's text,
    # and then sends deltas instead).
    make_output: Callable[[], RequestOutput]
    output: RequestOutput | None = None
    # Why the reply ended, as its output found it (a stop string, the end of sequence, max_tokens).
    reason: str | None = None


class RemoteEngine(EngineHandle):
    """An engine in another process, as the HTTP app sees one. ``run`` carries its link."""

    def __init__(self, facts: EngineFacts) -> None:
        self.model = facts.model
        self.config = facts.config
        self.cache_plan = facts.cache_plan
        self.served_model_names = facts.served_model_names
        self._buffer_events = facts.config.scheduler.client_buffer_events
        self._outbox = Outbox()
        self._streams: dict[str, trio.MemorySendChannel[StreamEvent]] = {}
        self._replies: dict[str, _EdgeReply] = {}
        self._reply_format = ReplyFormat.of(facts.model.tokenizer)
        self._calls: dict[int, trio.MemorySendChannel[tuple[bool, Any]]] = {}
        self._request_ids = itertools.count()
        self._call_ids = itertools.count()
        # Requests are rendered and tokenized here, off the engine's GIL, as its router would (the same
        # renderer from the same facts); at most as many at once as the router renders.
        self._renderer = prompt_renderer(facts.model, facts.config, facts.cache_plan)
        self._renders = trio.CapacityLimiter(MAX_CONCURRENT_ROUTES)
        # Requests rendering or waiting to, at most as many as the router's inbox holds (more: a 503, as there).
        self._num_rendering = 0
        self._max_rendering = facts.config.scheduler.max_queued_requests
        self._nursery: trio.Nursery | None = None

    @staticmethod
    async def handshake(reader: FrameReader) -> EngineFacts:
        """The engine's facts, the first message on a new link (sent once the engine has loaded)."""
        messages = await reader.receive()
        kind, facts = messages[0]
        if kind != "ready" or len(messages) != 1:
            raise LinkClosed(f"expected the engine's facts, got {kind!r}")
        assert isinstance(facts, EngineFacts)
        return facts

    async def run(self, stream: trio.abc.Stream, reader: FrameReader, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Carry the link until the engine's end closes (then LinkClosed) or the task is cancelled; ``stream``
        works once it has started (``nursery.start``)."""
        closed: list[LinkClosed] = []

        async def pump(scope: trio.CancelScope) -> None:
            try:
                await self._outbox.pump(stream)
            except LinkClosed as error:
                closed.append(error)
                scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, nursery.cancel_scope)
                self._nursery = nursery
                task_status.started()
                try:
                    while True:
                        for message in await reader.receive():
                            self._handle(message)
                except LinkClosed as error:
                    closed.append(error)
                    nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._outbox.closed = True
            for events in self._streams.values():
                events.close()
            self._streams.clear()
            self._replies.clear()
            for reply in self._calls.values():
                reply.close()
            self._calls.clear()
        if closed:
            raise closed[0]

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "tok":
            self._on_token(*message[1:])
        elif kind == "text":
            self._deliver(message[1], Delta(text=message[2], token_ids=message[3], reasoning=message[4]))
        elif kind == "event":
            request_id, event = message[1], message[2]
            reply = self._replies.get(request_id)
            if (reply is not None and reply.output is not None and type(event) is Delta
                    and event.finish_reason is not None):
                del self._replies[request_id]
                self._finish(request_id, reply, event)
            else:
                self._deliver(request_id, event)
        elif kind == "end":
            reply = self._replies.pop(message[1], None)
            if reply is not None and reply.reason is not None and message[1] in self._streams:
                # The engine cancelled a reply this process had ended (it could not be told of the stop string):
                # its last delta comes from this process's counts alone.
                self._finish(message[1], reply, None)
            events = self._streams.pop(message[1], None)
            if events is not None:
                events.close()
        elif kind == "answer":
            answer_to = self._calls.pop(message[1], None)
            if answer_to is not None:
                with answer_to:
                    answer_to.send_nowait((message[2], message[3]))
        else:
            logger.error("unexpected message from the engine: %r", kind)

    def _deliver(self, request_id: str, event: StreamEvent) -> bool:
        events = self._streams.get(request_id)
        if events is None:
            return False
        try:
            events.send_nowait(event)
            return True
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            # The client reads too slowly or has gone: the request is cancelled, as in one process.
            self._cancel(request_id)
            return False

    def _on_token(self, request_id: str, token: int, logprob: float, top: tuple[tuple[int, float], ...],
                  finish_reason: str | None) -> None:
        reply = self._replies.get(request_id)
        if reply is None or reply.reason is not None:
            return  # ended here by a stop string: what the engine sampled after it is not the reply's
        if reply.output is None:
            reply.output = reply.make_output()
        out = reply.output.add(token, logprob, top, finish_reason, trio.current_time())
        if out.delta is not None and not self._deliver(request_id, out.delta):
            return
        if out.finish_reason is not None:
            reply.reason = out.finish_reason
            if out.stopped_by_text and not self._outbox.closed:
                self._outbox.put(("stop", request_id))

    def _finish(self, request_id: str, reply: _EdgeReply, engine_final: Delta | None) -> None:
        """The engine's last event of a relayed reply (None: it has none): the reply's own last delta goes out,
        and the engine's metrics hear of it."""
        output = reply.output
        assert output is not None
        if engine_final is not None and engine_final.usage is not None:
            output.cached_tokens = engine_final.usage.cached_tokens
        engine_reason = engine_final.finish_reason if engine_final is not None else None
        final = output.final(reply.reason or engine_reason or "stop", trio.current_time())
        assert final.usage is not None
        assert final.finish_reason is not None
        if self._deliver(request_id, final) and not self._outbox.closed:
            self._outbox.put(("finished", RequestFinished(
                finish_reason=final.finish_reason, prompt_tokens=final.usage.prompt_tokens,
                cached_tokens=final.usage.cached_tokens, completion_tokens=final.usage.completion_tokens,
                seconds_to_first_token=(None if output.first_token_at is None
                                        else output.first_token_at - output.submitted_at))))

    def stream(self, request: ChatRequest | CompletionRequest) -> DeltaStream:
        request_id = str(next(self._request_ids))
        if self._outbox.closed or self._nursery is None:
            raise ServerBusy("the engine is not reachable; retry shortly")
        if (isinstance(request, ChatRequest) and request.images) or prompt_chars(request) > LARGE_PROMPT_CHARS:
            # Images need fetching and placing, and huge prompts render in the router's bounded lane: the
            # engine's router renders these.
            renders_here = False
        elif self._num_rendering >= self._max_rendering:
            raise ServerBusy("the server is at capacity; retry shortly")
        else:
            renders_here = True
        send, receive = trio.open_memory_channel[StreamEvent](self._buffer_events)
        self._streams[request_id] = send
        if renders_here:
            self._num_rendering += 1
            self._nursery.start_soon(self._render_then_submit, request_id, request, trio.current_time())
        else:
            self._outbox.put(("submit", request_id, request, None))
        return DeltaStream(self, request_id, receive)

    async def _render_then_submit(self, request_id: str, request: ChatRequest | CompletionRequest,
                                  submitted_at: float) -> None:
        try:
            rendered: RenderedPrompt | None = await trio.to_thread.run_sync(
                self._renderer.render, request, limiter=self._renders)
        except MlxcelError as error:
            # A refusal of the request itself (as the router's): the client gets it, the engine never sees it.
            events = self._streams.pop(request_id, None)
            if events is not None:
                with events, contextlib.suppress(trio.WouldBlock, trio.BrokenResourceError):
                    events.send_nowait(RequestFailed(error=error))
            return
        except Exception:  # noqa: BLE001 - the engine's router renders it again and reports the failure
            rendered = None
        finally:
            self._num_rendering -= 1
        if request_id in self._streams and not self._outbox.closed:  # not cancelled meanwhile
            if rendered is not None:
                chat = request if isinstance(request, ChatRequest) else None
                self._replies[request_id] = _EdgeReply(make_output=functools.partial(
                    RequestOutput, tokenizer=self.model.tokenizer, sampling=request.sampling,
                    eos_token_ids=self.model.eos_token_ids, prompt_tokens=len(rendered.tokens),
                    submitted_at=submitted_at, parsing=self._reply_format.parsing(chat, rendered.tokens),
                    report_progress=chat is not None and chat.timings_per_token))
            self._outbox.put(("submit", request_id, request, rendered))

    def _cancel(self, request_id: str) -> None:
        self._replies.pop(request_id, None)
        events = self._streams.pop(request_id, None)
        if events is not None:
            events.close()
        if not self._outbox.closed:
            self._outbox.put(("cancel", request_id))

    async def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``name`` (ENGINE_CALLS or RESPONSE_CALLS) in the engine's process; its MlxcelError is raised here."""
        call_id = next(self._call_ids)
        reply_to, replies = trio.open_memory_channel[tuple[bool, Any]](1)
        try:
            self._outbox.put(("call", call_id, name, args, kwargs))
        except trio.BrokenResourceError:
            raise ServerBusy("the engine is not reachable; retry shortly") from None
        self._calls[call_id] = reply_to
        with replies:
            try:
                ok, value = await replies.receive()
            except trio.EndOfChannel:
                raise ServerBusy("the engine went away; retry shortly") from None
            finally:
                self._calls.pop(call_id, None)
        if not ok:
            raise value
        return value

    async def render_prompt(self, request: ChatRequest | CompletionRequest) -> tuple[int, ...]:
        if (isinstance(request, ChatRequest) and request.images) or prompt_chars(request) > LARGE_PROMPT_CHARS:
            answer: tuple[int, ...] = await self.call("render_prompt", request)
            return answer
        rendered = await trio.to_thread.run_sync(self._renderer.render, request, limiter=self._renders)
        return rendered.tokens

    async def lora_adapters(self, scales: tuple[tuple[int, float], ...] | None = None) -> list[dict[str, Any]]:
        answer: list[dict[str, Any]] = await self.call("lora_adapters", scales)
        return answer

    async def cache_stats(self) -> dict[str, Any]:
        answer: dict[str, Any] = await self.call("cache_stats")
        return answer

    async def reset_cache(self, *, disk: bool = False) -> dict[str, int]:
        answer: dict[str, int] = await self.call("reset_cache", disk=disk)
        return answer

    async def scheduler_stats(self) -> SchedulerStats:
        answer: SchedulerStats = await self.call("scheduler_stats")
        return answer

    async def metrics_text(self) -> bytes:
        answer: bytes = await self.call("metrics_text")
        return answer


class RemoteResponses:
    """The engine process's response store (``previous_response_id``), shared by every API process."""

    def __init__(self, engine: RemoteEngine) -> None:
        self._engine = engine

    async def put(self, owner: str, response_id: str, body: Mapping[str, Any],
                  items: tuple[Mapping[str, Any], ...], input_items: tuple[Mapping[str, Any], ...]) -> bool:
        kept: bool = await self._engine.call("responses_put", owner, response_id, body, items, input_items)
        return kept

    async def get(self, owner: str, response_id: str) -> StoredResponse | None:
        stored: StoredResponse | None = await self._engine.call("responses_get", owner, response_id)
        return stored

    async def delete(self, owner: str, response_id: str) -> bool:
        deleted: bool = await self._engine.call("responses_delete", owner, response_id)
        return deleted
