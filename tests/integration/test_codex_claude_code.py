"""Replays of Codex's and Claude Code's requests (tests/integration/client_shapes.py) on real models.

Each request is sent as the client sends it (Codex through the `openai`
SDK's Responses client, streamed; Claude Code as raw bytes, streamed, and
through the `anthropic` SDK), to the random-weight llama fixture with a
tool-call template (real rendering, grammar, cache) and to the real SmolLM2
model (slow): each gets a 200 and a reply the client can use.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import attrs
import httpx
import openai
import pytest
import trio

from mlxcel.core.lark_regex import lark_to_regex
from mlxcel.engine import run_engine
from tests.http.test_tool_loop_and_logprobs import fixture_copy
from tests.integration.client_shapes import APPLY_PATCH_LARK, claude_code_request, codex_request, sdk_kwargs
from tests.integration.test_tool_calls import TOOL_TEMPLATE
from tests.support import evolve_cache, make_engine_config

pytestmark = pytest.mark.slow

TIMEOUT = 300.0


async def tool_fixture(nursery: trio.Nursery, start_server: Any, folder: Path) -> tuple[Any, str]:
    config = attrs.evolve(make_engine_config(prompt_cache=evolve_cache(min_prefix=16)),
                          model_path=fixture_copy(folder, template=TOOL_TEMPLATE))
    engine = await nursery.start(run_engine, config)
    return engine, await start_server(engine)


def codex_stream(client: openai.OpenAI, body: dict[str, Any]) -> list[Any]:
    with client.responses.create(**sdk_kwargs(body)) as stream:
        return list(stream)


async def test_codex_turn_streams_to_a_usable_reply_and_the_next_turn_is_cached(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, url = await tool_fixture(nursery, start_server, tmp_path / "tools")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    body = {**codex_request(engine.model_id), "max_output_tokens": 24, "temperature": 0}
    raw = await trio.to_thread.run_sync(partial(client.responses.with_raw_response.create,
                                                **sdk_kwargs({**body, "stream": False})))
    assert raw.status_code == 200
    assert raw.headers["X-Mlxcel-Dropped-Tools"] == "web_search"
    assert raw.parse().output
    events = await trio.to_thread.run_sync(codex_stream, client, body)
    assert events[0].type == "response.created"
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.output
    assert final.usage.input_tokens > 200  # instructions, three tools with the grammar text, three messages
    # The same turn again: its whole prompt but the last token is read from the cache.
    again = await trio.to_thread.run_sync(codex_stream, client, body)
    assert again[-1].response.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens - 16


async def test_a_forced_custom_tool_call_matches_its_grammar(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, url = await tool_fixture(nursery, start_server, tmp_path / "tools")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    # A bounded grammar, so random weights finish the call within a few tokens.
    grammar = 'start: "cd " DIR ("/" DIR)~0..2 LF\nDIR: /[a-z]{1,6}/\n%import common.LF'
    tool = {"type": "custom", "name": "goto", "description": "Change directory.",
            "format": {"type": "grammar", "syntax": "lark", "definition": grammar}}
    for temperature in (1.0, 0.0):
        response = await trio.to_thread.run_sync(partial(
            client.responses.create, model=engine.model_id, input="Go to the source folder.", tools=[tool],
            tool_choice={"type": "custom", "name": "goto"}, parallel_tool_calls=False, max_output_tokens=60,
            temperature=temperature))
        (call,) = response.output
        assert call.type == "custom_tool_call"
        assert call.name == "goto"
        assert re.fullmatch(lark_to_regex(grammar), call.input), call.input
    # apply_patch forced: random weights write filenames until max_output_tokens, and a call cut there
    # is dropped (issue 30: complete calls only, never markup), so the reply is incomplete and empty.
    body = {**codex_request(engine.model_id, stream=False), "tool_choice": {"type": "custom", "name": "apply_patch"},
            "max_output_tokens": 40}
    response = await trio.to_thread.run_sync(partial(client.responses.create, **sdk_kwargs(body)))
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    text = json.dumps([item.model_dump() for item in response.output])
    assert "<tool_call>" not in text
    assert "apply_patch" not in text
    assert lark_to_regex(APPLY_PATCH_LARK)


def claude_code_events(url: str, body: dict[str, Any]) -> tuple[int, list[tuple[str, Any]]]:
    events = []
    with httpx.stream("POST", f"{url}/v1/messages", json=body, timeout=TIMEOUT,
                      headers={"anthropic-version": "2023-06-01", "x-api-key": "unused",
                               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}) as response:
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
        return response.status_code, events


async def test_claude_code_turn_streams_to_a_usable_reply(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, url = await tool_fixture(nursery, start_server, tmp_path / "tools")
    body = {**claude_code_request(engine.model_id, max_tokens=24), "temperature": 0}
    status, events = await trio.to_thread.run_sync(claude_code_events, url, body)
    assert status == 200, events
    names = [name for name, _ in events]
    assert names[0] == "message_start"
    assert names[-2:] == ["message_delta", "message_stop"]
    usage = events[-2][1]["usage"]
    # The breakpoint is on the last user block: the whole prompt is written, nothing after it is input.
    assert usage["input_tokens"] == 0
    assert usage["cache_creation_input_tokens"] > 100
    again = (await trio.to_thread.run_sync(claude_code_events, url, body))[1][-2][1]["usage"]
    assert again["cache_read_input_tokens"] >= usage["cache_creation_input_tokens"] - 16

    # Through the SDK: output_config and a structured reply.
    sdk = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=TIMEOUT)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 12}},
              "required": ["capital"], "additionalProperties": False}
    message = await trio.to_thread.run_sync(partial(
        sdk.messages.create, model=engine.model_id, max_tokens=40, messages=[
            {"role": "user", "content": "What is the capital of France?"}],
        extra_body={"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}}))
    assert message.stop_reason == "end_turn"
    assert set(json.loads(message.content[0].text)) == {"capital"}


# --- the real model --------------------------------------------------------------------------


@pytest.mark.slow
async def test_smollm2_answers_codex_and_claude_code(start_engine, start_server) -> None:
    engine = await start_engine("smollm2-f32", prompt_cache=evolve_cache(min_prefix=16))
    url = await start_server(engine)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    body = {**codex_request(engine.model_id, prompt="What is the capital of France? Answer in one sentence."),
            "max_output_tokens": 24, "temperature": 0}
    events = await trio.to_thread.run_sync(codex_stream, client, body)
    final = events[-1].response
    print(f"\nsmollm2 for Codex: {final.output_text!r}")
    assert "Paris" in final.output_text

    status, events = await trio.to_thread.run_sync(claude_code_events, url, {
        **claude_code_request(engine.model_id, max_tokens=24), "temperature": 0})
    assert status == 200
    text = "".join(event["delta"].get("text", "") for name, event in events if name == "content_block_delta")
    print(f"smollm2 for Claude Code: {text!r}")
    assert "Paris" in text
