"""`/v1/responses` against a scripted fake engine: translation, output items, events, the store, errors.

The engine records the `ChatRequest` each request became, so the translation
(input items -> chat messages, Responses fields -> chat fields) is checked
where it lands; the reply shapes are checked field by field.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from quart.typing import TestClientProtocol as Client

from mlxcel.core.tool_grammar import ENFORCED_PARAMETERS
from mlxcel.http.effort import EFFORT_BUDGETS
from mlxcel.http.responses import ENCRYPTED_PREFIX, ResponseStore
from mlxcel.types import ChatRequest, Delta, InvalidRequest, ReasoningBudget, TokenLogprob, ToolCall
from tests.fakes import FAKE_MODEL_ID, FakeEngine, client_for, finish, leave_mid_stream
from tests.integration.client_shapes import APPLY_PATCH_LARK, codex_request

WEATHER = ToolCall(index=0, id="call_w", name="get_weather", arguments='{"city": "Paris"}')
TIME = ToolCall(index=1, id="call_t", name="get_time", arguments='{"zone": "CET"}')
# Reasoning, some text, then two calls: every kind of output item.
FULL_REPLY = [Delta(reasoning="Think ", token_ids=(1, 2)), Delta(reasoning="hard.", token_ids=(3,)),
              Delta(text="Let me ", token_ids=(4,)), Delta(text="check.", token_ids=(5,)),
              Delta(tool_calls=(WEATHER,)), Delta(tool_calls=(TIME,)),
              finish("tool_calls", prompt_tokens=40, completion_tokens=12, cached_tokens=32)]
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
     "strict": True},
    {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}},
]


def framing(data: bytes, headers: dict[str, str] | None) -> dict[str, str]:
    return {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}


async def post(client: Client, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode()
    response = await client.post("/v1/responses", data=data, headers=framing(data, headers))
    return response.status_code, json.loads(await response.get_data())


async def post_events(client: Client, body: Any) -> list[dict[str, Any]]:
    """The events of a streamed reply (read as they come: Quart's test client buffers only 10 chunks)."""
    data = json.dumps({**body, "stream": True}).encode()
    chunks = []
    async with client.request("/v1/responses", method="POST", headers=framing(data, None)) as connection:
        await connection.send(data)
        await connection.send_complete()
        while True:
            try:
                chunks.append(await connection.receive())
            except trio.EndOfChannel:
                break
    assert connection.status_code == 200
    assert connection.headers is not None
    assert connection.headers["Content-Type"].startswith("text/event-stream")
    raw = b"".join(chunks).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        event_line, data_line = block.split("\n")
        event = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {event['type']}"
        events.append(event)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def chat_request(engine: FakeEngine, index: int = -1) -> ChatRequest:
    request = engine.requests[index]
    assert isinstance(request, ChatRequest)
    return request


def error_body(message_part: str, body: dict[str, Any], param: str | None, code: str | None = None) -> None:
    assert set(body) == {"error"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param, body
    assert message_part in body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code


# --- the whole reply -------------------------------------------------------------------------


async def test_whole_reply_items_usage_echo_and_the_chat_request() -> None:
    engine = FakeEngine(FULL_REPLY)
    status, body = await post(client_for(engine), {
        "model": FAKE_MODEL_ID, "input": "Weather and time in Paris?", "instructions": "Be brief.",
        "tools": TOOLS, "tool_choice": "auto", "max_output_tokens": 64, "temperature": 0.5, "top_p": 0.9,
        "prompt_cache_key": "conv-1", "metadata": {"ticket": "42"}, "prompt_cache_retention": "24h",
        "parallel_tool_calls": True,
    })
    assert status == 200
    assert body["id"].startswith("resp_")
    assert body["object"] == "response"
    assert body["status"] == "completed"
    assert body["model"] == FAKE_MODEL_ID
    assert isinstance(body["created_at"], int)
    reasoning, message, weather, time_call = body["output"]
    assert reasoning["id"].startswith("rs_")
    assert {key: value for key, value in reasoning.items() if key != "id"} == {
        "type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Think hard."}],
        "status": "completed"}
    assert message["id"].startswith("msg_")
    assert {key: value for key, value in message.items() if key != "id"} == {
        "type": "message", "role": "assistant", "status": "completed",
        "content": [{"type": "output_text", "text": "Let me check.", "annotations": []}]}
    for item, call in ((weather, WEATHER), (time_call, TIME)):
        assert item["id"].startswith("fc_")
        assert {key: value for key, value in item.items() if key != "id"} == {
            "type": "function_call", "status": "completed", "call_id": call.id, "name": call.name,
            "arguments": call.arguments}
    assert body["usage"] == {
        "input_tokens": 40, "input_tokens_details": {"cached_tokens": 32, "cache_write_tokens": 8},
        "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 52}
    assert body["instructions"] == "Be brief."
    assert body["tools"] == [
        {"type": "function", "name": "get_weather", "description": "Weather in a city.",
         "parameters": TOOLS[0]["parameters"], "strict": True},
        {"type": "function", "name": "get_time", "description": None, "parameters": TOOLS[1]["parameters"],
         "strict": None}]
    assert (body["tool_choice"], body["parallel_tool_calls"], body["temperature"], body["top_p"]) == (
        "auto", True, 0.5, 0.9)
    assert (body["max_output_tokens"], body["metadata"], body["store"], body["previous_response_id"]) == (
        64, {"ticket": "42"}, True, None)
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "medium"}
    assert body["incomplete_details"] is None
    assert body["error"] is None

    request = chat_request(engine)
    assert request.messages == ({"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Weather and time in Paris?"})
    assert [tool["function"]["name"] for tool in request.tools or ()] == ["get_weather", "get_time"]
    assert request.tools is not None
    assert request.tools[0]["function"]["parameters"] == TOOLS[0]["parameters"]
    assert request.tool_choice == "auto"
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.top_p) == (64, 0.5, 0.9)
    assert request.cache.session_key == "conv-1"
    assert request.cache.retain_seconds == 86400
    assert not request.stream
    assert engine.streams[0].closed
    assert not engine.streams[0].closed_before_finish


async def test_parallel_tool_calls_false_reaches_the_chat_pipeline() -> None:
    # The chat pipeline ends the reply with its first call (tests/core/test_output.py).
    engine = FakeEngine(FULL_REPLY)
    client = client_for(engine)
    status, body = await post(client, {"input": "hi", "tools": TOOLS, "parallel_tool_calls": False})
    assert status == 200
    assert body["parallel_tool_calls"] is False
    assert chat_request(engine).parallel_tool_calls is False
    status, body = await post(client, {"input": "hi", "tools": TOOLS})
    assert chat_request(engine, -1).parallel_tool_calls is True


async def test_length_finish_is_incomplete_with_max_output_tokens() -> None:
    engine = FakeEngine([Delta(text="a long"), finish("length", text=" answer")])
    status, body = await post(client_for(engine), {"input": "hi", "max_output_tokens": 2})
    assert status == 200
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    (message,) = body["output"]
    assert message["status"] == "incomplete"
    assert message["content"][0]["text"] == "a long answer"
    assert "completed_at" not in body


async def test_an_empty_reply_is_one_empty_message() -> None:
    status, body = await post(client_for(FakeEngine([finish("stop")])), {"input": "hi"})
    assert status == 200
    (message,) = body["output"]
    assert message["type"] == "message"
    assert message["content"] == [{"type": "output_text", "text": "", "annotations": []}]


# --- streaming -------------------------------------------------------------------------------


async def test_stream_event_sequence_matches_the_whole_reply() -> None:
    engine = FakeEngine(FULL_REPLY)
    events = await post_events(client_for(engine), {"input": "hi", "tools": TOOLS})
    assert [event["type"] for event in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed",
    ]
    created, in_progress = events[0]["response"], events[1]["response"]
    final = events[-1]["response"]
    assert created["status"] == in_progress["status"] == "in_progress"
    assert created["output"] == []
    assert created["id"] == final["id"]
    assert final["status"] == "completed"
    # Each item's events name its index and id; the done items are the final output.
    done_items = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done_items == final["output"]
    assert [event["output_index"] for event in events if event["type"] == "response.output_item.added"] == [
        0, 1, 2, 3]
    added = [event["item"] for event in events if event["type"] == "response.output_item.added"]
    assert [item["status"] for item in added] == ["in_progress"] * 4
    assert added[2]["arguments"] == ""
    text_deltas = [event for event in events if event["type"] == "response.output_text.delta"]
    assert "".join(event["delta"] for event in text_deltas) == "Let me check."
    assert {(event["item_id"], event["output_index"], event["content_index"]) for event in text_deltas} == {
        (final["output"][1]["id"], 1, 0)}
    reasoning_deltas = [event["delta"] for event in events if event["type"] == "response.reasoning_text.delta"]
    assert reasoning_deltas == ["Think ", "hard."]
    arguments = [event for event in events if event["type"] == "response.function_call_arguments.done"]
    assert [(event["item_id"], event["arguments"]) for event in arguments] == [
        (final["output"][2]["id"], WEATHER.arguments), (final["output"][3]["id"], TIME.arguments)]
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 32
    assert chat_request(engine).stream


async def test_stream_of_a_length_finish_ends_incomplete() -> None:
    events = await post_events(client_for(FakeEngine([Delta(text="cut"), finish("length")])), {"input": "hi"})
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


async def test_error_mid_stream_is_an_error_event_then_response_failed_and_not_stored() -> None:
    engine = FakeEngine([Delta(text="partial"), InvalidRequest("out of memory", status=507, code="out_of_memory",
                                                               error_type="server_error")])
    client = client_for(engine)
    events = await post_events(client, {"input": "hi"})
    assert [event["type"] for event in events[-3:]] == ["response.output_item.done", "error", "response.failed"]
    assert events[-2]["message"] == "out of memory"
    assert events[-2]["code"] == "out_of_memory"
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "out of memory"}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "partial"
    response = await client.get(f"/v1/responses/{failed['id']}")
    assert response.status_code == 404
    assert engine.streams[0].closed


async def test_error_mid_reply_not_streaming_is_the_error_body() -> None:
    engine = FakeEngine([Delta(text="partial"), InvalidRequest("the device failed", status=500, code="device_error",
                                                               error_type="server_error")])
    data = json.dumps({"input": "hi"}).encode()
    response = await client_for(engine).post("/v1/responses", data=data, headers=framing(data, None))
    assert response.status_code == 500
    assert json.loads(await response.get_data())["error"]["code"] == "device_error"


async def test_engine_refusal_before_the_first_delta_keeps_its_status() -> None:
    refusal = InvalidRequest("tool_choice 'required' is not supported", param="tool_choice", code="unsupported_value")
    for stream in (False, True):
        status, body = await post(client_for(FakeEngine([refusal])), {"input": "hi", "stream": stream})
        assert status == 400
        error_body("not supported", body, "tool_choice", "unsupported_value")


# --- input items -----------------------------------------------------------------------------


async def test_input_items_translate_into_chat_messages() -> None:
    engine = FakeEngine()
    status, _body = await post(client_for(engine), {"instructions": "Sys.", "tools": TOOLS, "input": [
        {"type": "message", "role": "developer", "content": "Dev rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "now?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_w", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_t", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_w", "output": '{"sky": "clear"}'},
        {"type": "function_call_output", "call_id": "call_t", "output": [{"type": "input_text", "text": "12:00"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Got both."}]},
        {"role": "assistant", "content": "Clear, noon."},
        {"role": "system", "content": "Late system."},
        {"role": "user", "content": "Thanks"},
    ]})
    assert status == 200
    assert chat_request(engine).messages == (
        {"role": "system", "content": "Sys."},
        {"role": "system", "content": "Dev rules."},
        {"role": "user", "content": "Weather now?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_t", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": '{"sky": "clear"}', "tool_call_id": "call_w"},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_t"},
        {"role": "assistant", "content": "Clear, noon.", "reasoning_content": "Got both."},
        {"role": "system", "content": "Late system."},
        {"role": "user", "content": "Thanks"},
    )


async def test_encrypted_reasoning_is_opaque_text_that_comes_back() -> None:
    engine = FakeEngine([Delta(reasoning="secret plan"), finish("stop", text="ok")])
    client = client_for(engine)
    status, body = await post(client, {"input": "hi", "include": ["reasoning.encrypted_content"], "store": False})
    assert status == 200
    reasoning = body["output"][0]
    assert reasoning["encrypted_content"] == ENCRYPTED_PREFIX + base64.b64encode(b"secret plan").decode()
    # A stateless client (store false) sends the item back with only the opaque form.
    status, _body = await post(client, {"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "encrypted_content": reasoning["encrypted_content"]},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]})
    assert status == 200
    assert chat_request(engine).messages[1] == {"role": "assistant", "content": "ok", "reasoning_content": "secret plan"}
    status, body = await post(client, {"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAAA"}]})
    assert status == 400
    error_body("not produced by this server", body, "input[0].encrypted_content")


# --- fields --------------------------------------------------------------------------------


async def test_tool_choice_text_format_and_logprobs_reach_the_engine() -> None:
    engine = FakeEngine([Delta(text="{}", logprobs=(TokenLogprob(token="{}", logprob=-0.5, top=(("{}", -0.5),)),)),
                         finish("stop")])
    client = client_for(engine)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    status, body = await post(client, {
        "input": "hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"},
        "text": {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 1,
    })
    assert status == 200
    request = chat_request(engine)
    assert request.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert request.sampling.grammar is not None
    assert request.sampling.logprobs
    assert request.sampling.top_logprobs == 1
    assert body["tool_choice"] == {"type": "function", "name": "get_time"}
    assert body["text"]["format"] == {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    assert body["output"][0]["content"][0]["logprobs"] == [
        {"token": "{}", "logprob": -0.5, "bytes": [123, 125],
         "top_logprobs": [{"token": "{}", "logprob": -0.5, "bytes": [123, 125]}]}]
    events = await post_events(client, {"input": "hi", "include": ["message.output_text.logprobs"]})
    (delta,) = [event for event in events if event["type"] == "response.output_text.delta"]
    assert delta["logprobs"] == [{"token": "{}", "logprob": -0.5, "top_logprobs": [{"token": "{}", "logprob": -0.5}]}]

    status, _body = await post(client, {"input": "hi", "text": {"format": {"type": "json_object"}}, "tools": TOOLS,
                                        "tool_choice": "none"})
    assert status == 200
    assert chat_request(engine).sampling.grammar is not None
    assert chat_request(engine).tool_choice == "none"


async def test_reasoning_effort_sets_the_template_knob_it_has() -> None:
    engine = FakeEngine()
    engine.model = attrs.evolve(engine.model, chat_template="{% if enable_thinking %}<think>{% endif %}")
    client = client_for(engine)
    status, body = await post(client, {"input": "hi", "reasoning": {"effort": "none", "summary": "auto"}})
    assert status == 200
    assert chat_request(engine).chat_template_kwargs == {"enable_thinking": False}
    assert body["reasoning"] == {"effort": "none", "summary": "auto"}
    engine.model = attrs.evolve(engine.model, chat_template="Reasoning: {{ reasoning_effort }}")
    status, body = await post(client, {"input": "hi", "reasoning": {"effort": "high"}})
    assert status == 200
    assert chat_request(engine).chat_template_kwargs == {"reasoning_effort": "high"}
    assert chat_request(engine).sampling.reasoning_budget == ReasoningBudget(max_tokens=EFFORT_BUDGETS["high"])
    status, body = await post(client, {"input": "hi", "reasoning": {"effort": "xhigh"}})
    assert status == 200
    assert chat_request(engine).chat_template_kwargs == {"reasoning_effort": "high"}
    assert chat_request(engine).sampling.reasoning_budget is None
    # A template with no reasoning switch: every effort is accepted (Codex sends one on every
    # request); the template renders as it is, and the effort's budget still bounds a model that thinks.
    engine.model = attrs.evolve(engine.model, chat_template="plain")
    for effort in ("medium", "high", "low"):
        status, body = await post(client, {"input": "hi", "reasoning": {"effort": effort}})
        assert status == 200
        assert body["reasoning"]["effort"] == effort
        assert chat_request(engine).chat_template_kwargs == {}
        assert chat_request(engine).sampling.reasoning_budget.max_tokens == EFFORT_BUDGETS[effort]
    status, body = await post(client, {"input": "hi", "reasoning": {"effort": "low", "summary": "none"}})
    assert status == 200
    status, body = await post(client, {"input": "hi", "reasoning": {"effort": "huge"}})
    assert status == 400
    error_body("reasoning.effort must be one of", body, "reasoning.effort")


# --- the store -------------------------------------------------------------------------------


async def test_previous_response_id_rebuilds_the_conversation_and_get_delete() -> None:
    engine = FakeEngine([Delta(reasoning="Need weather."), Delta(tool_calls=(WEATHER,)), finish("tool_calls")])
    client = client_for(engine)
    status, first = await post(client, {"input": "Weather?", "instructions": "Old rules.", "tools": TOOLS})
    assert status == 200
    engine.reply = [Delta(text="Sunny."), finish("stop")]
    status, second = await post(client, {
        "previous_response_id": first["id"], "instructions": "New rules.", "tools": TOOLS,
        "input": [{"type": "function_call_output", "call_id": "call_w", "output": "sunny"}]})
    assert status == 200
    assert second["previous_response_id"] == first["id"]
    # The previous instructions are not carried over; its input and output are.
    assert chat_request(engine).messages == (
        {"role": "system", "content": "New rules."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need weather.", "tool_calls": [
            {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_w"},
    )
    status, third = await post(client, {"previous_response_id": second["id"], "input": "And tomorrow?"})
    assert status == 200
    assert [message["role"] for message in chat_request(engine).messages] == [
        "user", "assistant", "tool", "assistant", "user"]
    assert chat_request(engine).messages[3] == {"role": "assistant", "content": "Sunny."}

    response = await client.get(f"/v1/responses/{second['id']}")
    assert response.status_code == 200
    assert json.loads(await response.get_data()) == second
    response = await client.delete(f"/v1/responses/{second['id']}")
    assert response.status_code == 200
    assert json.loads(await response.get_data()) == {"id": second["id"], "object": "response", "deleted": True}
    for method in (client.get, client.delete):
        response = await method(f"/v1/responses/{second['id']}")
        assert response.status_code == 404
        assert json.loads(await response.get_data())["error"]["code"] == "response_not_found"
    # The third response holds its whole conversation: deleting its parent does not break it.
    status, _body = await post(client, {"previous_response_id": third["id"], "input": "ok"})
    assert status == 200
    assert len(chat_request(engine).messages) == 7


async def test_unknown_previous_response_is_404_in_openai_shape() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), {"previous_response_id": "resp_nope", "input": "hi"})
    assert status == 404
    assert body == {"error": {
        "message": body["error"]["message"], "type": "invalid_request_error", "param": "previous_response_id",
        "code": "previous_response_not_found"}}
    assert engine.requests == []


async def test_store_false_is_not_kept() -> None:
    client = client_for(FakeEngine())
    status, body = await post(client, {"input": "hi", "store": False})
    assert status == 200
    assert body["store"] is False
    assert (await client.get(f"/v1/responses/{body['id']}")).status_code == 404
    status, _body = await post(client, {"input": "again", "previous_response_id": body["id"]})
    assert status == 404


async def test_a_stored_response_is_visible_to_its_own_key_and_session_only() -> None:
    client = client_for(FakeEngine())
    key_a = {"Authorization": "Bearer key-a"}
    status, body = await post(client, {"input": "hi", "prompt_cache_key": "s1"}, key_a)
    assert status == 200
    follow_up = {"input": "more", "previous_response_id": body["id"]}
    assert (await post(client, {**follow_up, "prompt_cache_key": "s2"}, key_a))[0] == 404
    assert (await post(client, {**follow_up, "prompt_cache_key": "s1"}, {"Authorization": "Bearer key-b"}))[0] == 404
    assert (await post(client, follow_up, key_a))[0] == 404
    assert (await post(client, {**follow_up, "prompt_cache_key": "s1", "cache_salt": "x"}, key_a))[0] == 404
    assert (await client.get(f"/v1/responses/{body['id']}", headers=key_a)).status_code == 404
    assert (await client.get(f"/v1/responses/{body['id']}?prompt_cache_key=s1", headers=key_a)).status_code == 200
    assert (await post(client, {**follow_up, "prompt_cache_key": "s1"}, key_a))[0] == 200


def test_the_store_evicts_least_recently_used_by_count_and_bytes() -> None:
    store = ResponseStore(max_entries=2, max_bytes=1000)
    item = ({"type": "message", "role": "user", "content": "x" * 100},)
    assert store.put("o", "a", {"id": "a"}, item, item)
    assert store.put("o", "b", {"id": "b"}, item, item)
    assert store.get("o", "a") is not None  # a is now the most recent
    assert store.put("o", "c", {"id": "c"}, item, item)
    assert store.get("o", "b") is None
    assert store.get("o", "a") is not None
    assert store.statistics().num_entries == 2
    big = ({"type": "message", "role": "user", "content": "y" * 800},)
    assert store.put("o", "d", {"id": "d"}, big, big)
    # The count bound takes c (the least recent); then a (~160 bytes) + d (~860) is over 1000 bytes: a goes too.
    assert store.get("o", "c") is None
    assert store.get("o", "a") is None
    assert store.get("o", "d") is not None
    assert (store.statistics().num_entries, store.statistics().num_evicted) == (1, 3)
    assert store.statistics().nbytes <= 1000
    assert not store.put("o", "e", {"id": "e"}, ({"content": "z" * 2000},), ())
    assert store.get("o", "e") is None
    assert store.get("other", "d") is None


async def test_store_bounds_come_from_create_app() -> None:
    client = client_for(FakeEngine(), responses_store_entries=1)
    _status, first = await post(client, {"input": "one"})
    _status, second = await post(client, {"input": "two"})
    assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404
    assert (await client.get(f"/v1/responses/{second['id']}")).status_code == 200


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"model": FAKE_MODEL_ID}, "input", "input is required"),
    ({"input": []}, "input", "at least one item"),
    ({"input": 3}, "input", "must be a list"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type", "not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item references"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role", "must be one of"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].image_url.url", "remote image URLs are off"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[0].file_id", "uploaded files are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]", "not supported by this model"),
    ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "input[0].content[0].type", "unknown content"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "call_x", "output": "1"}]},
     "input[1].call_id", "no function_call with call_id 'call_x'"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments", "is required"),
    ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools[0].type", "'local_shell' tools"),
    ({"input": "hi", "client_metadata": {"traceparent": 5}}, "client_metadata.traceparent", "must be a string"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "t", "format": {
        "type": "grammar", "syntax": "lark", "definition": "start: a\na: \"x\" a | \"y\""}}]},
     "tools[0].format.definition", "the grammar is recursive"),
    ({"input": "hi", "tools": [{"type": "custom", "name": "t", "format": {"type": "grammar", "syntax": "ebnf",
                                                                           "definition": "x"}}]},
     "tools[0].format.syntax", "must be one of"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": 5}}]},
     "tools[0].parameters", "not a valid JSON Schema"),
    ({"input": "hi", "tools": [{"type": "function", "parameters": {}}]}, "tools[0].name", "is required"),
    ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type", "not supported"),
    ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS},
     "tool_choice.name", "not in tools"),
    ({"input": "hi", "background": True}, "background", "background responses are not supported"),
    ({"input": "hi", "truncation": "auto"}, "truncation", "not supported"),
    ({"input": "hi", "include": ["file_search_call.results"]}, "include[0]", "not supported"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation", "not supported"),
    ({"input": "hi", "prompt": {"id": "p"}}, "prompt", "not supported"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be between 1"),
    ({"input": "hi", "temperature": 3}, "temperature", "must be in"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "is required"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format.type", "not supported"),
    ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity", "must be one of"),
    ({"input": "hi", "prompt_cache_retention": "1h"}, "prompt_cache_retention", "must be one of"),
    ({"input": "hi", "store": "yes"}, "store", "must be a boolean"),
    ({"input": "hi", "metadata": {"k": 1}}, "metadata.k", "must be a string"),
    ({"input": "hi", "service_tier": "flex"}, "service_tier", "one tier"),
    ({"input": "hi", "top_logprobs": 2}, "top_logprobs", "needs include"),
    ({"input": "hi", "stream_options": {"include_usage": True}}, "stream_options.include_usage", "not supported"),
    ({"input": "hi", "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "\ud800"}]},
     "input[1].content", "surrogate"),
])
async def test_bad_requests_are_400_naming_the_field_and_the_server_keeps_serving(
    body: dict[str, Any], param: str, message: str
) -> None:
    engine = FakeEngine()
    client = client_for(engine)
    status, reply = await post(client, body)
    assert status == 400, reply
    error_body(message, reply, param)
    assert engine.requests == []
    status, reply = await post(client, {"input": "hi"})
    assert status == 200
    assert reply["output"][0]["content"][0]["text"] == "Hello world"


async def test_an_unknown_model_is_404() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine), {"input": "hi", "model": "gpt-5"})
    assert status == 404
    error_body("not served here", body, "model", "model_not_found")


def test_store_bounds_are_server_settings() -> None:
    from mlxcel.config import ServerConfig, build_configs, build_serve_parser

    assert (ServerConfig().responses_store_entries, ServerConfig().responses_store_bytes) == (1024, 64 << 20)
    _engine, server = build_configs(build_serve_parser().parse_args(["--responses-store-entries", "5"]),
                                    {"MLXCEL_RESPONSES_STORE_BYTES": "1000"})
    assert (server.responses_store_entries, server.responses_store_bytes) == (5, 1000)


async def test_get_refuses_query_parameters_it_does_not_read() -> None:
    client = client_for(FakeEngine())
    _status, body = await post(client, {"input": "hi", "user": "u"})
    response = await client.get(f"/v1/responses/{body['id']}?stream=true&user=u")
    assert response.status_code == 400
    error_body("'stream' is not supported", json.loads(await response.get_data()), "stream")
    response = await client.get(f"/v1/responses/{body['id']}?user=u&user=v")
    assert response.status_code == 400
    assert (await client.get(f"/v1/responses/{body['id']}?user=u")).status_code == 200


async def test_client_leaving_mid_stream_closes_the_engine_stream_and_stores_nothing() -> None:
    step = trio.Event()
    engine = FakeEngine([Delta(text="a"), step, finish("stop")])
    client = client_for(engine)
    first = await leave_mid_stream(client, "/v1/responses", {"input": "hi", "stream": True})
    created = json.loads(first.decode().split("\n")[1].removeprefix("data: "))
    assert created["type"] == "response.created"
    (record,) = engine.streams
    assert record.closed
    assert record.closed_before_finish
    assert record.num_deltas_sent == 1
    assert (await client.get(f"/v1/responses/{created['response']['id']}")).status_code == 404


# --- Codex: custom (freeform) tools and hosted tools ------------------------------------------

PATCH = "*** Begin Patch\n*** Add File: README.md\n+hello\n*** End Patch\n"
PATCH_CALL = ToolCall(index=0, id="call_patch", name="apply_patch", arguments=json.dumps({"input": PATCH}))


async def test_codex_custom_tool_calls_and_hosted_tools() -> None:
    engine = FakeEngine([Delta(tool_calls=(PATCH_CALL,)), finish("tool_calls")])
    client = client_for(engine)
    body = codex_request(FAKE_MODEL_ID, stream=False)
    data = json.dumps(body).encode()
    response = await client.post("/v1/responses", data=data, headers=framing(data, None))
    assert response.status_code == 200
    # web_search is left out of the model's view, and the reply says so.
    assert response.headers["X-Mlxcel-Dropped-Tools"] == "web_search"
    reply = json.loads(await response.get_data())
    request = chat_request(engine)
    assert [tool["function"]["name"] for tool in request.tools] == ["shell_command", "update_plan", "apply_patch"]
    patch_tool = request.tools[2]["function"]
    assert patch_tool["parameters"]["properties"] == {"input": {"type": "string"}}
    # The grammar holds the call's input (the template is shown the Lark definition, not the regex).
    pattern = patch_tool[ENFORCED_PARAMETERS]["properties"]["input"]["pattern"]
    assert re.fullmatch(pattern, PATCH)
    assert not re.fullmatch(pattern, "not a patch")
    assert APPLY_PATCH_LARK in patch_tool["description"]
    assert [tool["type"] for tool in reply["tools"]] == ["function", "function", "custom", "web_search"]
    (item,) = reply["output"]
    assert {key: item[key] for key in ("type", "call_id", "name", "input", "status")} == {
        "type": "custom_tool_call", "call_id": "call_patch", "name": "apply_patch", "input": PATCH,
        "status": "completed"}
    # Codex's `effort: medium` on a template with no reasoning switch: accepted, with its budget.
    assert request.sampling.reasoning_budget == ReasoningBudget(max_tokens=EFFORT_BUDGETS["medium"])

    # The next turn sends the call and its output back; the model sees the call as it wrote it.
    engine.reply = [Delta(text="Done."), finish("stop")]
    history = [item, {"type": "custom_tool_call_output", "call_id": "call_patch", "output": "Success."}]
    status, reply = await post(client, codex_request(FAKE_MODEL_ID, stream=False, history=history))
    assert status == 200
    *_, assistant, result = chat_request(engine).messages
    (call,) = assistant["tool_calls"]
    assert (call["id"], call["function"]["name"]) == ("call_patch", "apply_patch")
    # Parsed for the template, as the chat route's arguments are.
    assert call["function"]["arguments"] == {"input": PATCH}
    assert dict(result) == {"role": "tool", "tool_call_id": "call_patch", "content": "Success."}

    engine.reply = [Delta(tool_calls=(PATCH_CALL,)), finish("tool_calls")]
    events = await post_events(client, codex_request(FAKE_MODEL_ID))
    kinds = [event["type"] for event in events]
    delta = next(event for event in events if event["type"] == "response.custom_tool_call_input.delta")
    done = next(event for event in events if event["type"] == "response.custom_tool_call_input.done")
    assert (delta["delta"], done["input"]) == (PATCH, PATCH)
    assert kinds.index("response.output_item.added") < kinds.index("response.custom_tool_call_input.delta") < \
        kinds.index("response.custom_tool_call_input.done") < kinds.index("response.output_item.done")
    assert events[-1]["response"]["output"][0]["type"] == "custom_tool_call"


async def test_refuse_hosted_tools_restores_the_400_and_custom_tool_choice_forces_the_call() -> None:
    engine = FakeEngine()
    status, body = await post(client_for(engine, refuse_hosted_tools=True),
                              codex_request(FAKE_MODEL_ID, stream=False))
    assert status == 400
    error_body("a hosted tool this server cannot run", body, "tools[3].type")
    assert engine.requests == []
    client = client_for(engine)
    status, body = await post(client, {**codex_request(FAKE_MODEL_ID, stream=False),
                                       "tool_choice": {"type": "custom", "name": "apply_patch"}})
    assert status == 200
    assert chat_request(engine).tool_choice == {"type": "function", "function": {"name": "apply_patch"}}
    assert body["tool_choice"] == {"type": "custom", "name": "apply_patch"}
    # A text-format custom tool takes any input.
    status, _body = await post(client, {"input": "hi", "tools": [
        {"type": "custom", "name": "note", "format": {"type": "text"}}]})
    assert status == 200
    assert ENFORCED_PARAMETERS not in chat_request(engine).tools[0]["function"]
