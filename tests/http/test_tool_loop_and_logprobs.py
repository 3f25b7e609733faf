"""What SDK clients send and check, through a real server: the tool loop, and logprobs that spell the text."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from mlxcel.engine import Engine, run_engine
from mlxcel.fixtures import fixture_path
from mlxcel.http.validation import parse_chat_request
from mlxcel.model.prompt import PromptRenderer
from mlxcel.types import ChatRequest, CompletionRequest, SamplingParams
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

# In the manner of Qwen2.5's template: `+ message['content']` fails on null,
# and tool-call arguments are printed with `| tojson`, so they must be objects.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' + message['content'] }}"
    "{%- for call in message.tool_calls or [] %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + call.function.name + '\", \"arguments\": '"
    " + call.function.arguments | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

SEED = 7

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}}]


def fixture_copy(folder: Path, *, template: str | None = None, **config_changes: Any) -> Path:
    """The llama fixture with its own chat template or config (weights and tokenizer linked, not copied)."""
    source = fixture_path("llama")
    folder.mkdir()
    for entry in source.iterdir():
        if entry.name != "config.json":
            os.symlink(entry, folder / entry.name)
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


async def start(nursery: trio.Nursery, start_server: Any, model_path: Path) -> tuple[Engine, str]:
    config = attrs.evolve(make_engine_config(), model_path=model_path)
    engine = await nursery.start(run_engine, config)
    return engine, await start_server(engine)


async def test_tool_loop_with_null_content_renders_and_the_next_turn_hits_the_cache(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, base_url = await start(nursery, start_server, fixture_copy(tmp_path / "qwen-style", template=QWEN_STYLE_TEMPLATE))
    turn_1 = [{"role": "system", "content": "You answer about the weather. " * 8},
              {"role": "user", "content": "What is the weather in Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        async def chat(messages: list[dict[str, Any]]) -> dict[str, Any]:
            response = await client.post("/v1/chat/completions", json={
                "messages": messages, "tools": TOOLS, "max_tokens": 4, "temperature": 0})
            assert response.status_code == 200, response.text
            return response.json()

        await chat(turn_1)
        # What the openai SDK sends in a tool loop: the call with content null, then the result.
        turn_2 = [*turn_1, {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
        reply_2 = await chat(turn_2)
        turn_3 = [*turn_2, {"role": "assistant", "content": reply_2["choices"][0]["message"]["content"]},
                  {"role": "user", "content": "And tomorrow?"}]
        reply_3 = await chat(turn_3)
    # Turn 3 starts with turn 2's prompt, so the rendered prefix was stable.
    assert reply_3["usage"]["prompt_tokens_details"]["cached_tokens"] >= reply_2["usage"]["prompt_tokens"] - 1
    # The arguments reach the template as an object, not a quoted JSON string.
    renderer = PromptRenderer(engine.model, default_template_kwargs={}, cache_enabled=True)
    rendered = renderer.render(parse_chat_request({"messages": turn_2, "tools": TOOLS}))
    text = engine.model.tokenizer.decode(list(rendered.tokens))
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


async def sampled_token_ids(engine: Engine, request: ChatRequest | CompletionRequest) -> list[int]:
    ids: list[int] = []
    async with engine.stream(request) as deltas:
        async for delta in deltas:
            ids.extend(delta.token_ids)
    return ids


async def server_that_stops_by_eos(
    nursery: trio.Nursery, start_engine: Any, start_server: Any, folder: Path, request: ChatRequest | CompletionRequest,
) -> tuple[str, int]:
    """A server whose end-of-sequence ids include a token `request` samples: (its URL, tokens before it)."""
    ids = await sampled_token_ids(await start_engine(), request)
    # The first sampled token not seen before it, past the first one.
    stop_at = next(index for index in range(1, len(ids)) if ids[index] not in ids[:index])
    # Same seed, same tokens: the reply now stops there by EOS.
    _engine, base_url = await start(nursery, start_server, fixture_copy(folder, eos_token_id=[151645, ids[stop_at]]))
    return base_url, stop_at


SAMPLING = SamplingParams(temperature=1.0, seed=SEED, max_tokens=8)


async def test_completion_logprobs_exclude_the_end_of_sequence_token(
    nursery: trio.Nursery, start_engine: Any, start_server: Any, tmp_path: Path,
) -> None:
    prompt = "Once upon a time"
    base_url, stop_at = await server_that_stops_by_eos(
        nursery, start_engine, start_server, tmp_path / "eos", CompletionRequest(prompt=prompt, sampling=SAMPLING))
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        body = (await client.post("/v1/completions", json={
            "prompt": prompt, "max_tokens": 12, "seed": SEED, "logprobs": 1})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    tokens = choice["logprobs"]["tokens"]
    assert "".join(tokens) == choice["text"]
    assert len(tokens) == stop_at == body["usage"]["completion_tokens"]


async def test_chat_logprobs_exclude_the_end_of_sequence_token(
    nursery: trio.Nursery, start_engine: Any, start_server: Any, tmp_path: Path,
) -> None:
    messages = [{"role": "user", "content": "Tell me a story"}]
    base_url, stop_at = await server_that_stops_by_eos(
        nursery, start_engine, start_server, tmp_path / "eos", ChatRequest(messages=tuple(messages), sampling=SAMPLING))
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        body = (await client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 12, "seed": SEED, "logprobs": True, "top_logprobs": 2})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    entries = choice["logprobs"]["content"]
    joined = "".join(entry["token"] for entry in entries)
    # mlx-lm's BPE streaming detokenizer drops the one space a reply starts with
    # (as mlx_lm.server does); the logprob keeps the token as it is.
    assert joined.removeprefix(" ") == choice["message"]["content"]
    assert len(entries) == stop_at == body["usage"]["completion_tokens"]
