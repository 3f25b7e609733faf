"""The official `anthropic` SDK against mlxcel's `/v1/messages` on a real hypercorn.

Three engines: a scripted `FakeEngine` (tool calls and thinking, which the
random-weight fixtures cannot emit), the random-weight `llama` fixture (real
rendering, tokenizing and prompt cache: usage, count_tokens, the volatile
system line) and the real SmolLM2 model (slow). The SDK is the sync client,
run in a worker thread, with no retries and a short timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import anthropic
import httpx
import pytest
import trio

from mlxcel.http.serve import serve
from mlxcel.types import ChatRequest, Delta, ServerBusy, ToolCall
from tests.fakes import FAKE_MODEL_ID, FakeEngine, finish
from tests.support import evolve_cache, loopback

pytestmark = pytest.mark.slow

TIMEOUT = 60.0
KEY = "sekret"
WEATHER = ToolCall(index=0, id="toolu_weather", name="get_weather", arguments='{"city": "Paris"}')
TOOLS = [{"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CALL_REPLY = [Delta(reasoning="They want the weather."), Delta(text="Let me check."), Delta(tool_calls=(WEATHER,)),
              finish("tool_calls", prompt_tokens=30, cached_tokens=16, completion_tokens=12)]
ANSWER_REPLY = [Delta(text="It is sunny "), finish("stop", text="in Paris.", prompt_tokens=60, cached_tokens=30)]
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.abc; cc_entrypoint=cli; cch={};"
LONG_SYSTEM = " ".join(f"Rule {index}: answer the user carefully and keep to the facts." for index in range(30))


async def in_thread(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


@pytest.fixture
def client() -> Iterator[Callable[..., anthropic.Anthropic]]:
    """``client(base_url, **options)`` -> an SDK client, closed after the test."""
    clients: list[anthropic.Anthropic] = []

    def make(base_url: str, **options: Any) -> anthropic.Anthropic:
        options.setdefault("api_key", KEY)
        clients.append(anthropic.Anthropic(base_url=base_url, max_retries=0, timeout=TIMEOUT, **options))
        return clients[-1]

    yield make
    for each in clients:
        each.close()


@pytest.fixture
def start_fake(nursery: trio.Nursery) -> Callable[..., Any]:
    async def start(script: list[Any], **options: Any) -> tuple[FakeEngine, str]:
        engine = FakeEngine(script, **options)
        (url,) = await nursery.start(partial(serve, engine, loopback(api_key=KEY)))
        return engine, url

    return start


def chat_request(engine: FakeEngine, index: int = -1) -> ChatRequest:
    request = engine.requests[index]
    assert isinstance(request, ChatRequest)
    return request


# --- scripted engine -------------------------------------------------------------------


async def test_create_with_tools_then_the_tool_result_follow_up(start_fake, client) -> None:
    engine, url = await start_fake(CALL_REPLY)
    sdk = client(url)
    message = await in_thread(sdk.messages.create, model=FAKE_MODEL_ID, max_tokens=100, messages=[QUESTION],
                              tools=TOOLS, tool_choice={"type": "auto"})
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "They want the weather."
    assert message.content[1].text == "Let me check."
    call = message.content[2]
    assert (call.id, call.name, call.input) == ("toolu_weather", "get_weather", {"city": "Paris"})
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens,
            usage.output_tokens) == (14, 16, 0, 12)

    engine.reply = ANSWER_REPLY
    # The follow-up sends the reply back as the SDK returned it, and the tool's result.
    follow_up = await in_thread(sdk.messages.create, model=FAKE_MODEL_ID, max_tokens=100, tools=TOOLS, messages=[
        QUESTION, {"role": "assistant", "content": message.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"sky": "sunny"}'}]},
    ])
    assert follow_up.content[0].text == "It is sunny in Paris."
    assert follow_up.stop_reason == "end_turn"
    received = [dict(item) for item in chat_request(engine).messages]
    assert received == [
        QUESTION,
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "They want the weather.",
         "tool_calls": [{"id": "toolu_weather", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_weather", "content": '{"sky": "sunny"}'},
    ]
    assert chat_request(engine).tools is not None


async def test_stream_text_stream_and_final_message(start_fake, client) -> None:
    engine, url = await start_fake(CALL_REPLY)
    sdk = client(url)

    def run_stream() -> tuple[list[str], Any]:
        with sdk.messages.stream(model=FAKE_MODEL_ID, max_tokens=100, messages=[QUESTION], tools=TOOLS) as stream:
            texts = list(stream.text_stream)
            return texts, stream.get_final_message()

    texts, final = await in_thread(run_stream)
    assert texts == ["Let me check."]
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"
    # message_start said zeros; message_delta's figures are the ones the SDK keeps.
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens, final.usage.cache_creation_input_tokens,
            final.usage.output_tokens) == (14, 16, 0, 12)
    assert chat_request(engine).stream

    def raw_events() -> list[str]:
        with sdk.messages.create(model=FAKE_MODEL_ID, max_tokens=100, messages=[QUESTION], stream=True) as events:
            return [event.type for event in events]

    assert await in_thread(raw_events) == [
        "message_start", "content_block_start", "content_block_delta", "content_block_stop", "content_block_start",
        "content_block_delta", "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]


async def test_count_tokens_auth_and_errors_through_the_sdk(start_fake, client) -> None:
    engine, url = await start_fake(ANSWER_REPLY, num_prompt_tokens=42)
    counted = await in_thread(client(url).messages.count_tokens, model=FAKE_MODEL_ID, messages=[QUESTION],
                              system="Be brief.", tools=TOOLS)
    assert counted.input_tokens == 42
    assert [message["role"] for message in engine.counted[0].messages] == ["system", "user"]

    # Claude Code's ANTHROPIC_API_KEY arrives as x-api-key (this SDK version sends its api_key as a bearer token).
    by_header = client(url, api_key=None, default_headers={"x-api-key": KEY})
    message = await in_thread(by_header.messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[QUESTION])
    assert message.content[0].text == "It is sunny in Paris."

    with pytest.raises(anthropic.AuthenticationError) as refused:
        await in_thread(client(url, api_key="wrong").messages.create, model=FAKE_MODEL_ID, max_tokens=10,
                        messages=[QUESTION])
    assert refused.value.status_code == 401
    assert refused.value.body["error"]["type"] == "authentication_error"

    with pytest.raises(anthropic.BadRequestError) as bad:
        await in_thread(client(url).messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_none", "content": "x"}]}])
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "toolu_none" in bad.value.body["error"]["message"]

    engine.stream_error = ServerBusy("the server is at capacity; retry shortly")
    with pytest.raises(anthropic.APIStatusError) as busy:
        await in_thread(client(url).messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[QUESTION])
    assert busy.value.status_code == 529
    assert busy.value.body["error"]["type"] == "overloaded_error"
    assert busy.value.response.headers["Retry-After"] == "1"
    engine.stream_error = None
    message = await in_thread(client(url).messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[QUESTION])
    assert message.stop_reason == "end_turn"


# --- random-weight fixture: real rendering and prompt cache --------------------------------


@pytest.fixture
async def fixture_server(start_engine, start_server) -> Callable[..., Any]:
    async def start(**serve_options: Any) -> tuple[Any, str]:
        engine = await start_engine("llama", prompt_cache=evolve_cache(min_prefix=16))
        return engine, await start_server(engine, **serve_options)

    return start


def conversation() -> dict[str, Any]:
    return dict(system=LONG_SYSTEM, tools=TOOLS, messages=[
        QUESTION,
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ])


def openai_messages() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": LONG_SYSTEM}, QUESTION,
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]


def input_total(usage: Any) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


async def test_fixture_usage_count_tokens_and_a_cache_hit(fixture_server, client) -> None:
    engine, url = await fixture_server()
    sdk = client(url, api_key="unused")
    greedy = {"model": engine.model_id, "max_tokens": 4, "extra_body": {"temperature": 0}}
    first = await in_thread(sdk.messages.create, **greedy, **conversation())
    assert first.usage.cache_read_input_tokens == 0
    prompt = input_total(first.usage)
    # No cache_control breakpoint: Anthropic writes nothing to its cache, and counts the prompt as input.
    assert first.usage.cache_creation_input_tokens == 0
    assert first.usage.input_tokens == prompt
    assert 1 <= first.usage.output_tokens <= 4
    assert first.stop_reason in ("max_tokens", "end_turn")

    counted = await in_thread(sdk.messages.count_tokens, model=engine.model_id, **conversation())
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        chat = (await http.post("/v1/chat/completions", json={
            "messages": openai_messages(), "tools": [{"type": "function", "function": {
                "name": "get_weather", "description": "The weather in a city.",
                "parameters": TOOLS[0]["input_schema"]}}], "max_tokens": 1})).json()
    assert counted.input_tokens == chat["usage"]["prompt_tokens"] == prompt

    second = await in_thread(sdk.messages.create, **greedy, **conversation())
    assert input_total(second.usage) == prompt
    # The whole prompt but its last token, whose logits the next token needs, at APC block granularity.
    assert second.usage.cache_read_input_tokens >= prompt - 16
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == prompt - second.usage.cache_read_input_tokens

    def streamed() -> Any:
        with sdk.messages.stream(**greedy, **conversation()) as stream:
            return stream.get_final_message()

    final = await in_thread(streamed)
    assert input_total(final.usage) == prompt
    assert final.usage.cache_read_input_tokens > 0
    assert final.content == [] or final.content[0].type == "text"


async def test_usage_counts_the_tokens_after_the_last_breakpoint_as_input(fixture_server, client) -> None:
    engine, url = await fixture_server()
    sdk = client(url, api_key="unused")
    greedy = {"model": engine.model_id, "max_tokens": 2, "extra_body": {"temperature": 0}}
    system_only = await in_thread(sdk.messages.count_tokens, model=engine.model_id, system=LONG_SYSTEM,
                                  tools=TOOLS, messages=[QUESTION])
    marked_system = [{"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
    first = await in_thread(sdk.messages.create, **greedy, **{**conversation(), "system": marked_system})
    prompt = input_total(first.usage)
    assert first.usage.cache_read_input_tokens == 0
    # Written: the system prompt and tools the breakpoint closes; the conversation after it is input.
    written = first.usage.cache_creation_input_tokens
    assert 0 < written < system_only.input_tokens < prompt
    assert first.usage.input_tokens == prompt - written

    # Claude Code's way: the marker on the last user block writes the whole prompt.
    marked = conversation()
    marked["messages"][-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
    second = await in_thread(sdk.messages.create, **greedy, **marked)
    assert input_total(second.usage) == prompt
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.input_tokens == 0
    assert second.usage.cache_creation_input_tokens == prompt - second.usage.cache_read_input_tokens


async def test_temperature_above_one_is_refused(start_fake, client) -> None:
    engine, url = await start_fake(ANSWER_REPLY)
    with pytest.raises(anthropic.BadRequestError) as refused:
        await in_thread(client(url).messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[QUESTION],
                        extra_body={"temperature": 1.5})
    assert "temperature" in refused.value.body["error"]["message"]
    assert engine.requests == []
    message = await in_thread(client(url).messages.create, model=FAKE_MODEL_ID, max_tokens=10, messages=[QUESTION],
                              extra_body={"temperature": 1.0})
    assert chat_request(engine).sampling.temperature == 1.0
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("normalize", [True, False])
async def test_the_billing_header_changing_every_request(fixture_server, client, normalize: bool) -> None:
    options = {} if normalize else {"normalize_volatile_system": False}
    engine, url = await fixture_server(**options)
    sdk = client(url, api_key="unused")
    usages = []
    for cch in ("3f9a1", "b7e20"):
        system = [{"type": "text", "text": BILLING.format(cch)},
                  {"type": "text", "text": LONG_SYSTEM, "cache_control": {"type": "ephemeral"}}]
        message = await in_thread(sdk.messages.create, model=engine.model_id, max_tokens=2, messages=[QUESTION],
                                  system=system, extra_body={"temperature": 0})
        usages.append(message.usage)
    prompt = input_total(usages[1])
    if normalize:
        assert usages[1].cache_read_input_tokens >= prompt - 16
    else:
        # Only the header's first tokens, up to `cch=`, are shared.
        assert usages[1].cache_read_input_tokens <= 32
        assert prompt > 300


# --- the real model --------------------------------------------------------------------------


async def test_smollm2_answers_and_a_second_call_reads_the_cache(start_engine, start_server, client) -> None:
    engine = await start_engine("smollm2-f32", prompt_cache=evolve_cache(min_prefix=16))
    sdk = client(await start_server(engine), api_key="unused")
    request = dict(model=engine.model_id, max_tokens=12, extra_body={"temperature": 0},
                   system="You are a helpful assistant.",
                   messages=[{"role": "user", "content": "What is the capital of France?"}])
    first = await in_thread(sdk.messages.create, **request)
    assert first.content[0].type == "text"
    assert "Paris" in first.content[0].text
    assert first.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= first.usage.output_tokens <= 12
    prompt = input_total(first.usage)
    assert 15 < prompt < 60
    assert first.usage.cache_read_input_tokens == 0
    second = await in_thread(sdk.messages.create, **request)
    assert second.usage.cache_read_input_tokens > 0
    assert input_total(second.usage) == prompt
    assert second.content[0].text == first.content[0].text
    counted = await in_thread(sdk.messages.count_tokens, model=engine.model_id, system=request["system"],
                              messages=request["messages"])
    assert counted.input_tokens == prompt
