"""The official `openai` SDK's Responses client against mlxcel over a real hypercorn on loopback.

Three engines: a scripted `FakeEngine` (it replies with reasoning and function
calls, which random weights cannot), the random-weight llama fixture (the
prompt cache is real: a follow-up through `previous_response_id` must hit it),
and the real SmolLM2 model (marked slow, as tests/integration/test_real_model.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import openai
import pytest
import trio

from mlxcel.http.serve import serve
from mlxcel.types import ChatRequest, Delta, ToolCall
from tests.fakes import FAKE_MODEL_ID, FakeEngine, finish
from tests.support import evolve_cache, loopback

pytestmark = pytest.mark.slow

TIMEOUT = 60.0
WEATHER = ToolCall(index=0, id="call_weather_0", name="get_weather", arguments='{"city": "Paris"}')
CALL_REPLY = [Delta(reasoning="The user wants the weather; "), Delta(reasoning="call get_weather."),
              Delta(tool_calls=(WEATHER,)), finish("tool_calls", prompt_tokens=30, completion_tokens=9, cached_tokens=0)]
TEXT_REPLY = [Delta(text="It is sunny "), finish("stop", text="in Paris.", prompt_tokens=50, completion_tokens=5,
                                                    cached_tokens=30)]
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = "What is the weather in Paris?"
INSTRUCTIONS = "You are a careful assistant. " + " ".join(f"rule{i} applies" for i in range(60))


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


@pytest.fixture
def openai_client() -> Iterator[Callable[[str], openai.OpenAI]]:
    clients: list[openai.OpenAI] = []

    def make(base_url: str) -> openai.OpenAI:
        clients.append(openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


@pytest.fixture
def start_fake(nursery: trio.Nursery) -> Callable[..., Any]:
    async def start(script: list[Any]) -> tuple[FakeEngine, str]:
        engine = FakeEngine(script)
        (url,) = await nursery.start(partial(serve, engine, loopback()))
        return engine, url

    return start


def last_request(engine: FakeEngine) -> ChatRequest:
    request = engine.requests[-1]
    assert isinstance(request, ChatRequest)
    return request


def assert_round_trip_messages(engine: FakeEngine) -> None:
    """The follow-up turn reached the engine whole: user, the assistant's reasoning and call, the result."""
    user, assistant, result = last_request(engine).messages
    assert dict(user) == {"role": "user", "content": QUESTION}
    assert assistant["role"] == "assistant"
    assert assistant["reasoning_content"] == "The user wants the weather; call get_weather."
    assert [(call["id"], call["function"]["name"], call["function"]["arguments"]) for call in assistant["tool_calls"]] == [
        (WEATHER.id, WEATHER.name, json.loads(WEATHER.arguments))]
    assert dict(result) == {"role": "tool", "tool_call_id": WEATHER.id, "content": '{"sky": "sunny"}'}


# --- scripted engine ------------------------------------------------------------------------


async def test_create_function_call_round_trip_stateless_and_by_previous_id(start_fake, openai_client) -> None:
    engine, base_url = await start_fake(CALL_REPLY)
    client = openai_client(base_url)
    response = await in_thread(client.responses.create, model=FAKE_MODEL_ID, input=QUESTION, tools=TOOLS)
    assert response.status == "completed"
    reasoning, call = response.output
    assert reasoning.type == "reasoning"
    assert reasoning.content[0].text == "The user wants the weather; call get_weather."
    assert call.type == "function_call"
    assert (call.call_id, call.name, json.loads(call.arguments)) == (WEATHER.id, WEATHER.name, {"city": "Paris"})
    assert response.output_text == ""
    assert response.usage.input_tokens == 30
    assert response.usage.output_tokens == 9
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.tools[0].name == "get_weather"

    engine.reply = list(TEXT_REPLY)
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}
    # Stateless: the client sends the whole conversation back, its output items as the SDK parsed them.
    follow_up = await in_thread(
        client.responses.create, model=FAKE_MODEL_ID, tools=TOOLS, store=False,
        input=[{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in response.output],
               output])
    assert follow_up.output_text == "It is sunny in Paris."
    assert follow_up.usage.input_tokens_details.cached_tokens == 30
    assert_round_trip_messages(engine)
    # Stateful: only the new item, the server keeps the rest.
    follow_up = await in_thread(client.responses.create, model=FAKE_MODEL_ID, tools=TOOLS,
                                previous_response_id=response.id, input=[output])
    assert follow_up.output_text == "It is sunny in Paris."
    assert follow_up.previous_response_id == response.id
    assert_round_trip_messages(engine)

    assert (await in_thread(client.responses.retrieve, follow_up.id)).output_text == "It is sunny in Paris."
    await in_thread(client.responses.delete, follow_up.id)
    with pytest.raises(openai.NotFoundError) as missing:
        await in_thread(client.responses.retrieve, follow_up.id)
    assert missing.value.status_code == 404
    with pytest.raises(openai.NotFoundError) as missing:
        await in_thread(client.responses.create, model=FAKE_MODEL_ID, previous_response_id=follow_up.id, input="x")
    assert missing.value.code == "previous_response_not_found"
    assert missing.value.param == "previous_response_id"


async def test_input_tokens_count_and_input_items_list(start_fake, openai_client) -> None:
    engine, base_url = await start_fake(CALL_REPLY)
    engine.num_prompt_tokens = 23
    client = openai_client(base_url)
    counted = await in_thread(client.responses.input_tokens.count, model=FAKE_MODEL_ID, input=QUESTION,
                              instructions="Be brief.", tools=TOOLS)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", 23)
    assert [message["role"] for message in engine.counted[-1].messages] == ["system", "user"]
    assert engine.counted[-1].tools[0]["function"]["name"] == "get_weather"
    assert engine.requests == []  # counted, not generated

    response = await in_thread(client.responses.create, model=FAKE_MODEL_ID, input=QUESTION, tools=TOOLS)
    engine.reply = list(TEXT_REPLY)
    output = {"type": "function_call_output", "call_id": WEATHER.id, "output": '{"sky": "sunny"}'}
    follow_up = await in_thread(client.responses.create, model=FAKE_MODEL_ID, tools=TOOLS,
                                previous_response_id=response.id,
                                input=[output, {"role": "user", "content": "And tomorrow?"}])
    # Counting a follow-up: the stored chain, then the new items.
    await in_thread(client.responses.input_tokens.count, model=FAKE_MODEL_ID, previous_response_id=follow_up.id,
                    input="And the day after?")
    assert [message["role"] for message in engine.counted[-1].messages] == [
        "user", "assistant", "tool", "user", "assistant", "user"]

    first = await in_thread(client.responses.input_items.list, response.id)
    assert [(item.type, item.role) for item in first.data] == [("message", "user")]
    assert first.data[0].content[0].text == QUESTION
    items = await in_thread(client.responses.input_items.list, follow_up.id)
    # Newest first, as OpenAI's default order is.
    assert [item.type for item in items.data] == ["message", "function_call_output"]
    assert items.data[1].call_id == WEATHER.id
    in_order = await in_thread(client.responses.input_items.list, follow_up.id, order="asc", limit=1)
    assert [item.type for item in in_order.data] == ["function_call_output"]
    assert in_order.has_more
    rest = await in_thread(client.responses.input_items.list, follow_up.id, order="asc", after=in_order.data[0].id)
    assert [item.id for item in rest.data] == [items.data[0].id]
    # Every page of the SDK's auto-paging iterator.
    every = await in_thread(lambda: list(client.responses.input_items.list(follow_up.id, limit=1)))
    assert [item.id for item in every] == [item.id for item in items.data]
    with pytest.raises(openai.NotFoundError):
        await in_thread(client.responses.input_items.list, "resp_unknown")
    with pytest.raises(openai.BadRequestError) as bad:
        await in_thread(client.responses.input_items.list, follow_up.id, limit=500)
    assert bad.value.param == "limit"


async def test_stream_events_parse_and_the_stream_helper_completes(start_fake, openai_client) -> None:
    engine, base_url = await start_fake(CALL_REPLY)
    client = openai_client(base_url)

    def raw_events() -> list[Any]:
        with client.responses.create(model=FAKE_MODEL_ID, input=QUESTION, tools=TOOLS, stream=True) as stream:
            return list(stream)

    events = await in_thread(raw_events)
    # Every event parsed into its SDK type (an unknown type would stay a bare model).
    assert all(type(event).__name__.startswith("Response") for event in events), [type(e) for e in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types
    assert types.count("response.function_call_arguments.delta") == 1
    completed = events[-1].response
    assert completed.output[1].arguments == WEATHER.arguments

    engine.reply = list(TEXT_REPLY)

    def helper() -> tuple[list[str], Any]:
        with client.responses.stream(model=FAKE_MODEL_ID, tools=TOOLS, previous_response_id=completed.id,
                                     input=[{"type": "function_call_output", "call_id": WEATHER.id,
                                             "output": '{"sky": "sunny"}'}]) as stream:
            deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
            return deltas, stream.get_final_response()

    deltas, final = await in_thread(helper)
    assert "".join(deltas) == "It is sunny in Paris."
    assert final.output_text == "It is sunny in Paris."
    assert final.usage.input_tokens_details.cached_tokens == 30
    assert_round_trip_messages(engine)


async def test_bad_requests_raise_bad_request_and_the_server_keeps_serving(start_fake, openai_client) -> None:
    engine, base_url = await start_fake(TEXT_REPLY)
    client = openai_client(base_url)
    for kwargs, param in (
        ({"input": "hi", "tools": [{"type": "local_shell"}]}, "tools[0].type"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": [{"type": "function_call_output", "call_id": "call_x", "output": "1"}]}, "input[0].call_id"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await in_thread(client.responses.create, model=FAKE_MODEL_ID, **kwargs)
        assert refused.value.param == param
    assert engine.requests == []
    assert (await in_thread(client.responses.create, model=FAKE_MODEL_ID, input="hi")).output_text == (
        "It is sunny in Paris.")


# --- random weights, real cache --------------------------------------------------------------


async def test_previous_response_id_hits_the_prompt_cache_on_a_fixture_engine(
    start_engine, start_server, openai_client
) -> None:
    engine = await start_engine("llama", prompt_cache=evolve_cache(min_prefix=16))
    client = openai_client(await start_server(engine))
    first = await in_thread(client.responses.create, model=engine.model_id, instructions=INSTRUCTIONS,
                            input="first question", max_output_tokens=4, temperature=0)
    assert first.usage.input_tokens > 100
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert first.usage.output_tokens == 4
    assert first.status == "incomplete"

    second = await in_thread(client.responses.create, model=engine.model_id, instructions=INSTRUCTIONS,
                             previous_response_id=first.id, input="second question", max_output_tokens=4,
                             temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 4, (cached, first.usage.input_tokens)
    assert second.usage.input_tokens > first.usage.input_tokens
    print(f"\nfixture llama: turn 1 {first.usage.input_tokens} input tokens; turn 2 {second.usage.input_tokens} "
          f"input, {cached} cached")

    # Streamed (create(stream=True): the SDK's stream helper wants response.completed, and a
    # reply cut at max_output_tokens ends with response.incomplete).
    def third_stream() -> list[Any]:
        with client.responses.create(model=engine.model_id, instructions=INSTRUCTIONS, previous_response_id=second.id,
                                     input="third", max_output_tokens=3, temperature=0, stream=True) as stream:
            return list(stream)

    events = await in_thread(third_stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens - 4


# --- the real model --------------------------------------------------------------------------


async def test_smollm2_answers_and_the_follow_up_is_cached(start_engine, start_server, openai_client) -> None:
    engine = await start_engine("smollm2-f32", prompt_cache=evolve_cache(min_prefix=16))
    client = openai_client(await start_server(engine))
    first = await in_thread(client.responses.create, model=engine.model_id, input="What is the capital of France?",
                            max_output_tokens=12, temperature=0)
    assert "Paris" in first.output_text
    second = await in_thread(client.responses.create, model=engine.model_id, previous_response_id=first.id,
                             input="And of Italy?", max_output_tokens=12, temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    print(f"\nsmollm2: {first.output_text!r} then {second.output_text!r}; turn 2 {second.usage.input_tokens} input "
          f"tokens, {cached} cached")
    assert cached >= first.usage.input_tokens
    assert second.output_text.strip()

    def streamed() -> tuple[str, Any]:
        with client.responses.stream(model=engine.model_id, input="Name a color.", max_output_tokens=8,
                                     temperature=0) as stream:
            text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
            return text, stream
    text, _stream = await in_thread(streamed)
    assert text.strip()
