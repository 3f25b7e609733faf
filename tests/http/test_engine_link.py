"""The engine across a socket (mlxcel/http/engine_link.py): both ends over an in-memory stream pair, with a
scripted engine whose request sinks the tests drive by hand."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from mlxcel.actors.messages import RequestFailed
from mlxcel.actors.router import LARGE_PROMPT_CHARS
from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.core.cache_plan import CACHE_OFF
from mlxcel.core.effects import RequestFinished
from mlxcel.core.plan import SampledToken
from mlxcel.errors import ContextExceeded, InvalidRequest, MlxcelError, ServerBusy
from mlxcel.http.engine_link import (
    EngineLink,
    FrameReader,
    LinkSink,
    RemoteEngine,
    RemoteResponses,
    frame,
)
from mlxcel.http.responses import ResponseStore
from mlxcel.model.family import detect_family
from mlxcel.model.info import ModelInfo
from mlxcel.types import ChatRequest, CompletionRequest, Delta, ImageSource, SamplingParams, TokenLogprob, Usage
from tests.fakes import FakeTokenizer
from tests.support import linked_engine, wait_until

BUFFER_EVENTS = 4


class ScriptedEngine:
    """The engine side's view: what was submitted (and its sink), what was cancelled, what was called."""

    def __init__(self, *, busy: bool = False) -> None:
        self.model = ModelInfo(
            model_id="linked", path=Path("/nonexistent"), config={"model_type": "llama"},
            family=detect_family({"model_type": "llama"}), tokenizer=FakeTokenizer(), chat_template="",
            eos_token_ids=frozenset({0}), context_size=4096)
        self.config = EngineConfig(scheduler=SchedulerConfig(client_buffer_events=BUFFER_EVENTS))
        self.cache_plan = CACHE_OFF
        self.served_model_names = ("linked", "alias")
        self.busy = busy
        self.sinks: dict[str, Any] = {}
        self.rendered: dict[str, Any] = {}
        self.cancelled: list[str] = []
        self.stopped: list[str] = []
        # False: stop finds the scheduler's inbox full.
        self.stop_accepted = True
        self.finished: list[RequestFinished] = []
        self.edge_output: dict[str, bool] = {}
        self.submitted = trio.Event()

    def submit(self, request: ChatRequest, request_id: str, events: Any, rendered: Any = None, *,
               edge_output: bool = False) -> None:
        if self.busy:
            raise ServerBusy("full")
        self.sinks[request_id] = events
        self.rendered[request_id] = rendered
        self.edge_output[request_id] = edge_output
        self.submitted.set()

    def _cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def stop(self, request_id: str) -> bool:
        self.stopped.append(request_id)
        return self.stop_accepted

    def record_finished(self, finished: RequestFinished) -> None:
        self.finished.append(finished)

    async def render_prompt(self, request: ChatRequest) -> tuple[int, ...]:
        if request.messages[0]["content"] == "too long":
            raise ContextExceeded("too long", param="messages", context_size=8, num_prompt_tokens=9)
        return (1, 2, 3)

    async def reset_cache(self, *, disk: bool = False) -> dict[str, int]:
        return {"disk": int(disk)}

    async def metrics_text(self) -> bytes:
        raise RuntimeError("a bug")


def chat(content: str = "hi", *, image: bool = False) -> ChatRequest:
    """A chat request; the fake tokenizer has no chat template, so only the engine's side can take one
    (with an image, which the API process leaves to the engine to render)."""
    images = (ImageSource(param="messages[0].content[1]", data=b"png"),) if image else ()
    return ChatRequest(messages=({"role": "user", "content": content},), images=images)


def prompt(text: str = "hi") -> CompletionRequest:
    """A text prompt: the API process renders it (the fake tokenizer's ids are the bytes)."""
    return CompletionRequest(prompt=text)


async def linked(nursery: trio.Nursery, engine: ScriptedEngine, store: ResponseStore | None = None,
                 ) -> tuple[RemoteEngine, trio.CancelScope, trio.Event]:
    """A RemoteEngine linked to ``engine``, the scope that ends the engine's side, and the event of its link's
    LinkClosed (tests.support.linked_engine)."""
    return await linked_engine(nursery, engine, store or ResponseStore(max_entries=8, max_bytes=1 << 20),
                               prefix="api7-")


async def test_frames_survive_any_split_of_the_bytes() -> None:
    messages = [("text", "1", "é" * 1000, (1, 2), ""), ("end", "1")]
    data = frame(messages) + frame([("end", "2")])
    send, receive = trio.testing.memory_stream_one_way_pair()
    reader = FrameReader(receive)
    for start in range(0, len(data), 7):  # 7 bytes at a time: lengths and payloads cut anywhere
        await send.send_all(data[start:start + 7])
    assert await reader.receive() == messages
    assert await reader.receive() == [("end", "2")]


async def test_the_handshake_carries_the_engine_facts() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        assert remote.model.model_id == "linked"
        assert remote.model_names == ("linked", "alias")
        assert remote.config.scheduler.client_buffer_events == BUFFER_EVENTS
        nursery.cancel_scope.cancel()


async def test_deltas_cross_in_order_plain_and_whole() -> None:
    engine = ScriptedEngine()
    usage = Usage(prompt_tokens=3, completion_tokens=2, cached_tokens=1)
    last = Delta(text="!", token_ids=(9,), finish_reason="stop", usage=usage,
                 logprobs=(TokenLogprob(token="!", logprob=-0.5, token_id=9),))
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        async with remote.stream(prompt()) as deltas:
            await engine.submitted.wait()
            (request_id, sink), = engine.sinks.items()
            assert request_id.startswith("api7-")  # the engine's ids are unique across API processes
            sink.send_nowait(Delta(text="He", token_ids=(1,)))
            sink.send_nowait(Delta(reasoning="hm"))
            sink.send_nowait(last)
            sink.close()
            received = [delta async for delta in deltas]
        assert received == [Delta(text="He", token_ids=(1,)), Delta(reasoning="hm"), last]
        assert received[-1].usage == usage
        assert engine.cancelled == []  # a finished stream is not cancelled
        nursery.cancel_scope.cancel()


async def test_the_api_process_renders_and_the_engine_gets_the_prompt() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        remote.stream(prompt("hey"))
        remote.stream(chat("look", image=True))
        await wait_until(lambda: len(engine.rendered) >= 2, seconds=5)
        assert engine.rendered["api7-0"].tokens == tuple(b"hey")
        assert engine.rendered["api7-1"] is None  # images: the engine's router fetches, places and renders
        nursery.cancel_scope.cancel()


def sampled(text: str, finish_reason: str | None = None) -> list[SampledToken]:
    """The fake tokenizer's tokens of ``text`` (one a byte), as the device samples them."""
    tokens = [SampledToken(sequence_id=0, token=byte, logprob=-0.5, top_logprobs=((byte, -0.5),))
              for byte in text.encode()]
    tokens[-1] = attrs.evolve(tokens[-1], finish_reason=finish_reason)
    return tokens


async def test_the_api_process_processes_the_output_of_what_it_rendered() -> None:
    """The engine relays the sampled tokens of a request the API process rendered. The API process detokenizes
    them, finds the stop string and tells the engine, drops what was sampled after it, and makes the last delta
    from its own counts and the engine's cached tokens; the engine's metrics hear of the reply from it."""
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        stopped = remote.stream(CompletionRequest(prompt="hi", sampling=SamplingParams(stop=("lo",), logprobs=True)))
        ended = remote.stream(CompletionRequest(prompt="hey"))
        remote.stream(chat("look", image=True))
        await wait_until(lambda: len(engine.sinks) == 3, seconds=5)
        assert engine.edge_output == {"api7-0": True, "api7-1": True, "api7-2": False}
        for token in sampled("hello"):
            engine.sinks["api7-0"].send_nowait(token)
        await wait_until(lambda: engine.stopped == ["api7-0"], seconds=5)
        for token in sampled(" world"):  # sampled before the engine heard of the stop
            engine.sinks["api7-0"].send_nowait(token)
        engine.sinks["api7-0"].send_nowait(Delta(finish_reason="stop", usage=Usage(
            prompt_tokens=2, completion_tokens=11, cached_tokens=1)))
        engine.sinks["api7-0"].close()
        for token in sampled("ok", finish_reason="length"):
            engine.sinks["api7-1"].send_nowait(token)
        engine.sinks["api7-1"].send_nowait(Delta(finish_reason="length", usage=Usage(
            prompt_tokens=3, completion_tokens=2)))
        engine.sinks["api7-1"].close()

        received = [delta async for delta in stopped]
        assert "".join(delta.text for delta in received) == "hel"
        assert [entry.token for delta in received for entry in delta.logprobs] == ["h", "e", "l"]
        final = received[-1]
        assert (final.finish_reason, final.stop_string) == ("stop", "lo")
        assert final.usage is not None
        # The reply's tokens up to its stop string; the engine's cached tokens.
        assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (2, 5, 1)
        received = [delta async for delta in ended]
        assert "".join(delta.text for delta in received) == "ok"
        assert received[-1].finish_reason == "length"
        assert received[-1].usage.completion_tokens == 2

        await wait_until(lambda: len(engine.finished) == 2, seconds=5)
        assert engine.stopped == ["api7-0"]
        assert [(f.finish_reason, f.prompt_tokens, f.cached_tokens, f.completion_tokens)
                for f in engine.finished] == [("stop", 2, 1, 5), ("length", 3, 0, 2)]
        nursery.cancel_scope.cancel()


async def test_a_stop_the_engine_cannot_take_cancels_the_reply_and_the_client_still_gets_its_end() -> None:
    """With the scheduler's inbox full, the engine's link shuts the reply's sink, so its next token cancels it;
    the API process then ends the reply from its own counts."""
    engine = ScriptedEngine()
    engine.stop_accepted = False
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        stopped = remote.stream(CompletionRequest(prompt="hi", sampling=SamplingParams(stop=("lo",))))
        await wait_until(lambda: len(engine.sinks) == 1, seconds=5)
        sink = engine.sinks["api7-0"]
        for token in sampled("hello"):
            sink.send_nowait(token)
        await wait_until(lambda: engine.stopped == ["api7-0"], seconds=5)
        with pytest.raises(trio.BrokenResourceError):  # the next token: the scheduler cancels the reply
            sink.send_nowait(sampled(" ")[0])
        sink.close()
        received = [delta async for delta in stopped]
        assert "".join(delta.text for delta in received) == "hel"
        assert received[-1].finish_reason == "stop"
        assert received[-1].usage.completion_tokens == 5
        nursery.cancel_scope.cancel()


async def test_huge_prompts_go_to_the_routers_lane_and_renders_waiting_are_bounded() -> None:
    engine = ScriptedEngine()
    engine.config = attrs.evolve(engine.config, scheduler=attrs.evolve(engine.config.scheduler,
                                                                        max_queued_requests=2))
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        remote.stream(prompt("x" * (LARGE_PROMPT_CHARS + 1)))  # the router's large lane bounds these
        remote.stream(prompt("a"))
        remote.stream(prompt("b"))
        with pytest.raises(ServerBusy):  # two wait to render already: as a full router inbox, a 503
            remote.stream(prompt("c"))
        await wait_until(lambda: len(engine.rendered) >= 3, seconds=5)
        assert engine.rendered["api7-0"] is None
        assert engine.rendered["api7-1"].tokens == tuple(b"a")
        remote.stream(prompt("d"))  # the renders are done: room again
        nursery.cancel_scope.cancel()


async def test_a_request_the_template_refuses_never_reaches_the_engine() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        with pytest.raises(InvalidRequest, match="chat template"):  # the fake tokenizer has none
            await remote.stream(chat()).__anext__()
        await trio.sleep(0.1)
        assert engine.sinks == {}
        nursery.cancel_scope.cancel()


async def test_a_failure_is_raised_with_its_status() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        deltas = remote.stream(prompt())
        await engine.submitted.wait()
        sink = next(iter(engine.sinks.values()))
        sink.send_nowait(RequestFailed(error=ContextExceeded("long", param="messages", context_size=8,
                                                             num_prompt_tokens=9)))
        sink.close()
        with pytest.raises(ContextExceeded) as raised:
            await deltas.__anext__()
        assert (raised.value.status, raised.value.code, raised.value.context_size) == (
            400, "context_length_exceeded", 8)
        nursery.cancel_scope.cancel()


async def test_a_busy_engine_is_a_503_on_the_first_delta() -> None:
    engine = ScriptedEngine(busy=True)
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        with pytest.raises(ServerBusy) as raised:
            await remote.stream(prompt()).__anext__()
        assert raised.value.status == 503
        nursery.cancel_scope.cancel()


async def test_closing_a_stream_early_cancels_the_request_and_the_sink() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        deltas = remote.stream(prompt())
        await engine.submitted.wait()
        (request_id, sink), = engine.sinks.items()
        sink.send_nowait(Delta(text="a"))
        assert (await deltas.__anext__()).text == "a"
        await deltas.aclose()
        await wait_until(lambda: engine.cancelled, seconds=5)
        assert engine.cancelled == [request_id]
        with pytest.raises(trio.BrokenResourceError):  # the scheduler's send fails: it frees the sequence
            sink.send_nowait(Delta(text="b"))
        nursery.cancel_scope.cancel()


async def test_a_client_that_falls_behind_its_buffer_is_cancelled() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        deltas = remote.stream(prompt())
        await engine.submitted.wait()
        (request_id, sink), = engine.sinks.items()
        for index in range(BUFFER_EVENTS + 1):  # one more than the client's buffer, none read
            sink.send_nowait(Delta(text=str(index)))
        await wait_until(lambda: engine.cancelled, seconds=5)
        assert engine.cancelled == [request_id]
        received = [delta.text async for delta in deltas]
        assert received == [str(index) for index in range(BUFFER_EVENTS)]  # what fit, then the end
        nursery.cancel_scope.cancel()


async def test_calls_answer_or_raise_the_engines_error() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine)
        assert await remote.render_prompt(chat(image=True)) == (1, 2, 3)  # the engine renders images
        assert await remote.count_prompt_tokens(chat(image=True)) == 3
        assert await remote.render_prompt(prompt("hi")) == (104, 105)  # the API process renders the rest
        assert await remote.reset_cache(disk=True) == {"disk": 1}
        with pytest.raises(ContextExceeded) as raised:
            await remote.render_prompt(chat("too long", image=True))
        assert raised.value.num_prompt_tokens == 9
        with pytest.raises(MlxcelError) as failed:  # an unforeseen error is a 500, not a dead link
            await remote.metrics_text()
        assert failed.value.status == 500
        with pytest.raises(MlxcelError, match="no call"):
            await remote.call("submit_everything")
        nursery.cancel_scope.cancel()


async def test_responses_are_kept_in_the_engines_store() -> None:
    engine = ScriptedEngine()
    store = ResponseStore(max_entries=8, max_bytes=1 << 20)
    async with trio.open_nursery() as nursery:
        remote, _, _ = await linked(nursery, engine, store)
        other, _, _ = await linked(nursery, engine, store)  # a second API process on the same engine
        kept = RemoteResponses(remote)
        assert await kept.put("owner", "resp_1", {"id": "resp_1"}, ({"type": "message"},), ())
        found = await RemoteResponses(other).get("owner", "resp_1")
        assert found is not None
        assert found.body == {"id": "resp_1"}
        assert await RemoteResponses(other).get("someone else", "resp_1") is None
        assert await kept.delete("owner", "resp_1")
        assert store.get("owner", "resp_1") is None
        nursery.cancel_scope.cancel()


async def test_when_the_engine_goes_streams_end_and_calls_fail() -> None:
    engine = ScriptedEngine()
    async with trio.open_nursery() as nursery:
        remote, engine_scope, link_closed = await linked(nursery, engine)
        deltas = remote.stream(prompt())
        await engine.submitted.wait()
        engine_scope.cancel()
        with trio.fail_after(5):
            assert [delta async for delta in deltas] == []
            await link_closed.wait()  # what ends an API process whose engine has gone
        with pytest.raises(ServerBusy):
            await remote.render_prompt(chat(image=True))
        with pytest.raises(ServerBusy):
            await remote.stream(prompt()).__anext__()


async def test_when_an_api_process_goes_its_requests_are_cancelled() -> None:
    engine = ScriptedEngine()
    engine_end, api_end = trio.testing.memory_stream_pair()

    async def ready() -> ScriptedEngine:
        return engine

    async with trio.open_nursery() as nursery:
        nursery.start_soon(EngineLink("api0-", ResponseStore(max_entries=1, max_bytes=1)).run, engine_end, ready)
        reader = FrameReader(api_end)
        await reader.receive()  # the facts
        await api_end.send_all(frame([("submit", "5", prompt(), None), ("submit", "6", prompt(), None)]))
        await wait_until(lambda: len(engine.sinks) >= 2, seconds=5)
        engine.sinks["api0-5"].close()  # one finished before the process went
        await api_end.aclose()
        await wait_until(lambda: engine.cancelled, seconds=5)
    assert engine.cancelled == ["api0-6"]
    with pytest.raises(trio.BrokenResourceError):
        engine.sinks["api0-6"].send_nowait(Delta(text="late"))


def test_errors_cross_processes_whole() -> None:
    for error in (ContextExceeded("long", param="messages", context_size=8, num_prompt_tokens=9),
                  ServerBusy("busy", retry_after_seconds=3),
                  InvalidRequest("bad", param="n", code="invalid_value", status=422)):
        copy = pickle.loads(pickle.dumps(error))
        assert type(copy) is type(error)
        assert copy.__dict__ == error.__dict__
        assert str(copy) == str(error)
        assert copy.to_body() == error.to_body()


def test_a_sink_sends_nothing_after_its_close() -> None:
    from mlxcel.http.engine_link import Outbox

    outbox, open_sinks = Outbox(), {}
    sink = open_sinks["1"] = LinkSink(outbox, "1", open_sinks)
    with sink:
        sink.send_nowait(Delta(text="x"))
    with pytest.raises(trio.ClosedResourceError):
        sink.send_nowait(Delta(text="y"))
    sink.close()  # twice is once
    assert outbox._messages == [("text", "1", "x", (), ""), ("end", "1")]
