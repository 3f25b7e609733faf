"""The HTTP app's response shapes and wiring, against a scripted fake engine (no model, no socket).

`tests/http/test_server.py` runs the same routes through a real hypercorn and
a real model; here every body is checked field by field, and so is the
request the engine was handed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from quart.typing import TestClientProtocol as Client

from mlxcel.types import (
    CacheOptions,
    ChatRequest,
    CompletionRequest,
    Delta,
    InvalidRequest,
    SamplingParams,
    ServerBusy,
    TokenLogprob,
    ToolCall,
)
from tests.fakes import FAKE_MODEL_ID, FakeEngine, client_for, finish, leave_mid_stream

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
USAGE = {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9, "prompt_tokens_details": {"cached_tokens": 0}}


async def send(client: Client, path: str, body: Any, headers: dict[str, str] | None = None) -> Any:
    """POST a JSON body framed as a real client frames it (Quart's test client sends no Content-Length)."""
    data = json.dumps(body).encode()
    framing = {"Content-Type": "application/json", "Content-Length": str(len(data))}
    return await client.post(path, data=data, headers={**framing, **(headers or {})})


async def post(client: Client, path: str, body: Any, **headers: str) -> tuple[int, Any]:
    response = await send(client, path, body, headers)
    return response.status_code, json.loads(await response.get_data())


async def post_events(client: Client, path: str, body: Any) -> list[Any]:
    """The `data:` payloads of an event stream, decoded, with `[DONE]` kept as the string."""
    response = await send(client, path, body)
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    assert response.headers["Cache-Control"] == "no-cache"
    raw = (await response.get_data()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block.removeprefix("data: ")
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def without_ids(body: dict[str, Any], prefix: str) -> dict[str, Any]:
    assert body["id"].startswith(prefix)
    assert isinstance(body["created"], int)
    assert body["system_fingerprint"].startswith("fp_")
    return {key: value for key, value in body.items() if key not in ("id", "created", "system_fingerprint")}


# --- chat --------------------------------------------------------------------------


async def test_chat_whole_body_and_the_parsed_request() -> None:
    engine = FakeEngine([Delta(text="Hel", token_ids=(1,)), Delta(text="lo", token_ids=(2,)),
                         finish("length", text="!", cached_tokens=4)])
    status, body = await post(client_for(engine), "/v1/chat/completions", {
        "model": FAKE_MODEL_ID,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "temperature": 0.5, "top_p": 0.9, "max_completion_tokens": 12, "stop": ["\n", "END"], "seed": 3,
        "prompt_cache_key": "session-a", "extra_body": {"cache_salt": "salt"},
        "chat_template_kwargs": {"enable_thinking": False},
    })
    assert status == 200
    assert without_ids(body, "chatcmpl-") == {
        "object": "chat.completion",
        "model": FAKE_MODEL_ID,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}, "logprobs": None,
                     "finish_reason": "length"}],
        "usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 4}},
    }
    assert engine.requests == [ChatRequest(
        messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}),
        sampling=SamplingParams(temperature=0.5, top_p=0.9, max_tokens=12, stop=("\n", "END"), seed=3),
        cache=CacheOptions(cache_prompt=True, session_key="session-a", cache_salt="salt"),
        chat_template_kwargs={"enable_thinking": False},
        model=FAKE_MODEL_ID,
    )]
    # The app read the stream to its finish and closed it: nothing to cancel.
    (record,) = engine.streams
    assert record.closed
    assert not record.closed_before_finish
    assert record.num_deltas_sent == 3


async def test_chat_without_v1_prefix_and_tools_reach_the_engine() -> None:
    engine = FakeEngine()
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    status, body = await post(client_for(engine), "/chat/completions",
                              {**CHAT, "tools": [tool], "tool_choice": "auto", "cache_prompt": False, "user": "u1"})
    assert status == 200
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    (request,) = engine.requests
    assert isinstance(request, ChatRequest)
    assert request.tools is not None
    assert request.tools[0]["function"]["name"] == "get_time"
    assert request.tool_choice == "auto"
    assert request.cache == CacheOptions(cache_prompt=False, session_key="u1")
    assert request.sampling == SamplingParams()
    assert not request.stream
    assert request.model is None


@pytest.mark.parametrize(("extra", "threaded"), [
    ({}, False),
    ({"tools": [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]}, True),
    ({"user": "u" * (20 << 10)}, True),
])
async def test_a_small_body_without_schemas_is_parsed_on_the_event_loop(
        monkeypatch: pytest.MonkeyPatch, extra: dict[str, Any], threaded: bool) -> None:
    """A worker thread's round trip took 4-14 ms per request when 64 short chats arrived at once; a body of
    at most INLINE_PARSE_BYTES without schemas is validated in place, larger ones and schemas in threads."""
    calls: list[Any] = []
    run_sync = trio.to_thread.run_sync

    async def counted(function: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(function)
        return await run_sync(function, *args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    engine = FakeEngine()
    status, body = await post(client_for(engine), "/v1/chat/completions", {**CHAT, **extra})
    assert status == 200, body
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello world"}
    assert len(engine.requests) == 1
    assert bool(calls) is threaded, calls


async def test_chat_stream_role_first_then_usage_chunk_then_done() -> None:
    engine = FakeEngine([Delta(text="Hel"), Delta(text=""), Delta(text="lo"), finish("stop", completion_tokens=3)])
    events = await post_events(client_for(engine), "/v1/chat/completions",
                               {**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    *chunks, done = events
    assert done == "[DONE]"
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert len({chunk["created"] for chunk in chunks}) == 1
    assert [without_ids(chunk, "chatcmpl-") for chunk in chunks] == [
        {"object": "chat.completion.chunk", "model": FAKE_MODEL_ID, "choices": [
            {"index": 0, "delta": {"content": "Hel", "role": "assistant"}, "logprobs": None, "finish_reason": None}]},
        # A delta without text carries an empty delta object, not an empty string.
        {"object": "chat.completion.chunk", "model": FAKE_MODEL_ID, "choices": [
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]},
        {"object": "chat.completion.chunk", "model": FAKE_MODEL_ID, "choices": [
            {"index": 0, "delta": {"content": "lo"}, "logprobs": None, "finish_reason": None}]},
        {"object": "chat.completion.chunk", "model": FAKE_MODEL_ID, "choices": [
            {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]},
        {"object": "chat.completion.chunk", "model": FAKE_MODEL_ID, "choices": [],
         "usage": {**USAGE, "completion_tokens": 3, "total_tokens": 10}},
    ]
    (request,) = engine.requests
    assert request.stream
    assert request.include_usage
    assert engine.streams[0].closed
    assert not engine.streams[0].closed_before_finish


async def test_client_leaving_mid_stream_closes_the_engine_stream() -> None:
    step = trio.Event()
    engine = FakeEngine([Delta(text="a"), step, finish("stop")])
    first = await leave_mid_stream(client_for(engine), "/v1/chat/completions", {**CHAT, "stream": True})
    assert b'"role":"assistant"' in first
    (record,) = engine.streams
    # Closing before the finish is what cancels the request in the real engine.
    assert record.closed
    assert record.closed_before_finish
    assert record.num_deltas_sent == 1


async def test_chat_stream_without_include_usage_and_an_empty_first_delta() -> None:
    engine = FakeEngine([Delta(text=""), finish("stop", text="x")])
    events = await post_events(client_for(engine), "/v1/chat/completions", {**CHAT, "stream": True})
    assert [event if event == "[DONE]" else event["choices"] for event in events] == [
        # The first chunk always names the role, with content even when empty.
        [{"index": 0, "delta": {"content": "", "role": "assistant"}, "logprobs": None, "finish_reason": None}],
        [{"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": "stop"}],
        "[DONE]",
    ]
    assert engine.requests[0].stream
    assert not engine.requests[0].include_usage


async def test_include_usage_without_stream_is_accepted_and_ignored() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), "/v1/chat/completions",
                              {**CHAT, "stream_options": {"include_usage": True}})
    assert status == 200
    assert body["object"] == "chat.completion"
    assert not engine.requests[0].include_usage


CALL_A = ToolCall(index=0, id="call_a", name="get_weather", arguments='{"city": "Paris"}')
CALL_B = ToolCall(index=1, id="call_b", name="get_time", arguments="{}")


def function_body(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


async def test_chat_whole_body_with_reasoning_and_tool_calls() -> None:
    engine = FakeEngine([Delta(reasoning="I need the weather."), Delta(text="Checking."),
                         Delta(tool_calls=(CALL_A,)), Delta(tool_calls=(CALL_B,)), finish("tool_calls")])
    status, body = await post(client_for(engine), "/v1/chat/completions", {**CHAT, "reasoning_format": "auto"})
    assert status == 200
    assert body["choices"] == [{"index": 0, "message": {
        "role": "assistant", "content": "Checking.", "reasoning_content": "I need the weather.",
        "tool_calls": [function_body(CALL_A), function_body(CALL_B)],
    }, "logprobs": None, "finish_reason": "tool_calls"}]


async def test_chat_whole_body_of_tool_calls_alone_has_null_content() -> None:
    engine = FakeEngine([Delta(tool_calls=(CALL_A,)), finish("tool_calls")])
    _status, body = await post(client_for(engine), "/v1/chat/completions", CHAT)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": None,
                                             "tool_calls": [function_body(CALL_A)]}


async def test_chat_stream_sends_reasoning_and_indexed_tool_calls() -> None:
    engine = FakeEngine([Delta(reasoning="Hm."), Delta(text="Ok."), Delta(tool_calls=(CALL_A, CALL_B)),
                         finish("tool_calls")])
    events = await post_events(client_for(engine), "/v1/chat/completions", {**CHAT, "stream": True})
    assert [event if event == "[DONE]" else event["choices"][0]["delta"] for event in events] == [
        {"content": "", "role": "assistant", "reasoning_content": "Hm."},
        {"content": "Ok."},
        {"tool_calls": [{"index": 0, **function_body(CALL_A)}, {"index": 1, **function_body(CALL_B)}]},
        {},
        "[DONE]",
    ]
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("value", ["none", "auto", "deepseek"])
async def test_reasoning_format_reaches_the_engine(value: str) -> None:
    engine = FakeEngine()
    status, _body = await post(client_for(engine), "/v1/chat/completions", {**CHAT, "reasoning_format": value})
    assert status == 200
    (request,) = engine.requests
    assert isinstance(request, ChatRequest)
    assert request.reasoning_format == value


async def test_an_unknown_reasoning_format_is_400() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), "/v1/chat/completions", {**CHAT, "reasoning_format": "hidden"})
    assert status == 400
    assert body["error"]["param"] == "reasoning_format"
    assert engine.requests == []


# --- legacy completions ----------------------------------------------------------------


async def test_legacy_completion_whole_body() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), "/v1/completions",
                              {"prompt": "Once", "max_tokens": 5, "stop": "\n"})
    assert status == 200
    assert without_ids(body, "cmpl-") == {
        "object": "text_completion",
        "model": FAKE_MODEL_ID,
        "choices": [{"index": 0, "text": "Hello world", "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
    }
    assert engine.requests == [CompletionRequest(prompt="Once", sampling=SamplingParams(max_tokens=5, stop=("\n",)))]


async def test_legacy_completion_token_prompt_default_max_tokens_and_stream() -> None:
    engine = FakeEngine([Delta(text="a"), finish("length", text="b")])
    events = await post_events(client_for(engine), "/completions",
                               {"prompt": [[1, 2, 3]], "stream": True, "stream_options": {"include_usage": True}})
    *chunks, done = events
    assert done == "[DONE]"
    assert [without_ids(chunk, "cmpl-") for chunk in chunks] == [
        {"object": "text_completion", "model": FAKE_MODEL_ID,
         "choices": [{"index": 0, "text": "a", "logprobs": None, "finish_reason": None}]},
        {"object": "text_completion", "model": FAKE_MODEL_ID,
         "choices": [{"index": 0, "text": "b", "logprobs": None, "finish_reason": "length"}]},
        {"object": "text_completion", "model": FAKE_MODEL_ID, "choices": [], "usage": USAGE},
    ]
    (request,) = engine.requests
    assert isinstance(request, CompletionRequest)
    # OpenAI's legacy default of 16 tokens; a one-item list of token ids is that prompt.
    assert request.prompt == (1, 2, 3)
    assert request.sampling.max_tokens == 16
    assert request.stream
    assert request.include_usage


# --- llama.cpp's /completion ------------------------------------------------------------


async def test_native_completion_whole_body() -> None:
    engine = FakeEngine([Delta(text="a\n", token_ids=(97, 10)),
                         finish("stop", text="b", token_ids=(98,), stop_string="END", completion_tokens=3,
                                cached_tokens=2)])
    status, body = await post(client_for(engine), "/completion", {
        "prompt": "Once", "n_predict": 8, "temperature": 0.2, "seed": 5, "stop": ["END"], "return_tokens": True,
        "cache_prompt": False,
    })
    assert status == 200
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 2}}
    assert body == {
        "content": "a\nb",
        "tokens": [97, 10, 98],
        "stop": True,
        "model": FAKE_MODEL_ID,
        "stop_type": "word",
        "stopping_word": "END",
        "has_new_line": True,
        "truncated": False,
        "tokens_predicted": 3,
        "tokens_evaluated": 7,
        "tokens_cached": 2,
        "generation_settings": {
            "n_ctx": 4096, "model": FAKE_MODEL_ID, "n_predict": 8, "temperature": 0.2, "top_p": 1.0, "seed": 5,
            "stop": ["END"], "n_probs": 0, "stream": False, "cache_prompt": False, "return_tokens": True,
            "ignore_eos": False,
        },
        "timings": {
            "cache_n": 2, "prompt_n": 5, "prompt_ms": 500.0, "prompt_per_token_ms": 100.0, "prompt_per_second": 10.0,
            "predicted_n": 3, "predicted_ms": 250.0, "predicted_per_token_ms": 250.0 / 3, "predicted_per_second": 12.0,
        },
        "usage": usage,
    }
    assert engine.requests == [CompletionRequest(
        prompt="Once", sampling=SamplingParams(temperature=0.2, max_tokens=8, stop=("END",), seed=5),
        cache=CacheOptions(cache_prompt=False), return_tokens=True,
    )]


async def test_native_completion_limit_truncated_and_eos_stop_types() -> None:
    engine = FakeEngine([finish("length", text="x", prompt_tokens=10, completion_tokens=6)], context_size=16)
    client = client_for(engine)
    status, body = await post(client, "/completion", {"prompt": "p", "n_predict": -1})
    assert status == 200
    assert (body["stop_type"], body["truncated"], body["tokens"], body["has_new_line"]) == ("limit", True, [], False)
    assert body["generation_settings"]["n_predict"] == -1
    assert body["generation_settings"]["seed"] == -1
    assert engine.requests[0].sampling.max_tokens is None
    engine.reply = [finish("stop", text="x")]
    _, body = await post(client, "/completion", {"prompt": "p"})
    assert (body["stop_type"], body["stopping_word"], body["truncated"]) == ("eos", "", False)


async def test_native_completion_stream_has_no_done_and_no_usage_chunk() -> None:
    engine = FakeEngine([Delta(text="a", token_ids=(97,)), finish("stop", text="b", token_ids=(98,))])
    events = await post_events(client_for(engine), "/completion", {"prompt": "p", "stream": True})
    assert "[DONE]" not in events
    first, last = events
    assert first == {"content": "a", "tokens": [97], "stop": False}
    assert {key: last[key] for key in ("content", "tokens", "stop", "stop_type", "model", "usage")} == {
        "content": "b", "tokens": [98], "stop": True, "stop_type": "eos", "model": FAKE_MODEL_ID, "usage": USAGE,
    }
    assert last["generation_settings"]["stream"] is True
    assert engine.requests[0].stream


# --- logprobs ------------------------------------------------------------------------


LOGPROBS = (
    TokenLogprob(token="H", logprob=-0.5, top=(("H", -0.5), ("J", -1.5)), token_id=72, top_ids=(72, 74)),
    TokenLogprob(token="é", logprob=-0.25, top=(("é", -0.25),), token_id=195, top_ids=(195,)),
)


def chat_logprob(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


CHAT_LOGPROBS = {"content": [
    {**chat_logprob("H", -0.5), "top_logprobs": [chat_logprob("H", -0.5), chat_logprob("J", -1.5)]},
    {**chat_logprob("é", -0.25), "top_logprobs": [chat_logprob("é", -0.25)]},
]}


async def test_chat_logprobs_whole_and_streamed() -> None:
    engine = FakeEngine([Delta(text="H", logprobs=LOGPROBS[:1]), finish("stop", text="é", logprobs=LOGPROBS[1:])])
    client = client_for(engine)
    status, body = await post(client, "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    assert status == 200
    assert body["choices"][0]["logprobs"] == CHAT_LOGPROBS
    assert engine.requests[0].sampling == SamplingParams(logprobs=True, top_logprobs=2)

    engine.reply = [Delta(text="H", logprobs=LOGPROBS[:1]), Delta(text=""), finish("stop", logprobs=LOGPROBS[1:])]
    events = await post_events(client, "/v1/chat/completions", {**CHAT, "logprobs": True, "stream": True})
    assert [event["choices"][0]["logprobs"] for event in events[:-1]] == [
        {"content": CHAT_LOGPROBS["content"][:1]}, None, {"content": CHAT_LOGPROBS["content"][1:]},
    ]


async def test_logprobs_are_left_out_unless_asked_for() -> None:
    engine = FakeEngine([finish("stop", text="H", logprobs=LOGPROBS[:1])])
    _, body = await post(client_for(engine), "/v1/chat/completions", CHAT)
    assert body["choices"][0]["logprobs"] is None


async def test_legacy_completion_logprobs() -> None:
    engine = FakeEngine([Delta(text="H", logprobs=LOGPROBS[:1]), finish("stop", text="é", logprobs=LOGPROBS[1:])])
    status, body = await post(client_for(engine), "/v1/completions", {"prompt": "p", "logprobs": 2})
    assert status == 200
    assert body["choices"][0]["logprobs"] == {
        "tokens": ["H", "é"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"H": -0.5, "J": -1.5}, {"é": -0.25}],
    }
    assert engine.requests[0].sampling.logprobs
    assert engine.requests[0].sampling.top_logprobs == 2


async def test_native_completion_probabilities() -> None:
    # Token 195 is one byte of a two-byte character: its bytes are its own, not the character's.
    engine = FakeEngine([finish("stop", text="Hé", logprobs=LOGPROBS)])
    status, body = await post(client_for(engine), "/completion", {"prompt": "p", "n_probs": 2})
    assert status == 200
    assert body["completion_probabilities"] == [
        {"id": 72, "token": "H", "logprob": -0.5, "bytes": [72], "top_logprobs": [
            {"id": 72, "token": "H", "logprob": -0.5, "bytes": [72]},
            {"id": 74, "token": "J", "logprob": -1.5, "bytes": [74]},
        ]},
        {"id": 195, "token": "é", "logprob": -0.25, "bytes": [195], "top_logprobs": [
            {"id": 195, "token": "é", "logprob": -0.25, "bytes": [195]},
        ]},
    ]
    assert body["generation_settings"]["n_probs"] == 2
    assert engine.requests[0].sampling == SamplingParams(logprobs=True, top_logprobs=2)


# --- errors ----------------------------------------------------------------------------


def error_body(message: str, code: str | None, *, param: str | None = None,
               error_type: str = "invalid_request_error") -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion"])
@pytest.mark.parametrize("stream", [False, True])
async def test_engine_refusal_before_the_first_delta_is_a_plain_error(path: str, stream: bool) -> None:
    refusal = InvalidRequest("the prompt is 9000 tokens; the context is 4096", param="messages",
                             code="context_length_exceeded")
    engine = FakeEngine([refusal])
    body = CHAT if path == "/v1/chat/completions" else {"prompt": "p"}
    status, reply = await post(client_for(engine), path, {**body, "stream": stream})
    assert status == 400
    assert reply == error_body("the prompt is 9000 tokens; the context is 4096", "context_length_exceeded",
                               param="messages")
    assert engine.streams[0].closed


async def test_error_mid_reply_not_streaming_replaces_the_body() -> None:
    engine = FakeEngine([Delta(text="partial"), InvalidRequest("the device failed", status=500, code="device_error",
                                                               error_type="server_error")])
    status, body = await post(client_for(engine), "/v1/chat/completions", CHAT)
    assert status == 500
    assert body == error_body("the device failed", "device_error", error_type="server_error")
    assert engine.streams[0].closed


async def test_error_mid_stream_is_an_error_event_then_done() -> None:
    engine = FakeEngine([Delta(text="partial"), InvalidRequest("out of memory", status=507, code="out_of_memory",
                                                               error_type="server_error")])
    events = await post_events(client_for(engine), "/v1/chat/completions", {**CHAT, "stream": True})
    assert events[0]["choices"][0]["delta"] == {"content": "partial", "role": "assistant"}
    assert events[1:] == [error_body("out of memory", "out_of_memory", error_type="server_error"), "[DONE]"]
    assert engine.streams[0].closed


async def test_full_engine_is_503_with_retry_after() -> None:
    engine = FakeEngine(stream_error=ServerBusy("the server is at capacity; retry shortly"))
    response = await send(client_for(engine), "/v1/chat/completions", CHAT)
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "1"
    assert json.loads(await response.get_data()) == error_body(
        "the server is at capacity; retry shortly", "server_busy", error_type="server_error")
    assert len(engine.requests) == 1


async def test_full_queue_before_the_first_delta_is_503_with_its_retry_after() -> None:
    engine = FakeEngine([ServerBusy("the queue is full", retry_after_seconds=4)])
    response = await send(client_for(engine), "/v1/completions", {"prompt": "p", "stream": True})
    assert response.status_code == 503
    assert response.headers["Retry-After"] == "4"
    assert json.loads(await response.get_data())["error"]["code"] == "server_busy"


async def test_unexpected_engine_error_is_500() -> None:
    engine = FakeEngine([RuntimeError("bug")])
    status, body = await post(client_for(engine), "/v1/chat/completions", CHAT)
    assert status == 500
    assert body == error_body("internal server error", "internal_error", error_type="server_error")
    assert engine.streams[0].closed


@pytest.mark.parametrize("model", ["other-model", "FAKE-MODEL"])
async def test_unknown_model_is_404_and_never_reaches_the_engine(model: str) -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), "/v1/chat/completions", {**CHAT, "model": model})
    assert status == 404
    assert body == error_body(
        f"the model {model!r} is not served here; this server serves {FAKE_MODEL_ID!r}", "model_not_found",
        param="model")
    assert engine.requests == []


@pytest.mark.parametrize("model", [FAKE_MODEL_ID, ""])
async def test_served_or_empty_model_name_is_accepted(model: str) -> None:
    engine = FakeEngine()
    status, _ = await post(client_for(engine), "/v1/completions", {"prompt": "p", "model": model})
    assert status == 200
    assert engine.requests[0].model == model


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "n": 2}, "n"),
    ({**CHAT, "top_logprobs": 2}, "top_logprobs"),
])
async def test_invalid_body_is_400_and_never_reaches_the_engine(body: dict[str, Any], param: str) -> None:
    engine = FakeEngine()
    status, reply = await post(client_for(engine), "/v1/chat/completions", body)
    assert status == 400
    assert reply["error"]["param"] == param
    assert reply["error"]["type"] == "invalid_request_error"
    assert engine.requests == []


async def test_malformed_json_and_oversized_body() -> None:
    engine = FakeEngine()
    client = client_for(engine, max_body_bytes=64)
    response = await client.post("/v1/chat/completions", data=b'{"messages": [',
                                 headers={"Content-Type": "application/json", "Content-Length": "14"})
    assert response.status_code == 400
    assert json.loads(await response.get_data())["error"]["code"] == "invalid_json"
    # Refused on the declared length, and while reading a body sent without one.
    for response in (await send(client, "/v1/chat/completions", {**CHAT, "stop": "x" * 100}),
                     await client.post("/v1/chat/completions", json={**CHAT, "stop": "x" * 100})):
        assert response.status_code == 413
        assert response.headers["Connection"] == "close"
        assert json.loads(await response.get_data())["error"]["code"] == "request_too_large"
    assert engine.requests == []


async def test_unknown_route_and_wrong_method() -> None:
    client = client_for(FakeEngine())
    status, body = await post(client, "/v1/nothing", {})
    assert (status, body) == (404, error_body("no route POST /v1/nothing", "not_found"))
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405
    assert json.loads(await response.get_data()) == error_body(
        "GET is not allowed on /v1/chat/completions", "method_not_allowed")


# --- keys -------------------------------------------------------------------------------


async def test_api_key_guards_every_route_but_health() -> None:
    engine = FakeEngine()
    client = client_for(engine, api_key="sekret")
    response = await send(client, "/v1/chat/completions", CHAT)
    assert response.status_code == 401
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert response.headers["Connection"] == "close"
    assert json.loads(await response.get_data()) == error_body(
        "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`", "invalid_api_key",
        error_type="authentication_error")
    for wrong in ("Bearer wrong", "Basic sekret", "sekret", "Bearer sekret2"):
        status, _ = await post(client, "/v1/chat/completions", CHAT, Authorization=wrong)
        assert status == 401, wrong
    assert engine.requests == []
    status, _ = await post(client, "/v1/chat/completions", CHAT, Authorization="bearer  sekret ")
    assert status == 200
    assert len(engine.requests) == 1
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/v1/models")).status_code == 401
    # Without an admin key, the API key opens the admin routes too.
    response = await client.get("/v1/cache/stats", headers={"Authorization": "Bearer sekret"})
    assert response.status_code == 200


async def test_admin_key_guards_the_admin_routes_only() -> None:
    engine = FakeEngine()
    client = client_for(engine, api_key="user-key", admin_api_key="admin-key", metrics=True)
    user = {"Authorization": "Bearer user-key"}
    admin = {"Authorization": "Bearer admin-key"}
    for path in ("/v1/cache/reset", "/v1//cache/reset", "/v1/x/../cache/reset"):
        assert (await client.post(path, headers=user)).status_code == 401, path
    assert engine.num_resets == 0
    assert (await client.post("/v1/cache/reset", headers=admin)).status_code == 200
    assert engine.num_resets == 1
    assert (await client.get("/v1/cache/stats", headers=user)).status_code == 401
    assert (await client.get("/metrics", headers=user)).status_code == 401
    assert (await client.get("/metrics", headers=admin)).status_code == 200
    # The admin key is not the user key.
    assert (await send(client, "/v1/chat/completions", CHAT, admin)).status_code == 401
    assert (await send(client, "/v1/chat/completions", CHAT, user)).status_code == 200


async def test_two_authorization_headers_are_refused() -> None:
    engine = FakeEngine()
    client = client_for(engine, api_key="sekret")
    response = await client.post("/v1/chat/completions", json=CHAT,
                                 headers=[("Authorization", "Bearer sekret"), ("Authorization", "Bearer other")])
    assert response.status_code == 400
    assert response.headers["Connection"] == "close"
    assert json.loads(await response.get_data())["error"]["code"] == "duplicate_authorization"
    assert engine.requests == []


# --- keyless browser guards ------------------------------------------------------------------


LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


@pytest.mark.parametrize(("headers", "status", "code"), [
    ({"Host": "evil.example"}, 403, "untrusted_host"),
    ({"Host": "evil.example:8080"}, 403, "untrusted_host"),
    ({"Origin": "http://evil.example"}, 403, "untrusted_origin"),
    ({"Origin": "null"}, 403, "untrusted_origin"),
    ({"Content-Type": "text/plain"}, 415, "unsupported_media_type"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415, "unsupported_media_type"),
])
async def test_keyless_guards_refuse_before_the_engine(headers: dict[str, str], status: int, code: str) -> None:
    engine = FakeEngine()
    client = client_for(engine, trusted_hosts=LOOPBACK)
    response = await send(client, "/v1/chat/completions", CHAT, headers)
    assert response.status_code == status
    assert response.headers["Connection"] == "close"
    assert json.loads(await response.get_data())["error"]["code"] == code
    assert engine.requests == []


@pytest.mark.parametrize("headers", [
    {"Host": "127.0.0.1:8080"},
    {"Host": "[::1]:8080", "Origin": "http://localhost:3000"},
    {"Content-Type": "application/json; charset=utf-8"},
])
async def test_keyless_guards_let_local_json_through(headers: dict[str, str]) -> None:
    engine = FakeEngine()
    client = client_for(engine, trusted_hosts=LOOPBACK)
    response = await send(client, "/v1/chat/completions", CHAT, headers)
    assert response.status_code == 200
    assert len(engine.requests) == 1


async def test_a_key_replaces_the_browser_guards() -> None:
    engine = FakeEngine()
    client = client_for(engine, api_key="sekret", trusted_hosts=LOOPBACK)
    response = await send(client, "/v1/chat/completions", CHAT, {
        "Host": "api.example", "Origin": "https://app.example", "Authorization": "Bearer sekret"})
    assert response.status_code == 200


async def test_unbound_host_still_checks_the_origin_against_the_host() -> None:
    client = client_for(FakeEngine(), trusted_hosts=None)
    same = await send(client, "/v1/chat/completions", CHAT, {"Host": "box:8080", "Origin": "http://box"})
    other = await send(client, "/v1/chat/completions", CHAT, {"Host": "box", "Origin": "http://evil"})
    assert (same.status_code, other.status_code) == (200, 403)


# --- models, health, stats, tokens ------------------------------------------------------------


async def test_models_and_health() -> None:
    client = client_for(FakeEngine(model_id="org/model"))
    response = await client.get("/v1/models")
    assert json.loads(await response.get_data()) == {
        "object": "list", "data": [{"id": "org/model", "object": "model", "created": 0, "owned_by": "mlxcel"}]}
    response = await client.get("/health")
    assert response.status_code == 200
    assert json.loads(await response.get_data()) == {"status": "ok", "model": "org/model"}


async def test_cache_stats_reset_and_metrics() -> None:
    engine = FakeEngine(cache_stats={"apc_enabled": True, "num_entries": 5, "nbytes": 1024})
    client = client_for(engine, metrics=True)
    response = await client.get("/v1/cache/stats")
    assert json.loads(await response.get_data()) == {
        "apc_enabled": True, "num_entries": 5, "nbytes": 1024, "scheduler": {"num_waiting": 2, "num_running": 1}}
    response = await client.post("/v1/cache/reset")
    assert json.loads(await response.get_data()) == {"num_entries_removed": 3}
    assert engine.num_resets == 1
    assert not engine.reset_disk
    # The disk tier is cleared only when asked: ?disk=true or {"disk": true}.
    await client.post("/v1/cache/reset?disk=true")
    assert engine.reset_disk
    await client.post("/v1/cache/reset", json={"disk": True})
    assert engine.reset_disk
    assert engine.num_resets == 3
    await client.post("/v1/cache/reset", json={"disk": "yes please"})
    assert not engine.reset_disk
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert await response.get_data() == b"# HELP mlxcel_fake 1\n"


async def test_metrics_route_is_off_by_default() -> None:
    assert (await client_for(FakeEngine()).get("/metrics")).status_code == 404


async def test_tokenize_and_detokenize_use_the_engine_tokenizer() -> None:
    client = client_for(FakeEngine())
    assert await post(client, "/tokenize", {"content": "hé"}) == (200, {"tokens": [104, 195, 169]})
    status, body = await post(client, "/tokenize", {"content": "hé", "with_pieces": True})
    assert body == {"tokens": [{"id": 104, "piece": "h"}, {"id": 195, "piece": [195]}, {"id": 169, "piece": [169]}]}
    assert await post(client, "/detokenize", {"tokens": [104, 195, 169]}) == (200, {"content": "hé"})
    status, body = await post(client, "/detokenize", {"tokens": [256]})
    assert status == 400
    assert body["error"]["param"] == "tokens[0]"


PNG_URL = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
           "AAAABJRU5ErkJggg==")


async def test_serve_runs_on_the_whole_config_an_embedder_gives(start_server) -> None:
    """`mlxcel.http.serve(engine, config)`: the request limits, body bound and routes all come from it (an
    embedder once got the default limits whatever it set)."""
    import httpx

    base_url = await start_server(FakeEngine(), max_images=0, max_body_bytes=4096, metrics=True,
                                  refuse_hosted_tools=True)
    image_chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]}]}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        refused = await client.post("/v1/chat/completions", json=image_chat)
        assert refused.status_code == 400
        assert "at most 0 images" in refused.json()["error"]["message"]
        too_large = await client.post("/v1/chat/completions", content=b" " * 5000,
                                      headers={"Content-Type": "application/json"})
        assert too_large.status_code == 413
        hosted = await client.post("/v1/responses", json={"input": "hi", "tools": [{"type": "web_search"}]})
        assert hosted.status_code == 400
        assert (await client.get("/metrics")).status_code == 200
