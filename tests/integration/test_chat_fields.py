"""Issue 30's chat-completions fields through the official clients (openai, litellm, langchain-openai).

A real hypercorn serves mlxcel's app over a scripted `FakeEngine`: each test
checks what the engine was asked to do (the parsed request) and what the
client reports back. Before these fields were read, every one of them was a
200 with the field ignored; here each is honoured or a 400 naming it. What a
real model does with them is tested in tests/integration/test_chat_fields_model.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

import langchain_openai  # noqa: E402
import litellm  # noqa: E402
import openai  # noqa: E402

from mlxcel.errors import ContextExceeded  # noqa: E402
from mlxcel.http.serve import serve  # noqa: E402
from mlxcel.types import ChatRequest, Delta, ToolCall, ToolCallPart, Usage  # noqa: E402
from tests.fakes import FakeEngine, FakeTokenizer, finish  # noqa: E402
from tests.support import loopback

litellm.telemetry = False

MESSAGES = [{"role": "user", "content": "Hello"}]
WEATHER = ToolCall(index=0, id="call_w", name="get_weather", arguments='{"city": "Paris"}')
FUNCTIONS = [{"name": "get_weather", "description": "the weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture
def start_fake(nursery: trio.Nursery) -> Callable[..., Any]:
    async def start(script: list[Any] | None = None) -> tuple[FakeEngine, str]:
        engine = FakeEngine(script or ())
        (url,) = await nursery.start(partial(serve, engine, loopback()))
        return engine, url

    return start


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", "fake-model")
    kwargs.setdefault("messages", MESSAGES)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


async def refused(client: openai.OpenAI, **kwargs: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as caught:
        await create(client, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict)
    return body


def last_chat(engine: FakeEngine) -> ChatRequest:
    request = engine.requests[-1]
    assert isinstance(request, ChatRequest)
    return request


@pytest.mark.parametrize(("fields", "param"), [
    ({"verbosity": "low"}, "verbosity"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
])
async def test_openai_fields_this_server_cannot_honour_are_400s_naming_them(
    start_fake: Any, fields: dict[str, Any], param: str,
) -> None:
    engine, url = await start_fake()
    body = await refused(client_for(url), **fields)
    assert body["param"] == param
    assert body["code"] == "unsupported_parameter"
    assert not engine.requests


@pytest.mark.parametrize(("extra", "param"), [
    ({"frobnicate": 1}, "frobnicate"),
    ({"return_progress": True}, "return_progress"),
    ({"id_slot": 2}, "id_slot"),
    ({"echo": True}, "echo"),
    ({"mirostat": 2}, "mirostat"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"response_format": {"type": "json_object", "schema": 123}}, "response_format.schema"),
])
async def test_unknown_and_unhonoured_extras_are_400s_naming_them(
    start_fake: Any, extra: dict[str, Any], param: str,
) -> None:
    engine, url = await start_fake()
    body = await refused(client_for(url), extra_body=extra)
    assert body["param"] == param
    assert not engine.requests


async def test_client_extras_and_neutral_values_are_accepted(start_fake: Any) -> None:
    engine, url = await start_fake()
    reply = await create(client_for(url), metadata={"run": "a"}, store=False, service_tier="auto",
                         verbosity="medium", modalities=["text"],
                         extra_body={"id_slot": -1, "mirostat": 0, "dry_multiplier": 0.0, "mirostat_tau": 5,
                                     "echo": False, "return_progress": False})
    assert reply.choices[0].message.content == "Hello world"
    assert reply.system_fingerprint.startswith("fp_")


async def test_reasoning_effort_reaches_the_router(start_fake: Any) -> None:
    engine, url = await start_fake()
    await create(client_for(url), reasoning_effort="high")
    assert last_chat(engine).reasoning_effort == "high"
    assert (await refused(client_for(url), reasoning_effort="extreme"))["param"] == "reasoning_effort"


@pytest.mark.parametrize("extra", [
    {"guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"guided_json": '{"type": "object", "required": ["b"], "properties": {"b": {"type": "integer"}}}'},
    {"guided_choice": ["yes", "no"]},
    {"guided_regex": "[a-z]+/[0-9]"},
    {"structured_outputs": {"choice": ["yes", "no"]}},
    {"structured_outputs": {"json": {"type": "array"}}},
    {"structured_outputs": {"regex": "a+"}},
    {"json_schema": {"type": "object", "properties": {"a": {"type": "string"}}}},
    {"grammar": 'root ::= "yes" | "no"'},
    {"response_format": {"type": "json_object", "schema": {"type": "object", "required": ["a"],
                                                           "properties": {"a": {"type": "string"}}}}},
])
async def test_structured_output_aliases_compile_a_grammar(start_fake: Any, extra: dict[str, Any]) -> None:
    engine, url = await start_fake()
    await create(client_for(url), extra_body=extra)
    grammar = last_chat(engine).sampling.grammar
    await create(client_for(url), response_format={"type": "json_object"})
    # The field's own constraint, not just "any JSON object".
    assert grammar is not None
    assert grammar != last_chat(engine).sampling.grammar


async def test_two_structured_output_fields_at_once_are_refused(start_fake: Any) -> None:
    engine, url = await start_fake()
    body = await refused(client_for(url), response_format={"type": "json_object"},
                         extra_body={"guided_choice": ["a"]})
    assert body["param"] == "guided_choice"


async def test_sampling_extensions_reach_the_sampler(start_fake: Any) -> None:
    engine, url = await start_fake()
    await create(client_for(url), extra_body={"min_tokens": 5, "ignore_eos": True, "n_probs": 3})
    sampling = last_chat(engine).sampling
    assert (sampling.min_tokens, sampling.ignore_eos, sampling.logprobs, sampling.top_logprobs) == (5, True, True, 3)
    body = await refused(client_for(url), max_tokens=2, extra_body={"min_tokens": 5})
    assert body["param"] == "min_tokens"


async def test_a_final_assistant_message_is_continued(start_fake: Any) -> None:
    engine, url = await start_fake()
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    await create(client_for(url), messages=prefill)
    assert (last_chat(engine).continue_final_message, last_chat(engine).add_generation_prompt) == (True, False)
    await create(client_for(url), extra_body={"add_generation_prompt": False})
    assert (last_chat(engine).continue_final_message, last_chat(engine).add_generation_prompt) == (False, False)
    body = await refused(client_for(url), extra_body={"continue_final_message": True})
    assert body["param"] == "continue_final_message"


async def test_legacy_functions_come_back_as_a_function_call(start_fake: Any) -> None:
    engine, url = await start_fake([Delta(tool_calls=(WEATHER,)), finish("tool_calls")])
    client = client_for(url)
    reply = await create(client, functions=FUNCTIONS, function_call={"name": "get_weather"})
    request = last_chat(engine)
    assert [tool["function"]["name"] for tool in request.tools or ()] == ["get_weather"]
    assert request.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert request.parallel_tool_calls is False
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call"
    assert (choice.message.function_call.name, json.loads(choice.message.function_call.arguments)) == (
        "get_weather", {"city": "Paris"})
    assert choice.message.tool_calls is None

    # The legacy history (an assistant function_call, then a `function` result) renders as a tool loop.
    follow = [*MESSAGES, {"role": "assistant", "content": None, "function_call": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"role": "function", "name": "get_weather", "content": "sunny"}]
    stream = await create(client, messages=follow, functions=FUNCTIONS, stream=True)
    chunks = await trio.to_thread.run_sync(list, stream)
    assert [chunk.choices[0].delta.function_call.name for chunk in chunks if chunk.choices[0].delta.function_call] \
        == ["get_weather"]
    assistant, result = last_chat(engine).messages[1:]
    assert assistant["tool_calls"][0]["function"]["name"] == "get_weather"
    assert (result["role"], result["tool_call_id"]) == ("tool", assistant["tool_calls"][0]["id"])


async def test_timings_per_token_puts_timings_on_every_chunk(start_fake: Any) -> None:
    usage = Usage(prompt_tokens=7, completion_tokens=1, prompt_seconds=0.5, decode_seconds=0.0)
    engine, url = await start_fake([Delta(text="Hi", progress=usage), finish("stop", text="!")])
    stream = await create(client_for(url), stream=True, extra_body={"timings_per_token": True})
    chunks = await trio.to_thread.run_sync(list, stream)
    timings = [chunk.model_extra.get("timings") for chunk in chunks]
    assert all(timings), timings
    assert timings[0]["prompt_n"] == 7
    assert timings[-1]["predicted_n"] == 2
    plain = await create(client_for(url))
    assert "timings" not in (plain.model_extra or {})


async def test_litellm_and_langchain_pass_the_extensions(start_fake: Any) -> None:
    engine, url = await start_fake()
    await trio.to_thread.run_sync(partial(
        litellm.completion, model="openai/fake-model", api_base=f"{url}/v1", api_key="unused", messages=MESSAGES,
        timeout=10, num_retries=0, extra_body={"guided_choice": ["yes", "no"], "n_probs": 2}))
    assert last_chat(engine).sampling.grammar is not None
    assert last_chat(engine).sampling.top_logprobs == 2
    with pytest.raises(litellm.BadRequestError):
        await trio.to_thread.run_sync(partial(
            litellm.completion, model="openai/fake-model", api_base=f"{url}/v1", api_key="unused",
            messages=MESSAGES, timeout=10, num_retries=0, extra_body={"prediction": {"type": "content",
                                                                                     "content": "x"}}))
    chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="fake-model", max_retries=0,
                                       timeout=10, reasoning_effort="low")
    reply = await trio.to_thread.run_sync(chat.invoke, "Hello")
    assert reply.content == "Hello world"
    assert last_chat(engine).reasoning_effort == "low"


# ---- llama.cpp's routes (no SDK: llama.cpp's web UI and editor plugins call them with plain HTTP) -------------


async def test_llamacpp_props_slots_models_and_apply_template(start_fake: Any) -> None:
    engine, url = await start_fake()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        props = (await http.get("/props")).json()
        assert props["default_generation_settings"]["n_ctx"] == engine.model.context_size
        assert props["total_slots"] == engine.config.scheduler.max_batch_size
        assert "chat_template" in props
        slots = (await http.get("/slots")).json()
        assert len(slots) == engine.config.scheduler.max_batch_size
        assert slots[0]["n_ctx"] == engine.model.context_size
        models = (await http.get("/models")).json()
        assert [model["id"] for model in models["data"]] == ["fake-model"]


async def test_infill_without_fim_tokens_is_a_400(start_fake: Any) -> None:
    engine, url = await start_fake()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        reply = await http.post("/infill", json={"input_prefix": "def f(", "input_suffix": "):\n"})
    assert reply.status_code == 400
    assert "fill-in-the-middle" in reply.json()["error"]["message"]
    assert not engine.requests


async def test_response_fields_select_the_native_body(start_fake: Any) -> None:
    engine, url = await start_fake()
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        body = (await http.post("/completion", json={
            "prompt": "Once", "n_predict": 4, "response_fields": ["content", "generation_settings/n_predict",
                                                                  "missing/field"]})).json()
    assert body == {"content": "Hello world", "generation_settings/n_predict": 4}


class FimTokenizer(FakeTokenizer):
    """Byte-level, with Qwen2.5-Coder's fill-in-the-middle tokens at ids 250-254."""

    FIM = {"<|fim_prefix|>": 250, "<|fim_suffix|>": 251, "<|fim_middle|>": 252, "<|repo_name|>": 253,
           "<|file_sep|>": 254}

    def get_vocab(self) -> dict[str, int]:
        return dict(self.FIM)


async def test_infill_builds_the_fim_prompt_from_the_tokenizer_tokens(nursery: trio.Nursery) -> None:
    engine = FakeEngine()
    engine.model = attrs.evolve(engine.model, tokenizer=FimTokenizer())
    (url,) = await nursery.start(partial(serve, engine, loopback()))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        reply = await http.post("/infill", json={
            "input_prefix": "def f(", "input_suffix": "):", "prompt": "x", "n_predict": 4,
            "input_extra": [{"filename": "a.py", "text": "A"}]})
    assert reply.status_code == 200
    assert reply.json()["content"] == "Hello world"
    (request,) = engine.requests

    def text(value: str) -> list[int]:
        return list(value.encode())

    fim = FimTokenizer.FIM
    assert request.prompt == (
        fim["<|repo_name|>"], *text("myproject\n"), fim["<|file_sep|>"], *text("a.py\nA"),
        fim["<|file_sep|>"], *text("filename\n"), fim["<|fim_prefix|>"], *text("def f("),
        fim["<|fim_suffix|>"], *text("):"), fim["<|fim_middle|>"], *text("x"))
    assert request.sampling.max_tokens == 4


async def test_native_context_error_is_llamacpp_shaped(nursery: trio.Nursery) -> None:
    engine = FakeEngine(stream_error=ContextExceeded("too long", param="prompt", context_size=64,
                                                     num_prompt_tokens=70))
    (url,) = await nursery.start(partial(serve, engine, loopback()))
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        native = await http.post("/completion", json={"prompt": "x"})
        chat = await http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert native.json() == {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error",
                                       "n_prompt_tokens": 70, "n_ctx": 64}}
    assert chat.json()["error"]["code"] == "context_length_exceeded"


# ---- streamed tool-call arguments ----------------------------------------------------------------------------

ARGUMENTS = '{"path": "notes.txt", "content": "line one\\nline two"}'
PIECES = [ARGUMENTS[start:start + 7] for start in range(0, len(ARGUMENTS), 7)]
WRITE = ToolCall(index=0, id="call_write", name="write_file", arguments=ARGUMENTS)
STREAMED_CALL = [
    Delta(text="Writing it."),
    Delta(tool_call_parts=(ToolCallPart(index=0, id="call_write", name="write_file"),)),
    *[Delta(tool_call_parts=(ToolCallPart(index=0, arguments=piece),)) for piece in PIECES[:-1]],
    Delta(tool_call_parts=(ToolCallPart(index=0, arguments=PIECES[-1]),), tool_calls=(WRITE,)),
    finish("tool_calls"),
]
WRITE_TOOL = [{"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}}}}]


async def test_streamed_arguments_arrive_in_pieces_and_the_clients_join_them(start_fake: Any) -> None:
    engine, url = await start_fake(STREAMED_CALL)
    stream = await create(client_for(url), tools=WRITE_TOOL, stream=True)
    chunks = await trio.to_thread.run_sync(list, stream)
    pieces = [call for chunk in chunks for call in chunk.choices[0].delta.tool_calls or ()]
    assert len(pieces) == len(PIECES) + 1
    assert (pieces[0].id, pieces[0].function.name) == ("call_write", "write_file")
    assert "".join(piece.function.arguments or "" for piece in pieces) == ARGUMENTS

    chat = langchain_openai.ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model="fake-model", max_retries=0,
                                       timeout=10).bind_tools(WRITE_TOOL)
    message = None
    for chunk in await trio.to_thread.run_sync(lambda: list(chat.stream("Write it"))):
        message = chunk if message is None else message + chunk
    assert message is not None
    assert [(call["name"], call["args"]) for call in message.tool_calls] == [("write_file", json.loads(ARGUMENTS))]

    whole = await create(client_for(url), tools=WRITE_TOOL)
    assert whole.choices[0].message.tool_calls[0].function.arguments == ARGUMENTS


async def test_anthropic_input_json_delta_streams_the_pieces(start_fake: Any) -> None:
    import anthropic

    engine, url = await start_fake(STREAMED_CALL)
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=10)
    tools = [{"name": "write_file", "input_schema": WRITE_TOOL[0]["function"]["parameters"]}]

    def run() -> tuple[list[str], Any]:
        with client.messages.stream(model="fake-model", max_tokens=100, tools=tools,
                                    messages=[{"role": "user", "content": "Write it"}]) as stream:
            partial = [event.delta.partial_json for event in stream
                       if event.type == "content_block_delta" and event.delta.type == "input_json_delta"]
            return partial, stream.get_final_message()

    partial, message = await trio.to_thread.run_sync(run)
    client.close()
    assert partial == PIECES
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert (use.id, use.name, use.input) == ("call_write", "write_file", json.loads(ARGUMENTS))


async def test_responses_function_call_arguments_stream_in_pieces(start_fake: Any) -> None:
    engine, url = await start_fake(STREAMED_CALL)
    client = client_for(url)
    tools = [{"type": "function", "name": "write_file", "parameters": WRITE_TOOL[0]["function"]["parameters"]}]

    def run() -> list[Any]:
        return list(client.responses.create(model="fake-model", input="Write it", tools=tools, stream=True))

    events = await trio.to_thread.run_sync(run)
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert deltas == PIECES
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.arguments == ARGUMENTS
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert (call.call_id, call.name, call.arguments) == ("call_write", "write_file", ARGUMENTS)
