"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) against a scripted fake engine.

Every body and event is checked field by field, and so is the ChatRequest the
engine was handed: the translation onto the chat pipeline is what these test.
tests/integration/test_anthropic_sdk.py runs the official SDK against a real
hypercorn and real engines.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from quart.typing import TestClientProtocol as Client

from mlxcel.config import EngineConfig, PromptCacheConfig
from mlxcel.http.anthropic import translate_messages_body
from mlxcel.http.effort import EFFORT_BUDGETS
from mlxcel.types import (
    CacheOptions,
    ChatRequest,
    Delta,
    InvalidRequest,
    SamplingParams,
    ServerBusy,
    ToolCall,
)
from tests.fakes import FAKE_MODEL_ID, FakeEngine, client_for, finish, leave_mid_stream

USER = {"role": "user", "content": "hi"}
BODY = {"model": FAKE_MODEL_ID, "max_tokens": 64, "messages": [USER]}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = ToolCall(index=0, id="call_w", name="get_weather", arguments='{"city": "Paris"}')
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch={};"


async def post(client: Client, path: str, body: Any, **headers: str) -> tuple[int, Any, Any]:
    data = json.dumps(body).encode()
    framing = {"Content-Type": "application/json", "Content-Length": str(len(data)),
               "anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219"}
    response = await client.post(path, data=data, headers={**framing, **headers})
    return response.status_code, json.loads(await response.get_data()), response.headers


async def events_of(client: Client, body: Any) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a Messages stream; each data's `type` is its event name."""
    data = json.dumps({**body, "stream": True}).encode()
    response = await client.post("/v1/messages", data=data, headers={
        "Content-Type": "application/json", "Content-Length": str(len(data))})
    assert response.status_code == 200
    assert response.mimetype == "text/event-stream"
    raw = (await response.get_data()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        name = name_line.removeprefix("event: ")
        payload = json.loads(data_line.removeprefix("data: "))
        assert payload["type"] == name
        events.append((name, payload))
    return events


def anthropic_error(kind: str, needle: str, body: Any) -> None:
    assert body["type"] == "error"
    assert body["error"]["type"] == kind
    assert needle in body["error"]["message"], body["error"]["message"]


def only_request(engine: FakeEngine) -> ChatRequest:
    (request,) = engine.requests
    assert isinstance(request, ChatRequest)
    return request


# --- whole messages ----------------------------------------------------------------


async def test_whole_message_body_usage_and_the_request_the_engine_got() -> None:
    engine = FakeEngine([Delta(text="Hel"), finish("stop", text="lo", prompt_tokens=40, cached_tokens=32,
                                                     completion_tokens=3)])
    status, body, _ = await post(client_for(engine), "/v1/messages", {
        **BODY, "system": "be brief", "stop_sequences": ["END", "\n\n"], "temperature": 0.5, "top_p": 0.9,
        "top_k": 20, "metadata": {"user_id": "user_abc_session_1"},
    })
    assert status == 200
    assert body["id"].startswith("msg_")
    assert {key: value for key, value in body.items() if key != "id"} == {
        "type": "message", "role": "assistant", "model": FAKE_MODEL_ID,
        "content": [{"type": "text", "text": "Hello"}], "stop_reason": "end_turn", "stop_sequence": None,
        # The three input counts sum to the prompt: 32 read, the other 8 written to the cache.
        "usage": {"input_tokens": 8, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32,
                  "output_tokens": 3},
    }
    assert only_request(engine) == ChatRequest(
        messages=({"role": "system", "content": "be brief"}, USER),
        sampling=SamplingParams(temperature=0.5, top_p=0.9, top_k=20, max_tokens=64, stop=("END", "\n\n")),
        cache=CacheOptions(session_key="user_abc_session_1"),
        model=FAKE_MODEL_ID,
    )
    assert engine.streams[0].closed
    assert not engine.streams[0].closed_before_finish


async def test_without_a_prompt_cache_nothing_is_written_to_it() -> None:
    config = EngineConfig(prompt_cache=PromptCacheConfig(enabled=False))
    engine = FakeEngine([finish("stop", text="x", prompt_tokens=40, cached_tokens=0)], config=config)
    _, body, _ = await post(client_for(engine), "/v1/messages", BODY)
    assert body["usage"] == {"input_tokens": 40, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                             "output_tokens": 2}


STOPS = [
    (finish("stop", text="done"), "end_turn", None),
    (finish("length", text="cut of"), "max_tokens", None),
    (finish("stop", text="done", stop_string="END"), "stop_sequence", "END"),
    (finish("tool_calls", tool_calls=(CALL,)), "tool_use", None),
]


@pytest.mark.parametrize(("last", "reason", "sequence"), STOPS)
async def test_the_four_stop_reasons(last: Delta, reason: str, sequence: str | None) -> None:
    engine = FakeEngine([last])
    _, body, _ = await post(client_for(engine), "/v1/messages", {**BODY, "stop_sequences": ["END"],
                                                                  "tools": [WEATHER_TOOL]})
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, sequence)
    events = await events_of(client_for(FakeEngine([last])), {**BODY, "stop_sequences": ["END"],
                                                              "tools": [WEATHER_TOOL]})
    (message_delta,) = [data for name, data in events if name == "message_delta"]
    assert message_delta["delta"] == {"stop_reason": reason, "stop_sequence": sequence}


async def test_thinking_text_and_tool_use_blocks_in_that_order() -> None:
    other = ToolCall(index=1, id="call_t", name="get_time", arguments="not json")
    engine = FakeEngine([Delta(reasoning="Need the "), Delta(reasoning="weather."), Delta(text="Checking."),
                         Delta(tool_calls=(CALL,)), Delta(tool_calls=(other,)), finish("tool_calls")])
    _, body, _ = await post(client_for(engine), "/v1/messages", {**BODY, "tools": [WEATHER_TOOL]})
    assert body["content"] == [
        {"type": "thinking", "thinking": "Need the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_w", "name": "get_weather", "input": {"city": "Paris"}},
        # Arguments that are no JSON object are kept, as text, under "arguments".
        {"type": "tool_use", "id": "call_t", "name": "get_time", "input": {"arguments": "not json"}},
    ]
    assert body["stop_reason"] == "tool_use"


# --- streaming --------------------------------------------------------------------------


async def test_stream_event_sequence_blocks_and_usage() -> None:
    engine = FakeEngine([Delta(reasoning="Hmm."), Delta(text="Hel"), Delta(text=""), Delta(text="lo"),
                         Delta(tool_calls=(CALL,)),
                         finish("tool_calls", prompt_tokens=50, cached_tokens=48, completion_tokens=9)])
    events = await events_of(client_for(engine), {**BODY, "tools": [WEATHER_TOOL]})
    names = [name for name, _ in events]
    assert names == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop",
    ]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_")
    assert {key: value for key, value in start.items() if key != "id"} == {
        "type": "message", "role": "assistant", "model": FAKE_MODEL_ID, "content": [], "stop_reason": None,
        "stop_sequence": None,
        # The usage is only known at the end: message_delta carries it.
        "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
                  "output_tokens": 0},
    }
    blocks = [(data["index"], data["content_block"]) for name, data in events if name == "content_block_start"]
    assert blocks == [(0, {"type": "thinking", "thinking": "", "signature": ""}), (1, {"type": "text", "text": ""}),
                      (2, {"type": "tool_use", "id": "call_w", "name": "get_weather", "input": {}})]
    deltas = [(data["index"], data["delta"]) for name, data in events if name == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "Hmm."}),
        (1, {"type": "text_delta", "text": "Hel"}), (1, {"type": "text_delta", "text": "lo"}),
        (2, {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}),
    ]
    assert [data["index"] for name, data in events if name == "content_block_stop"] == [0, 1, 2]
    assert events[-2][1] == {
        "type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 2, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 48,
                  "output_tokens": 9},
    }
    assert only_request(engine).stream
    assert not engine.streams[0].closed_before_finish


async def test_a_one_delta_reply_has_its_usage_in_message_start_too() -> None:
    engine = FakeEngine([finish("stop", text="ok", prompt_tokens=20, cached_tokens=16)])
    events = await events_of(client_for(engine), BODY)
    usage = events[0][1]["message"]["usage"]
    assert usage == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                     "output_tokens": 0}
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "content_block_stop", "message_delta", "message_stop"]


async def test_a_client_leaving_mid_stream_closes_the_engine_stream() -> None:
    step = trio.Event()
    engine = FakeEngine([Delta(text="a"), step, finish("stop")])
    first = await leave_mid_stream(client_for(engine), "/v1/messages", {**BODY, "stream": True})
    assert b"event: message_start" in first
    (record,) = engine.streams
    # Closing before the finish is what cancels the request in the real engine.
    assert record.closed
    assert record.closed_before_finish


async def test_an_error_mid_stream_is_an_error_event_in_anthropic_shape() -> None:
    engine = FakeEngine([Delta(text="par"), InvalidRequest("the model failed", status=500)])
    events = await events_of(client_for(engine), BODY)
    assert [name for name, _ in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                            "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "the model failed"}}


async def test_an_error_mid_way_through_a_whole_message_is_an_error_body() -> None:
    engine = FakeEngine([Delta(text="par"), ServerBusy("shed", retry_after_seconds=3)])
    status, body, headers = await post(client_for(engine), "/v1/messages", BODY)
    assert status == 529
    assert headers["Retry-After"] == "3"
    anthropic_error("overloaded_error", "shed", body)
    assert not engine.streams[0].closed_before_finish


# --- translation onto the chat pipeline ---------------------------------------------------


TOOL_ROUND_TRIP = [
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Rome?"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Two cities.", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"},
        {"type": "text", "text": "Checking both."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}},
    ]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
         "content": [{"type": "text", "text": "timeout"}, {"type": "text", "text": "retry later"}]},
        {"type": "text", "text": "Summarize."},
    ]},
]


async def test_a_tool_round_trip_reaches_the_engine_as_chat_messages() -> None:
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", {
        **BODY, "system": [{"type": "text", "text": "You help."}, {"type": "text", "text": "Be brief."}],
        "messages": TOOL_ROUND_TRIP, "tools": [WEATHER_TOOL], "tool_choice": {"type": "auto"},
    })
    assert status == 200
    request = only_request(engine)
    assert [dict(message) for message in request.messages] == [
        {"role": "system", "content": "You help.\n\nBe brief."},
        {"role": "user", "content": "Weather in Paris\n\nand Rome?"},
        # Templates get the arguments parsed (as on /v1/chat/completions); redacted thinking is dropped.
        {"role": "assistant", "content": "Checking both.", "reasoning_content": "Two cities.", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "toolu_2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: timeout\n\nretry later"},
        {"role": "user", "content": "Summarize."},
    ]
    assert request.tools == ({"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_TOOL["input_schema"]}},)
    assert request.tool_choice == "auto"


@pytest.mark.parametrize(("choice", "translated"), [
    ({"type": "auto"}, "auto"),
    ({"type": "none"}, "none"),
    ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
])
async def test_tool_choice_translation(choice: dict[str, Any], translated: Any) -> None:
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", {**BODY, "tools": [WEATHER_TOOL],
                                                                    "tool_choice": choice})
    assert status == 200
    assert only_request(engine).tool_choice == translated


async def test_a_strict_tool_is_chats_strict_tool_and_its_errors_name_the_messages_path() -> None:
    translated = translate_messages_body({**BODY, "tools": [{**WEATHER_TOOL, "strict": True}]}).body
    assert translated["tools"][0]["function"]["strict"] is True
    engine = FakeEngine()
    status, answer, _ = await post(client_for(engine), "/v1/messages",
                                   {**BODY, "tools": [{**WEATHER_TOOL, "strict": "yes"}]})
    assert status == 400
    anthropic_error("invalid_request_error", "tools[0].strict", answer)


def test_disable_parallel_tool_use_is_parallel_tool_calls_false() -> None:
    translated = translate_messages_body({**BODY, "tools": [WEATHER_TOOL], "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}}).body
    assert translated["tool_choice"] == "required"
    assert translated["parallel_tool_calls"] is False
    plain = translate_messages_body({**BODY, "tool_choice": {"type": "auto", "disable_parallel_tool_use": False}})
    assert "parallel_tool_calls" not in plain.body


@pytest.mark.parametrize(("thinking", "enabled"), [
    ({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "disabled"}, False), ({"type": "adaptive"}, True)])
async def test_thinking_switches_the_templates_enable_thinking(thinking: dict[str, Any], enabled: bool) -> None:
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", {**BODY, "max_tokens": 2048, "thinking": thinking})
    assert status == 200
    assert only_request(engine).chat_template_kwargs == {"enable_thinking": enabled}
    budget = only_request(engine).sampling.reasoning_budget
    # An explicit budget is the one the model thinks to.
    assert (budget and budget.max_tokens) == thinking.get("budget_tokens")


@pytest.mark.parametrize(("template", "kwargs"), [
    ("{% if enable_thinking %}<think>{% endif %}", {"enable_thinking": True}),
    ("Reasoning: {{ reasoning_effort }}", {"reasoning_effort": "high"}),
    ("plain", None),
])
async def test_output_config_effort_maps_as_reasoning_effort_does(template: str, kwargs: Any) -> None:
    engine = FakeEngine()
    engine.model = attrs.evolve(engine.model, chat_template=template)
    status, _, _ = await post(client_for(engine), "/v1/messages", {**BODY, "output_config": {"effort": "high"}})
    assert status == 200
    assert (only_request(engine).chat_template_kwargs or None) == kwargs
    assert only_request(engine).sampling.reasoning_budget.max_tokens == EFFORT_BUDGETS["high"]


async def test_thinking_budget_wins_over_the_effort_and_format_is_structured_output() -> None:
    engine = FakeEngine()
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    status, _, _ = await post(client_for(engine), "/v1/messages", {
        **BODY, "max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2000},
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}})
    assert status == 200
    request = only_request(engine)
    assert request.sampling.reasoning_budget.max_tokens == 2000
    assert request.sampling.grammar is not None
    assert '"city"' in request.sampling.grammar


@pytest.mark.parametrize(("keep", "kept"), [
    ("all", ["first", "second", "third"]),  # what Claude Code sends: nothing changes
    ({"type": "thinking_turns", "value": 1}, [None, None, "third"]),
    ({"type": "thinking_turns", "value": 2}, [None, "second", "third"]),
    ({"type": "thinking_turns", "value": 0}, [None, None, None]),
])
async def test_clear_thinking_keeps_the_last_turns_thinking(keep: Any, kept: list[str | None]) -> None:
    def turn(thought: str) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": [{"type": "thinking", "thinking": thought, "signature": "s"},
                                                   {"type": "text", "text": "ok"}]}, USER]

    messages = [USER, *turn("first"), *turn("second"), *turn("third")]
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", {
        **BODY, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}, "messages": messages,
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": keep}]}})
    assert status == 200
    assistants = [message for message in only_request(engine).messages if message["role"] == "assistant"]
    assert [message.get("reasoning_content") for message in assistants] == kept


@pytest.mark.parametrize(("controls", "retain"), [
    ([], 0.0), ([{"type": "ephemeral"}], 300.0), ([{"type": "ephemeral", "ttl": "5m"}] * 2, 300.0),
    ([{"type": "ephemeral", "ttl": "1h"}, {"type": "ephemeral"}, {"type": "ephemeral"},
      {"type": "ephemeral", "ttl": "5m"}], 3600.0),
])
async def test_cache_control_sets_the_longest_retention(controls: list[Any], retain: float) -> None:
    places = [
        lambda control: {"tools": [{**WEATHER_TOOL, "cache_control": control}]},
        lambda control: {"system": [{"type": "text", "text": "s", "cache_control": control}]},
        lambda control: {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "u", "cache_control": control}]}]},
        lambda control: {"metadata": {}},
    ]
    body: dict[str, Any] = dict(BODY)
    for place, control in zip(places, controls, strict=False):
        body.update(place(control))
    if len(controls) == 4:
        body["messages"] = [
            {"role": "user", "content": [{"type": "text", "text": "u", "cache_control": controls[2]}]},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok",
                                          "cache_control": controls[3]}]},
        ]
        body["tools"] = [{**WEATHER_TOOL, "cache_control": controls[0]}]
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", body)
    assert status == 200
    assert only_request(engine).cache.retain_seconds == retain


async def test_top_level_cache_control_is_one_more_breakpoint() -> None:
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", {
        **BODY, "cache_control": {"type": "ephemeral", "ttl": "1h"}, "speed": "standard", "service_tier": "auto"})
    assert status == 200
    assert only_request(engine).cache.retain_seconds == 3600.0


async def test_a_chat_validation_error_names_the_messages_path() -> None:
    engine = FakeEngine()
    bad_schema = {**WEATHER_TOOL, "input_schema": {"type": "object", "properties": {"city": {"type": 12}}}}
    status, body, _ = await post(client_for(engine), "/v1/messages", {**BODY, "tools": [bad_schema]})
    assert status == 400
    anthropic_error("invalid_request_error", "tools[0].input_schema is not a valid JSON Schema", body)
    # A lone surrogate in a tool result, found by the chat parser on the translated request.
    messages = [*TOOL_ROUND_TRIP[:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": "\ud800"}]}]
    status, body, _ = await post(client_for(engine), "/v1/messages", {**BODY, "messages": messages})
    assert status == 400
    anthropic_error("invalid_request_error", "messages[2].content[1].content contains an unpaired UTF-16", body)
    status, body, _ = await post(client_for(engine), "/v1/messages", {**BODY, "stop_sequences": ["ok", ""]})
    anthropic_error("invalid_request_error", "stop_sequences[1] must not be empty", body)
    assert engine.requests == []


# --- volatile system lines ---------------------------------------------------------------


def system_of(engine: FakeEngine, index: int) -> str:
    request = engine.requests[index]
    assert isinstance(request, ChatRequest)
    assert request.messages[0]["role"] == "system"
    return str(request.messages[0]["content"])


async def test_the_billing_header_is_cut_so_the_system_prompt_stays_the_same() -> None:
    engine = FakeEngine()
    client = client_for(engine)
    for cch in ("3f9a1", "77b02"):
        status, _, _ = await post(client, "/v1/messages", {**BODY, "system": [
            {"type": "text", "text": BILLING.format(cch)},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]})
        assert status == 200
        # A string system prompt: the line is cut, the rest kept.
        status, _, _ = await post(client, "/v1/messages", {**BODY, "system": BILLING.format(cch) + "\nYou help."})
        assert status == 200
    assert [system_of(engine, index) for index in range(4)] == ["You are Claude Code.", "You help."] * 2


async def test_with_normalization_off_the_header_reaches_the_prompt() -> None:
    engine = FakeEngine()
    client = client_for(engine, normalize_volatile_system=False)
    await post(client, "/v1/messages", {**BODY, "system": [
        {"type": "text", "text": BILLING.format("3f9a1")}, {"type": "text", "text": "You are Claude Code."}]})
    assert system_of(engine, 0) == BILLING.format("3f9a1") + "\n\nYou are Claude Code."


async def test_custom_volatile_patterns() -> None:
    engine = FakeEngine()
    client = client_for(engine, volatile_system_patterns=(r"^Date: .*\n?",))
    await post(client, "/v1/messages", {**BODY, "system": "Date: 2026-05-01\nYou help.\n" + BILLING.format("1")})
    assert system_of(engine, 0) == "You help.\n" + BILLING.format("1")


# --- count_tokens ---------------------------------------------------------------------------


async def test_count_tokens_renders_the_translated_request_without_generating() -> None:
    engine = FakeEngine(num_prompt_tokens=123)
    status, body, _ = await post(client_for(engine), "/v1/messages/count_tokens", {
        "model": FAKE_MODEL_ID, "system": "s", "messages": TOOL_ROUND_TRIP, "tools": [WEATHER_TOOL]})
    assert (status, body) == (200, {"input_tokens": 123})
    assert engine.requests == []
    (counted,) = engine.counted
    assert [message["role"] for message in counted.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert counted.tools is not None
    for bad, needle in (({"max_tokens": 5}, "`max_tokens` is not supported on /v1/messages/count_tokens"),
                        ({"model": "other"}, "the model 'other' is not served here")):
        status, body, _ = await post(client_for(engine), "/v1/messages/count_tokens", {"messages": [USER], **bad})
        assert status in (400, 404)
        anthropic_error("invalid_request_error" if status == 400 else "not_found_error", needle, body)


# --- bad input ----------------------------------------------------------------------------


def five_breakpoints() -> dict[str, Any]:
    control = {"type": "ephemeral"}
    return {**BODY, "system": [{"type": "text", "text": str(index), "cache_control": control} for index in range(3)],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": control},
                                                      {"type": "text", "text": "b", "cache_control": control}]}]}


BAD = [
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]},
     "messages[0].content[0].tool_use_id 'toolu_x' matches no earlier, unanswered tool_use block"),
    ({**BODY, "messages": [*TOOL_ROUND_TRIP, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "again"}]}]},
     "messages[4].content[0].tool_use_id 'toolu_1' matches no earlier, unanswered"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]},
     "messages[0].content[0].type: unknown or unsupported block type 'video'"),
    ({"model": FAKE_MODEL_ID, "messages": [USER]}, "max_tokens is required"),
    (five_breakpoints(), "at most 4 blocks with cache_control; messages[0].content[1].cache_control is number 5"),
    ({**BODY, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
     "system[0].cache_control.ttl must be '5m' or '1h'"),
    ({**BODY, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]},
     "not an image this server reads"),
    ({**BODY, "container": "c1"}, "`container` is not supported on /v1/messages"),
    ({**BODY, "mcp_servers": []}, "`mcp_servers` is not supported"),
    ({**BODY, "service_tier": "priority"}, "service_tier must be one of auto, standard_only"),
    ({**BODY, "messages": [USER, {"role": "assistant", "content": "The answer is"}]},
     "a final assistant message (a prefill to continue) is not supported"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "tool_result", "tool_use_id": "t"}]}]}, "tool_result blocks must come before any text"),
    ({**BODY, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "Anthropic's server tools (web_search_20250305) are not supported"),
    ({**BODY, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "unknown or unsupported block type 'tool_use' here; expected one of text, image, tool_result"),
    ({**BODY, "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
    ({**BODY, "tools": [WEATHER_TOOL], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice names 'nope', which is not in tools"),
    ({**BODY, "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens must be an integer"),
    ({**BODY, "messages": []}, "messages must hold at least one message"),
    ({**BODY, "speed": "fast"}, "speed must be 'standard' here"),
    ({**BODY, "inference_geo": "eu"}, "`inference_geo` is not supported"),
    ({**BODY, "output_config": {"format": {"type": "json_schema"}}}, "output_config.format.schema is required"),
    ({**BODY, "output_config": {"effort": "extreme"}}, "output_config.effort must be one of low, medium"),
    ({**BODY, "output_config": {"task_budget": 5}}, "`task_budget` is not supported"),
    ({**BODY, "temperature": 1.5}, "temperature must be between 0 and 1"),
    ({**five_breakpoints(), "messages": [USER], "cache_control": {"type": "ephemeral"},
      "tools": [{**WEATHER_TOOL, "cache_control": {"type": "ephemeral"}}]},
     "at most 4 blocks with cache_control; cache_control is number 5"),
    ({**BODY, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role must be 'user' or 'assistant'"),
    ({**BODY, "max_tokens": 0}, "max_tokens must be between 1 and"),
    ({**BODY, "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
     "context_management.edits[0].type 'clear_tool_uses_20250919' is not supported"),
    ({**BODY, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": {
        "type": "thinking_turns", "value": -1}}]}}, "context_management.edits[0].keep.value must be a non-negative"),
]


@pytest.mark.parametrize(("body", "needle"), BAD)
async def test_bad_input_is_a_400_in_anthropic_shape_and_the_server_keeps_serving(body: Any, needle: str) -> None:
    engine = FakeEngine()
    client = client_for(engine)
    status, answer, _ = await post(client, "/v1/messages", body)
    assert status == 400, answer
    assert answer == {"type": "error", "error": {"type": "invalid_request_error", "message": answer["error"]["message"]}}
    anthropic_error("invalid_request_error", needle, answer)
    assert engine.requests == []
    status, answer, _ = await post(client, "/v1/messages", BODY)
    assert status == 200
    assert answer["content"] == [{"type": "text", "text": "Hello world"}]


async def test_an_engine_refusal_and_an_unknown_model_in_anthropic_shape() -> None:
    refusal = InvalidRequest("the prompt is 9000 tokens; the context is 4096", param="messages",
                             code="context_length_exceeded")
    for stream in (False, True):
        status, body, _ = await post(client_for(FakeEngine([refusal])), "/v1/messages", {**BODY, "stream": stream})
        assert status == 400
        assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "messages: the prompt is 9000 tokens; the context is 4096"}}
    status, body, _ = await post(client_for(FakeEngine()), "/v1/messages", {**BODY, "model": "claude-sonnet-4-5"})
    assert status == 404
    anthropic_error("not_found_error", "the model 'claude-sonnet-4-5' is not served here", body)


async def test_a_full_server_is_529_overloaded_with_retry_after() -> None:
    engine = FakeEngine(stream_error=ServerBusy("the server is at capacity; retry shortly", retry_after_seconds=2))
    status, body, headers = await post(client_for(engine), "/v1/messages", BODY)
    assert status == 529
    assert headers["Retry-After"] == "2"
    assert body == {"type": "error", "error": {"type": "overloaded_error",
                                               "message": "the server is at capacity; retry shortly"}}
    status, body, _ = await post(client_for(engine), "/v1/chat/completions", {"messages": [USER]})
    # The OpenAI routes keep their 503.
    assert status == 503


async def test_unknown_paths_and_methods_under_messages_answer_in_anthropic_shape() -> None:
    client = client_for(FakeEngine())
    response = await client.get("/v1/messages")
    assert response.status_code == 405
    anthropic_error("invalid_request_error", "GET is not allowed on /v1/messages", await response.get_json())
    response = await client.post("/v1/messages/batches", json={})
    assert response.status_code == 404
    anthropic_error("not_found_error", "no route POST /v1/messages/batches", await response.get_json())
    response = await client.get("/v1/nothing")
    assert (await response.get_json())["error"]["code"] == "not_found"


# --- auth ---------------------------------------------------------------------------------


async def test_x_api_key_or_bearer_one_credential_and_anthropic_shaped_401() -> None:
    engine = FakeEngine()
    client = client_for(engine, api_key="sekret")
    assert (await post(client, "/v1/messages", BODY, **{"x-api-key": "sekret"}))[0] == 200
    assert (await post(client, "/v1/messages", BODY, Authorization="Bearer sekret"))[0] == 200
    # x-api-key opens the OpenAI routes too.
    assert (await post(client, "/v1/chat/completions", {"messages": [USER]}, **{"x-api-key": "sekret"}))[0] == 200
    assert len(engine.requests) == 3
    for headers in ({}, {"x-api-key": "wrong"}, {"x-api-key": "sekret2"}, {"x-api-key": ""},
                    {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        status, body, response_headers = await post(client, "/v1/messages", BODY, **headers)
        assert status == 401, headers
        assert response_headers["Connection"] == "close"
        assert body == {"type": "error", "error": {
            "type": "authentication_error",
            "message": "a valid API key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`"}}
        status, _, _ = await post(client, "/v1/messages/count_tokens", {"messages": [USER]}, **headers)
        assert status == 401
    status, body, _ = await post(client, "/v1/chat/completions", {"messages": [USER]}, **{"x-api-key": "wrong"})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"
    # Both headers, even both right: refused as ambiguous.
    status, body, _ = await post(client, "/v1/messages", BODY, Authorization="Bearer sekret", **{"x-api-key": "sekret"})
    assert status == 400
    anthropic_error("invalid_request_error", "not both", body)
    assert len(engine.requests) == 3
    assert engine.counted == []
    data = json.dumps(BODY).encode()
    response = await client.post("/v1/messages", data=data, headers=[
        ("Content-Type", "application/json"), ("Content-Length", str(len(data))),
        ("x-api-key", "sekret"), ("x-api-key", "sekret")])
    assert response.status_code == 400
    anthropic_error("invalid_request_error", "send exactly one x-api-key header", await response.get_json())


async def test_a_keyless_server_takes_any_credentials() -> None:
    engine = FakeEngine()
    status, _, _ = await post(client_for(engine), "/v1/messages", BODY, Authorization="Bearer a", **{"x-api-key": "b"})
    assert status == 200


def test_translation_is_a_plain_function_with_origins() -> None:
    translation = translate_messages_body({**BODY, "system": "s", "messages": TOOL_ROUND_TRIP})
    assert translation.origins == (
        ("system", "system"), ("messages[0]", "messages[0].content"), ("messages[1]", "messages[1].content"),
        ("messages[2].content[0]", "messages[2].content[0].content"),
        ("messages[2].content[1]", "messages[2].content[1].content"), ("messages[2]", "messages[2].content"))
    assert attrs.asdict(translation)["retain_seconds"] == 0.0
