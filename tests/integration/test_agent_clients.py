"""The clients agents are built on parse mlxcel's tool-call and reasoning replies, streaming and not.

Each client here is the real one (the `openai` SDK, sync and async;
`langchain-openai`'s `ChatOpenAI.bind_tools`; `litellm.completion` with an
`openai/` model) talking to a real hypercorn serving mlxcel's HTTP app on
loopback. Only the engine is scripted: a `FakeEngine` replies with reasoning
and tool calls, because the test suite's random-weight models cannot emit a
tool call (the parsing of real model output into calls is tested elsewhere,
tests/core/test_output.py and tests/integration/test_tool_calls.py). Each test
checks what the client reports (names, parsed arguments, ids, finish reason,
reasoning where the client exposes it) and, for a follow-up turn that sends
the assistant's calls and a `role: "tool"` result back in the client's own
message form, that the engine received those messages intact.

No test reaches past loopback: litellm reads its bundled model cost map
(`LITELLM_LOCAL_MODEL_COST_MAP`, set before it is imported) and its telemetry
is off; every client runs with a short timeout and no retries.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import Any

import pytest
import trio

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import langchain_openai  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage  # noqa: E402

from mlxcel.http.serve import serve  # noqa: E402
from mlxcel.types import ChatRequest, Delta, ToolCall  # noqa: E402
from tests.fakes import FAKE_MODEL_ID, FakeEngine, finish  # noqa: E402
from tests.support import loopback

litellm.telemetry = False

TIMEOUT = 10.0

WEATHER = ToolCall(index=0, id="call_weather_0", name="get_weather", arguments='{"city": "Paris"}')
TIME = ToolCall(index=1, id="call_time_1", name="get_time", arguments='{"zone": "Europe/Paris", "hour24": true}')
REASONING = "The user wants the weather; I should call get_weather."

# (a) some reasoning, then one call.
ONE_CALL = [Delta(reasoning="The user wants the weather; "), Delta(reasoning="I should call get_weather."),
            Delta(tool_calls=(WEATHER,)), finish("tool_calls")]
# (b) two calls in one reply, completed one delta apart.
TWO_CALLS = [Delta(tool_calls=(WEATHER,)), Delta(tool_calls=(TIME,)), finish("tool_calls")]
FOLLOW_UP_REPLY = [Delta(text="It is sunny "), finish("stop", text="in Paris.")]

SCRIPTS = {"one_call": (ONE_CALL, (WEATHER,)), "two_calls": (TWO_CALLS, (WEATHER, TIME))}

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}, "hour24": {"type": "boolean"}},
                       "required": ["zone"]}}},
]
USER = {"role": "user", "content": "What is the weather in Paris?"}
TOOL_RESULT = '{"sky": "sunny", "celsius": 21}'


def expected_calls(calls: tuple[ToolCall, ...]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(call.id, call.name, json.loads(call.arguments)) for call in calls]


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


@pytest.fixture
def start_fake(nursery: trio.Nursery) -> Callable[..., Any]:
    """``await start_fake(script)`` -> (engine, base URL) of a real hypercorn serving a FakeEngine."""

    async def start(script: list[Delta]) -> tuple[FakeEngine, str]:
        engine = FakeEngine(script)
        (url,) = await nursery.start(partial(serve, engine, loopback()))
        return engine, url

    return start


def received_follow_up(engine: FakeEngine, calls: tuple[ToolCall, ...]) -> None:
    """The engine's last request is the follow-up turn: user, the assistant's calls, then their results."""
    request = engine.requests[-1]
    assert isinstance(request, ChatRequest)
    user, assistant, *results = request.messages
    assert dict(user) == USER
    assert assistant["role"] == "assistant"
    assert not assistant.get("content")
    # The app hands templates `arguments` parsed (tests/http: a chat template reads an object).
    sent = [(call["id"], call["type"], call["function"]["name"], as_object(call["function"]["arguments"]))
            for call in assistant["tool_calls"]]
    assert sent == [(call.id, "function", call.name, json.loads(call.arguments)) for call in calls]
    assert [(result["role"], result["tool_call_id"], result["content"]) for result in results] == [
        ("tool", call.id, TOOL_RESULT) for call in calls]
    assert [tool["function"]["name"] for tool in request.tools or ()] == ["get_weather", "get_time"]


def as_object(arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(arguments) if isinstance(arguments, str) else dict(arguments)


def tool_results(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    return [{"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT} for call in calls]


# ---- openai SDK -----------------------------------------------------------------------------------------------


def openai_kwargs(base_url: str) -> dict[str, Any]:
    return {"base_url": f"{base_url}/v1", "api_key": "x", "max_retries": 0, "timeout": TIMEOUT}


@pytest.fixture
def openai_client() -> Iterator[Callable[[str], openai.OpenAI]]:
    """``openai_client(base_url)`` -> a sync client, closed (its pooled connections with it) after the test."""
    clients: list[openai.OpenAI] = []

    def make(base_url: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(**openai_kwargs(base_url)))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def openai_calls(message: Any) -> list[tuple[str, str, dict[str, Any]]]:
    return [(call.id, call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls]


def gather_openai_stream(chunks: Any) -> tuple[list[tuple[str, str, dict[str, Any]]], str | None, str]:
    """A stream's calls (assembled by index, as agents do), its finish reason and its reasoning."""
    parts: dict[int, dict[str, str]] = {}
    finish_reason, reasoning = None, ""
    for chunk in chunks:
        for choice in chunk.choices:
            # The openai SDK keeps the extra field in model_extra; litellm's Delta has it as an attribute.
            extra = (choice.delta.model_extra or {}).get("reasoning_content")
            reasoning += extra or getattr(choice.delta, "reasoning_content", None) or ""
            for call in choice.delta.tool_calls or ():
                part = parts.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                part["id"] += call.id or ""
                part["name"] += (call.function and call.function.name) or ""
                part["arguments"] += (call.function and call.function.arguments) or ""
            finish_reason = choice.finish_reason or finish_reason
    calls = [(part["id"], part["name"], json.loads(part["arguments"])) for _, part in sorted(parts.items())]
    return calls, finish_reason, reasoning


def openai_follow_up_messages(calls: list[tuple[str, str, dict[str, Any]]]) -> list[Mapping[str, Any]]:
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
        for id_, name, arguments in calls]}
    return [USER, assistant, *[{"role": "tool", "tool_call_id": id_, "content": TOOL_RESULT} for id_, _, _ in calls]]


@pytest.mark.parametrize("script", SCRIPTS)
async def test_openai_sync_whole(start_fake, openai_client, script: str) -> None:
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)
    client = openai_client(base_url)
    completion = await in_thread(client.chat.completions.create, model=FAKE_MODEL_ID, messages=[USER], tools=TOOLS)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert openai_calls(choice.message) == expected_calls(calls)
    assert all(call.type == "function" for call in choice.message.tool_calls)
    assert (choice.message.model_extra or {}).get("reasoning_content") == (REASONING if script == "one_call" else None)

    # The follow-up sends the SDK's own message object back, as agents do.
    engine.reply = list(FOLLOW_UP_REPLY)
    follow_up = await in_thread(
        client.chat.completions.create, model=FAKE_MODEL_ID, tools=TOOLS,
        messages=[USER, choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
                  *tool_results(calls)])
    assert follow_up.choices[0].message.content == "It is sunny in Paris."
    assert follow_up.choices[0].finish_reason == "stop"
    received_follow_up(engine, calls)


@pytest.mark.parametrize("script", SCRIPTS)
async def test_openai_sync_stream(start_fake, openai_client, script: str) -> None:
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)
    client = openai_client(base_url)

    def run() -> tuple[Any, ...]:
        with client.chat.completions.create(model=FAKE_MODEL_ID, messages=[USER], tools=TOOLS, stream=True) as stream:
            return gather_openai_stream(stream)

    got_calls, finish_reason, reasoning = await in_thread(run)
    assert got_calls == expected_calls(calls)
    assert finish_reason == "tool_calls"
    assert reasoning == (REASONING if script == "one_call" else "")

    engine.reply = list(FOLLOW_UP_REPLY)

    def follow_up() -> str:
        with client.chat.completions.create(model=FAKE_MODEL_ID, tools=TOOLS, stream=True,
                                            messages=openai_follow_up_messages(got_calls)) as stream:
            return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    assert await in_thread(follow_up) == "It is sunny in Paris."
    received_follow_up(engine, calls)


@pytest.mark.parametrize("script", SCRIPTS)
async def test_openai_async_whole_and_stream(start_fake, script: str) -> None:
    """AsyncOpenAI on asyncio, as agent frameworks run it (in a thread of its own, beside the Trio server)."""
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)

    async def run() -> tuple[Any, ...]:
        async with openai.AsyncOpenAI(**openai_kwargs(base_url)) as client:
            whole = await client.chat.completions.create(model=FAKE_MODEL_ID, messages=[USER], tools=TOOLS)
            stream = await client.chat.completions.create(model=FAKE_MODEL_ID, messages=[USER], tools=TOOLS,
                                                          stream=True)
            chunks = [chunk async for chunk in stream]
            return whole, gather_openai_stream(chunks)

    whole, (got_calls, finish_reason, reasoning) = await in_thread(asyncio.run, run())
    assert whole.choices[0].finish_reason == "tool_calls"
    assert openai_calls(whole.choices[0].message) == expected_calls(calls)
    assert got_calls == expected_calls(calls)
    assert finish_reason == "tool_calls"
    expected_reasoning = REASONING if script == "one_call" else None
    assert (whole.choices[0].message.model_extra or {}).get("reasoning_content") == expected_reasoning
    assert reasoning == (expected_reasoning or "")

    engine.reply = list(FOLLOW_UP_REPLY)

    async def follow_up() -> str:
        async with openai.AsyncOpenAI(**openai_kwargs(base_url)) as client:
            completion = await client.chat.completions.create(
                model=FAKE_MODEL_ID, tools=TOOLS, messages=openai_follow_up_messages(got_calls))
            return completion.choices[0].message.content or ""

    assert await in_thread(asyncio.run, follow_up()) == "It is sunny in Paris."
    received_follow_up(engine, calls)


# ---- langchain-openai ------------------------------------------------------------------------------------------


def chat_model(base_url: str) -> Any:
    model = langchain_openai.ChatOpenAI(model=FAKE_MODEL_ID, base_url=f"{base_url}/v1", api_key="x",
                                        max_retries=0, timeout=TIMEOUT)
    return model.bind_tools(TOOLS)


def langchain_calls(message: AIMessage) -> list[tuple[str, str, dict[str, Any]]]:
    assert not message.invalid_tool_calls
    return [(call["id"], call["name"], call["args"]) for call in message.tool_calls]


@pytest.mark.parametrize("stream", [False, True], ids=["invoke", "stream"])
@pytest.mark.parametrize("script", SCRIPTS)
async def test_langchain_bind_tools(start_fake, script: str, stream: bool) -> None:
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)
    model = chat_model(base_url)
    prompt = [HumanMessage(content=USER["content"])]

    def ask(messages: list[Any]) -> AIMessage:
        if not stream:
            return model.invoke(messages)
        chunks = list(model.stream(messages))
        whole = chunks[0]
        for chunk in chunks[1:]:
            whole = whole + chunk
        return whole

    # ChatOpenAI reports no reasoning: by its own docs it does not extract `reasoning_content`
    # from Chat Completions replies (provider subclasses do), so only the calls are checked here.
    message = await in_thread(ask, prompt)
    assert langchain_calls(message) == expected_calls(calls)
    assert message.response_metadata["finish_reason"] == "tool_calls"

    engine.reply = list(FOLLOW_UP_REPLY)
    results = [ToolMessage(content=TOOL_RESULT, tool_call_id=call.id) for call in calls]
    answer = await in_thread(ask, [*prompt, message, *results])
    assert answer.content == "It is sunny in Paris."
    assert answer.response_metadata["finish_reason"] == "stop"
    received_follow_up(engine, calls)


# ---- litellm ---------------------------------------------------------------------------------------------------


@pytest.fixture
def close_litellm_clients() -> Iterator[None]:
    """Close the sync clients litellm cached during the test (it keeps them, pooled connections and all,
    for the process's life: the server's port is gone after the test, and the sockets would leak)."""
    yield
    cache = litellm.in_memory_llm_clients_cache
    for client in list(cache.cache_dict.values()):
        if isinstance(client, openai.OpenAI):
            client.close()
    cache.flush_cache()


def litellm_kwargs(base_url: str) -> dict[str, Any]:
    return {"model": f"openai/{FAKE_MODEL_ID}", "api_base": f"{base_url}/v1", "api_key": "x", "tools": TOOLS,
            "timeout": TIMEOUT, "num_retries": 0}


@pytest.mark.usefixtures("close_litellm_clients")
@pytest.mark.parametrize("script", SCRIPTS)
async def test_litellm_whole(start_fake, script: str) -> None:
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)
    response = await in_thread(litellm.completion, messages=[USER], **litellm_kwargs(base_url))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert openai_calls(choice.message) == expected_calls(calls)
    assert getattr(choice.message, "reasoning_content", None) == (REASONING if script == "one_call" else None)

    engine.reply = list(FOLLOW_UP_REPLY)
    assistant = {"role": "assistant", "content": None,
                 "tool_calls": [call.model_dump() for call in choice.message.tool_calls]}
    follow_up = await in_thread(litellm.completion, messages=[USER, assistant, *tool_results(calls)],
                                **litellm_kwargs(base_url))
    assert follow_up.choices[0].message.content == "It is sunny in Paris."
    assert follow_up.choices[0].finish_reason == "stop"
    received_follow_up(engine, calls)


@pytest.mark.usefixtures("close_litellm_clients")
@pytest.mark.parametrize("script", SCRIPTS)
async def test_litellm_stream(start_fake, script: str) -> None:
    reply, calls = SCRIPTS[script]
    engine, base_url = await start_fake(reply)

    def run() -> tuple[tuple[Any, ...], Any]:
        chunks = list(litellm.completion(messages=[USER], stream=True, **litellm_kwargs(base_url)))
        # litellm's own reassembly of a stream, as its users call it.
        return gather_openai_stream(chunks), litellm.stream_chunk_builder(chunks, messages=[USER])

    (got_calls, finish_reason, reasoning), rebuilt = await in_thread(run)
    assert got_calls == expected_calls(calls)
    assert finish_reason == "tool_calls"
    assert reasoning == (REASONING if script == "one_call" else "")
    assert rebuilt.choices[0].finish_reason == "tool_calls"
    assert openai_calls(rebuilt.choices[0].message) == expected_calls(calls)

    engine.reply = list(FOLLOW_UP_REPLY)

    def follow_up() -> str:
        stream = litellm.completion(messages=openai_follow_up_messages(got_calls), stream=True,
                                    **litellm_kwargs(base_url))
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    assert await in_thread(follow_up) == "It is sunny in Paris."
    received_follow_up(engine, calls)
