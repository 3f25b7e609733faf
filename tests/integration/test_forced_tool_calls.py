"""tool_choice "required" and a named function through a real server: random weights emit valid calls.

The fixture's weights are random, so left alone its replies are never tool
calls. Forced, a grammar in the model's own tool-call format (the template
decides it: Qwen's `<tool_call>` JSON, or mistral's `[TOOL_CALLS]name[ARGS]`)
leaves it nothing to sample but a call to an allowed tool whose arguments
match that tool's `parameters`; mlx-lm's parser then reads the call back.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import jsonschema
import openai
import pytest
import trio

from mlxcel.engine import Engine, run_engine
from tests.http.test_tool_loop_and_logprobs import fixture_copy
from tests.integration.test_tool_calls import TOOL_TEMPLATE
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

# Mistral's way: tools listed up front, calls written as [TOOL_CALLS]name[ARGS]{...}.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{%- elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{%- else %}{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}"
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}"
    "{%- endfor %}</s>{%- endif %}"
    "{%- endfor %}"
)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "the weather in a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
            "unit": {"type": "string", "enum": ["c", "f"]},
        }, "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "book_table", "description": "book a table",
        "parameters": {"type": "object", "properties": {
            "people": {"type": "integer", "minimum": 1, "maximum": 12},
            "when": {"type": "object", "properties": {"day": {"type": "string", "maxLength": 10},
                                                       "hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                     "required": ["day", "hour"], "additionalProperties": False},
        }, "required": ["people", "when"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "tag_photos", "description": "tag photos",
        "parameters": {"type": "object", "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
        }, "required": ["tags"], "additionalProperties": False}}},
]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
MESSAGES = [{"role": "user", "content": "Plan an evening in Paris."}]


async def start(nursery: trio.Nursery, start_server: Any, folder: Path) -> tuple[Engine, str]:
    engine = await nursery.start(run_engine, attrs.evolve(make_engine_config(), model_path=folder))
    return engine, await start_server(engine)


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 600)
    kwargs.setdefault("tools", TOOLS)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def check_calls(calls: list[Any], allowed: set[str]) -> None:
    assert calls
    for call in calls:
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("template", [TOOL_TEMPLATE, MISTRAL_TEMPLATE], ids=["json_tools", "mistral"])
async def test_forced_tool_calls_validate_for_two_formats(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path, template: str,
) -> None:
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "tools", template=template))
    client = client_for(base_url)

    free = await create(client, model=engine.model_id, temperature=0)
    assert not free.choices[0].message.tool_calls  # the grammar below does the work

    names = {tool["function"]["name"] for tool in TOOLS}
    for seed in range(4):
        # One call each: with parallel calls allowed, random weights may go on calling until max_tokens.
        reply = await create(client, model=engine.model_id, temperature=1.0, seed=seed, tool_choice="required",
                             parallel_tool_calls=False)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(choice.message.tool_calls) == 1
        check_calls(choice.message.tool_calls, names)

    named = await create(client, model=engine.model_id, temperature=1.0, seed=7, parallel_tool_calls=False,
                         tool_choice={"type": "function", "function": {"name": "book_table"}})
    check_calls(named.choices[0].message.tool_calls, {"book_table"})

    several = await create(client, model=engine.model_id, temperature=1.0, seed=3, tool_choice="required")
    check_calls(several.choices[0].message.tool_calls, names)

    stream = await create(client, model=engine.model_id, temperature=1.0, seed=11, tool_choice="required",
                          parallel_tool_calls=False, stream=True)
    chunks = await trio.to_thread.run_sync(list, stream)
    # Arguments stream in pieces (json_tools); joined by index as the SDKs join them.
    joined: dict[int, Any] = {}
    for chunk in chunks:
        for piece in (chunk.choices[0].delta.tool_calls or ()) if chunk.choices else ():
            if piece.index not in joined:
                joined[piece.index] = piece
            else:
                joined[piece.index].function.arguments += piece.function.arguments or ""
    check_calls(list(joined.values()), names)
    assert [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1] == "tool_calls"


async def test_forcing_is_refused_where_it_cannot_be_enforced(start_engine, start_server) -> None:
    # The plain fixture's template has no tool-call format.
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"model": engine.model_id, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 8}
        no_format = await http.post("/v1/chat/completions", json={**body, "tool_choice": "required"})
        assert no_format.status_code == 400
        assert no_format.json()["error"]["param"] == "tool_choice"
        fine = await http.post("/v1/chat/completions", json=body)
        assert fine.status_code == 200


async def test_forced_call_with_response_format_is_refused_and_the_cache_still_hits(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    system = {"role": "system", "content": "You plan evenings and call tools for facts. " * 12}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"model": engine.model_id, "messages": [system, *MESSAGES], "tools": TOOLS, "max_tokens": 120,
                "tool_choice": "required", "parallel_tool_calls": False, "temperature": 0}
        both = await http.post("/v1/chat/completions", json={**body, "response_format": {"type": "json_object"}})
        assert both.status_code == 400
        assert both.json()["error"]["param"] == "tool_choice"
        first = (await http.post("/v1/chat/completions", json=body)).json()
        second = (await http.post("/v1/chat/completions", json=body)).json()
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    # Constraints act on sampling only: the same prompt is a hit, and the same greedy call comes back.
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["message"]["tool_calls"][0]["function"] == \
        first["choices"][0]["message"]["tool_calls"][0]["function"]


async def test_forced_tool_use_through_the_anthropic_and_responses_apis(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    """Messages' tool_choice any / tool and Responses' required reach the same grammar as chat's."""
    import anthropic

    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    tools = [{"name": tool["function"]["name"], "description": tool["function"]["description"],
              "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    for choice, allowed in (({"type": "any", "disable_parallel_tool_use": True}, set(PARAMETERS)),
                            ({"type": "tool", "name": "tag_photos", "disable_parallel_tool_use": True},
                             {"tag_photos"})):
        message = await trio.to_thread.run_sync(partial(
            claude.messages.create, model=engine.model_id, max_tokens=400, tools=tools, tool_choice=choice,
            messages=MESSAGES, extra_body={"temperature": 1.0}))
        assert message.stop_reason == "tool_use"
        [use] = [block for block in message.content if block.type == "tool_use"]
        assert use.name in allowed
        jsonschema.validate(use.input, PARAMETERS[use.name])
    claude.close()

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    response = await trio.to_thread.run_sync(partial(
        client.responses.create, model=engine.model_id, input="Plan an evening.", max_output_tokens=400,
        tool_choice="required", parallel_tool_calls=False,
        tools=[{"type": "function", "name": tool["function"]["name"], "parameters": tool["function"]["parameters"]}
               for tool in TOOLS]))
    [call] = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])


async def test_strict_tools_leave_text_free_and_refuse_what_they_cannot_honour(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    """`strict: true` under `tool_choice: auto`: until the model writes the call marker the text is free
    (valid UTF-8 is all the grammar asks of it); what follows the marker is tested on the device
    (tests/actors/test_actor_device.py)."""
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    client = client_for(base_url)
    weather = TOOLS[0]
    strict_tool = {"type": "function", "function": {**weather["function"], "strict": True}}
    kwargs = {"model": engine.model_id, "temperature": 0, "max_tokens": 24}
    strict = await create(client, tools=[strict_tool], **kwargs)
    # Random weights write gibberish, not a call and not JSON: the grammar left the text alone.
    assert not strict.choices[0].message.tool_calls
    assert strict.choices[0].finish_reason == "length"
    assert not parses(strict.choices[0].message.content)

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        both = await http.post("/v1/chat/completions", json={
            "model": engine.model_id, "messages": MESSAGES, "tools": [strict_tool], "max_tokens": 4,
            "response_format": {"type": "json_object"}})
        assert both.status_code == 400
        assert both.json()["error"]["param"] == "tools[0].function.strict"
        typed = await http.post("/v1/chat/completions", json={
            "model": engine.model_id, "messages": MESSAGES, "max_tokens": 4,
            "tools": [{"type": "function", "function": {**weather["function"], "strict": "yes"}}]})
        assert typed.status_code == 400
        assert typed.json()["error"]["param"] == "tools[0].function.strict"
