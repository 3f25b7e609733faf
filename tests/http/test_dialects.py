"""What every dialect does alike: a reply that ends without a finish, and one builder for the whole and the stream."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from mlxcel.types import Delta, ToolCall, ToolCallPart
from tests.fakes import FAKE_MODEL_ID, FakeEngine, client_for, finish

CHAT = {"model": FAKE_MODEL_ID, "messages": [{"role": "user", "content": "hi"}]}
BODIES = {
    "/v1/chat/completions": CHAT,
    "/v1/completions": {"model": FAKE_MODEL_ID, "prompt": "hi"},
    "/completion": {"prompt": "hi"},
    "/v1/messages": {**CHAT, "max_tokens": 16},
    "/v1/responses": {"model": FAKE_MODEL_ID, "input": "hi"},
}
WEATHER_TOOL = {"name": "get_weather", "description": "The weather in a city.",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


async def post(path: str, body: dict[str, Any], reply: list[Delta]) -> tuple[int, bytes]:
    data = json.dumps(body).encode()
    response = await client_for(FakeEngine(reply)).post(path, data=data, headers={
        "Content-Type": "application/json", "Content-Length": str(len(data))})
    return response.status_code, await response.get_data()


def sse_events(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, data) of each event; `[DONE]` as its text."""
    events: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = None, ""
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = line.removeprefix("data: ")
        events.append((name, data if data == "[DONE]" else json.loads(data)))
    return events


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_whole_reply_that_ends_without_a_finish_is_a_logged_500_in_the_dialects_shape(
    path: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="mlxcel.http.reply"):
        status, raw = await post(path, BODIES[path], [Delta(text="cut")])
    assert status == 500
    body = json.loads(raw)
    if path == "/v1/messages":
        assert body == {"type": "error", "error": {"type": "api_error",
                                                    "message": "the reply ended without a finish"}}
    else:
        assert body["error"]["code"] == "internal_error"
        assert body["error"]["message"] == "the reply ended without a finish"
    assert "ended without a finish" in caplog.text


@pytest.mark.parametrize("path", list(BODIES))
async def test_a_stream_that_ends_without_a_finish_ends_with_the_dialects_error_event(
    path: str, caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.ERROR, logger="mlxcel.http.reply"):
        status, raw = await post(path, {**BODIES[path], "stream": True}, [Delta(text="cut")])
    assert status == 200
    events = sse_events(raw)
    names = [name for name, _ in events]
    if path == "/v1/messages":
        assert names[-1] == "error"
        assert events[-1][1]["error"] == {"type": "api_error", "message": "the reply ended without a finish"}
        assert "message_stop" not in names
    elif path == "/v1/responses":
        assert names[-2:] == ["error", "response.failed"]
        assert events[-2][1]["message"] == "the reply ended without a finish"
    else:
        error = events[-2][1] if path != "/completion" else events[-1][1]
        assert error["error"]["message"] == "the reply ended without a finish"
        # OpenAI's streams still end with [DONE]; llama.cpp's never have one.
        assert (events[-1][1] == "[DONE]") is (path != "/completion")
    assert "ended without a finish" in caplog.text


def blocks_of_the_stream(events: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    """The content blocks a Messages stream builds, as an SDK accumulates them."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for name, data in events:
        if name == "content_block_start":
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            else:
                partial[data["index"]] = partial.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in partial:
            blocks[data["index"]]["input"] = json.loads(partial[data["index"]])
    return blocks


async def test_the_whole_message_is_made_of_the_blocks_its_stream_opens() -> None:
    """One builder for both: thinking between two texts is three blocks whole too (the whole message once
    joined the texts), and a streamed call's input is its completed arguments."""
    reply = [
        Delta(text="Let me see. "), Delta(reasoning="They want the weather."), Delta(text="Checking."),
        Delta(tool_call_parts=(ToolCallPart(index=0, id="call_1", name="get_weather"),)),
        Delta(tool_call_parts=(ToolCallPart(index=0, arguments='{"city": '),)),
        Delta(tool_call_parts=(ToolCallPart(index=0, arguments='"Paris"}'),),
              tool_calls=(ToolCall(index=0, id="call_1", name="get_weather", arguments='{"city": "Paris"}'),)),
        finish("tool_calls"),
    ]
    body = {**BODIES["/v1/messages"], "tools": [WEATHER_TOOL]}
    status, raw = await post("/v1/messages", body, reply)
    assert status == 200
    whole = json.loads(raw)["content"]
    assert whole == [
        {"type": "text", "text": "Let me see. "},
        {"type": "thinking", "thinking": "They want the weather.", "signature": ""},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    _status, raw = await post("/v1/messages", {**body, "stream": True}, reply)
    assert blocks_of_the_stream(sse_events(raw)) == whole


async def test_a_call_that_never_completes_is_not_in_the_whole_message() -> None:
    reply = [Delta(text="Calling."), Delta(tool_call_parts=(ToolCallPart(index=0, id="call_1", name="get_weather"),)),
             finish("length")]
    _status, raw = await post("/v1/messages", {**BODIES["/v1/messages"], "tools": [WEATHER_TOOL]}, reply)
    assert json.loads(raw)["content"] == [{"type": "text", "text": "Calling."}]


def test_the_app_serves_its_route_table_and_nothing_else() -> None:
    from mlxcel.config import ServerConfig
    from mlxcel.http.app import create_app, route_table
    from mlxcel.http.route import RouteContext

    engine, config = FakeEngine(), ServerConfig(metrics=True)
    table = [(route.method, route.path) for route in route_table(RouteContext(engine, config))]
    assert len(table) == len(set(table))
    app = create_app(engine, config)
    served = {(method, rule.rule) for rule in app.url_map.iter_rules() if rule.endpoint != "static"
              for method in (rule.methods or set()) - {"HEAD", "OPTIONS"}}
    assert served == set(table)
    assert ("GET", "/metrics") not in {(route.method, route.path)
                                       for route in route_table(RouteContext(engine, ServerConfig()))}
