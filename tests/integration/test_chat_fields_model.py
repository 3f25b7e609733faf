"""Issue 30's chat fields on the real fixture model, through the openai SDK and a real server.

Random weights, so each test makes the outcome depend on the field alone: a
logit bias that makes the end-of-sequence token win (min_tokens, ignore_eos),
a grammar whose property order is the schema's, a stop string cut out of a
greedy reply whose logprobs were seen first, and a forced tool call that
must end after one call, or be dropped when max_tokens cuts it.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from mlxcel.fixtures.tokenizer import EOS_TOKEN, SPECIAL_TOKENS
from tests.http.test_tool_loop_and_logprobs import fixture_copy, start
from tests.integration.test_forced_tool_calls import TOOLS
from tests.integration.test_tool_calls import TOOL_TEMPLATE

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Say something."}]
EOS_BIAS = {str(SPECIAL_TOKENS[EOS_TOKEN]): 100}


def client_for(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", "llama-v1-seed0")
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("temperature", 0)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


async def test_min_tokens_and_ignore_eos_hold_off_the_end_of_sequence(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    client = client_for(await start_server(engine))
    kwargs = {"model": engine.model_id, "logit_bias": EOS_BIAS, "max_tokens": 12}
    at_once = await create(client, **kwargs)
    assert (at_once.choices[0].finish_reason, at_once.usage.completion_tokens) == ("stop", 0)
    held = await create(client, **kwargs, extra_body={"min_tokens": 5})
    assert (held.choices[0].finish_reason, held.usage.completion_tokens) == ("stop", 5)
    ignored = await create(client, **kwargs, extra_body={"ignore_eos": True})
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 12)
    async with httpx.AsyncClient(base_url=engine_url(client), timeout=60) as http:
        native = (await http.post("/completion", json={"prompt": "Once", "n_predict": 6, "ignore_eos": True,
                                                       "logit_bias": [[SPECIAL_TOKENS[EOS_TOKEN], 100]]})).json()
    assert (native["stop_type"], native["tokens_predicted"]) == ("limit", 6)


def engine_url(client: openai.OpenAI) -> str:
    return str(client.base_url).removesuffix("/v1/")


async def test_a_final_assistant_message_is_continued_not_closed(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    prefill = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        continued = (await http.post("/apply-template", json={"messages": prefill})).json()["prompt"]
        closed = (await http.post("/apply-template", json={"messages": prefill,
                                                           "continue_final_message": False})).json()["prompt"]
    assert continued.endswith("<|im_start|>assistant\nThe answer is")
    assert closed.endswith("The answer is<|im_end|>\n<|im_start|>assistant\n")
    reply = await create(client_for(base_url), model=engine.model_id, messages=prefill, max_tokens=4)
    assert reply.choices[0].finish_reason in ("stop", "length")


async def test_structured_output_keeps_the_schema_property_order(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    client = client_for(await start_server(engine))
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 6},
                                               "answer": {"type": "string", "maxLength": 6}},
              "required": ["reasoning", "answer"], "additionalProperties": False}
    for seed in range(3):
        reply = await create(client, model=engine.model_id, temperature=1.0, seed=seed, max_tokens=60,
                             response_format={"type": "json_schema",
                                              "json_schema": {"name": "r", "schema": schema, "strict": True}})
        assert list(json.loads(reply.choices[0].message.content)) == ["reasoning", "answer"]


async def test_stop_string_tokens_are_not_in_the_logprobs(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    client = client_for(await start_server(engine))
    # Seeded sampling: the same reply twice (greedy repeats one token on these weights).
    sampled = {"model": engine.model_id, "max_tokens": 16, "logprobs": True, "temperature": 1.0, "seed": 3}
    free = await create(client, **sampled)
    tokens = [item.token for item in free.choices[0].logprobs.content]
    # A stop string of two whole tokens that does not occur earlier in the reply.
    cut = next(index for index in range(3, len(tokens) - 2)
               if (stop := tokens[index] + tokens[index + 1]).strip() and stop not in "".join(tokens[:index + 1]))
    stop = tokens[cut] + tokens[cut + 1]
    stopped = await create(client, **sampled, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert [item.token for item in stopped.choices[0].logprobs.content] == tokens[:cut]


@pytest.fixture
async def tool_server(nursery: trio.Nursery, start_server: Any, tmp_path: Path) -> tuple[Any, openai.OpenAI]:
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    return engine, client_for(base_url)


async def test_a_forced_call_ends_when_its_call_closes(tool_server: Any) -> None:
    engine, client = tool_server
    for seed in range(3):
        # No parallel_tool_calls sent: one call, whatever OpenAI's default for "auto".
        reply = await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", temperature=1.0,
                             seed=seed, max_tokens=600)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert len(choice.message.tool_calls) == 1
        assert not choice.message.content


async def test_a_forced_call_cut_by_max_tokens_is_length_without_markup(tool_server: Any) -> None:
    engine, client = tool_server
    for stream in (False, True):
        reply = await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", max_tokens=12,
                             stream=stream)
        if stream:
            chunks = await trio.to_thread.run_sync(list, reply)
            content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
            calls = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
            finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
        else:
            content, calls, finish = (reply.choices[0].message.content or "", reply.choices[0].message.tool_calls
                                      or [], reply.choices[0].finish_reason)
        assert (finish, content, calls) == ("length", "", [])


async def test_native_prompt_past_the_context_is_llamacpp_exceed_context_size_error(
    start_engine, start_server,
) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    size = engine.model.context_size
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        native = await http.post("/completion", json={"prompt": [1] * (size + 3), "n_predict": 2})
        openai_shape = await http.post("/v1/completions", json={"prompt": [1] * (size + 3), "max_tokens": 2})
    assert native.status_code == 400
    assert native.json() == {"error": {"code": 400, "message": native.json()["error"]["message"],
                                       "type": "exceed_context_size_error", "n_prompt_tokens": size + 3,
                                       "n_ctx": size}}
    assert openai_shape.json()["error"]["code"] == "context_length_exceeded"


# ---- --chat-template, --tool-call-parser, --reasoning-parser ------------------------------------------------


async def test_chat_template_flag_brings_its_tool_call_format(start_engine, start_server) -> None:
    """The plain fixture's template has no tool-call format; --chat-template with one makes forced calls work."""
    engine = await start_engine("llama", chat_template=TOOL_TEMPLATE)
    client = client_for(await start_server(engine))
    reply = await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", temperature=1.0,
                         seed=1, max_tokens=600)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(reply.choices[0].message.tool_calls) == 1


async def test_tool_call_parser_none_turns_the_format_off(nursery: trio.Nursery, start_server: Any,
                                                          tmp_path: Path) -> None:
    import attrs

    from mlxcel.engine import run_engine
    from tests.support import make_engine_config

    config = attrs.evolve(make_engine_config(), model_path=fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE),
                          tool_call_parser="none")
    engine = await nursery.start(run_engine, config)
    client = client_for(await start_server(engine))
    with pytest.raises(openai.BadRequestError) as caught:
        await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", max_tokens=8)
    assert caught.value.body["param"] == "tool_choice"


def test_parsers_by_name_change_the_reply_format_only() -> None:
    from mlxcel.core.output import ReplyFormat
    from mlxcel.model.loader import load_model
    from mlxcel.model.reply_parsers import parse_tool_call_parser, with_reply_parsers

    tokenizer = load_model(fixture_copy_path()).tokenizer
    chosen = with_reply_parsers(tokenizer, chat_template=None, tool_call_parser="hermes", reasoning_parser="mistral")
    fmt = ReplyFormat.of(chosen)
    assert (fmt.tool_call_start, fmt.tool_call_end, fmt.think_start, fmt.think_end) == (
        "<tool_call>", "</tool_call>", "[THINK]", "[/THINK]")
    # The shared wrapper is untouched, and the template's thinking switch is the model's.
    assert ReplyFormat.of(tokenizer).tool_call_start is None
    assert chosen.has_thinking == tokenizer.has_thinking
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        parse_tool_call_parser("nope")


def fixture_copy_path() -> Path:
    from mlxcel.fixtures import fixture_path

    return fixture_path("llama")


async def test_a_forced_call_streams_its_arguments_as_they_are_generated(tool_server: Any) -> None:
    engine, client = tool_server
    stream = await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", temperature=1.0,
                          seed=2, max_tokens=600, stream=True)
    chunks = await trio.to_thread.run_sync(list, stream)
    pieces = [call for chunk in chunks if chunk.choices for call in chunk.choices[0].delta.tool_calls or ()]
    assert pieces[0].function.name in {tool["function"]["name"] for tool in TOOLS}
    # One piece per token or so, not one at the end.
    assert len([piece for piece in pieces if piece.function.arguments]) > 3
    arguments = "".join(piece.function.arguments or "" for piece in pieces)
    assert isinstance(json.loads(arguments), dict)
    whole = await create(client, model=engine.model_id, tools=TOOLS, tool_choice="required", temperature=1.0,
                         seed=2, max_tokens=600)
    assert whole.choices[0].message.tool_calls[0].function.arguments == arguments


THINKING_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if not enable_thinking %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)


async def test_reasoning_effort_sets_the_template_thinking_switch(nursery: trio.Nursery, start_server: Any,
                                                                   tmp_path: Path) -> None:
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "think", template=THINKING_TEMPLATE))
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        async def prompt(**fields: Any) -> str:
            reply = await http.post("/apply-template", json={"messages": MESSAGES, **fields})
            return str(reply.json()["prompt"])

        high, none = await prompt(reasoning_effort="high"), await prompt(reasoning_effort="none")
    # (The template's `{%-` trims the newlines around its tags.)
    assert high.endswith("<|im_start|>assistant")
    assert none.endswith("<|im_start|>assistant<think>\n\n</think>")
    reply = await create(client_for(base_url), model=engine.model_id, reasoning_effort="high", max_tokens=2)
    assert reply.usage.prompt_tokens > 0


async def test_timings_per_token_counts_each_chunk_of_a_real_reply(start_engine, start_server) -> None:
    # The core puts counts on a delta only for a request that asked (llama.cpp's timings_per_token).
    engine = await start_engine("llama")
    client = client_for(await start_server(engine))

    def chunk_timings(**extra: Any) -> list[Any]:
        stream = client.chat.completions.create(model=engine.model_id, messages=MESSAGES, temperature=0, max_tokens=6,
                                                stream=True, extra_body={"ignore_eos": True, **extra})
        return [(chunk.model_extra or {}).get("timings") for chunk in stream]

    timed = await trio.to_thread.run_sync(partial(chunk_timings, timings_per_token=True))
    assert [timings["predicted_n"] for timings in timed if timings is not None][:6] == [1, 2, 3, 4, 5, 6]
    plain = await trio.to_thread.run_sync(chunk_timings)
    assert plain
    assert all(timings is None for timings in plain)
