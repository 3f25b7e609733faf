"""The OpenAI Agents SDK's tool loop through the `openai` SDK: its turns share the prompt cache.

The Agents SDK forces the first call (`tool_choice` naming the tool, or
"required") and then lets the model choose (`"auto"`) over the same
conversation; `tool_choice` never reaches the chat template, so both turns
render the same tokens and the second reads the first's prompt from the cache.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
import trio

from mlxcel.engine import run_engine
from tests.http.test_tool_loop_and_logprobs import fixture_copy
from tests.integration.test_tool_calls import TOOL_TEMPLATE
from tests.support import evolve_cache, make_engine_config

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]
MESSAGES = [{"role": "system", "content": "You are a weather agent. Answer with the tool's help. " * 6},
            {"role": "user", "content": "What is the weather in Paris?"}]


async def test_a_forced_call_then_auto_over_the_same_prompt_reads_the_cache(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    config = attrs.evolve(make_engine_config(prompt_cache=evolve_cache(min_prefix=16)),
                          model_path=fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    engine = await nursery.start(run_engine, config)
    client = openai.OpenAI(base_url=f"{await start_server(engine)}/v1", api_key="unused", max_retries=0, timeout=120)

    async def create(tool_choice: Any) -> Any:
        return await trio.to_thread.run_sync(partial(
            client.chat.completions.create, model=engine.model_id, messages=MESSAGES, tools=TOOLS,
            tool_choice=tool_choice,
            max_tokens=40, temperature=0))

    forced = await create({"type": "function", "function": {"name": "get_weather"}})
    assert forced.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert forced.usage.prompt_tokens_details.cached_tokens == 0
    auto = await create("auto")
    assert auto.usage.prompt_tokens == forced.usage.prompt_tokens
    # All but the last token (whose logits start the reply), at block granularity.
    assert auto.usage.prompt_tokens_details.cached_tokens >= auto.usage.prompt_tokens - 16
    required = await create("required")
    assert required.usage.prompt_tokens_details.cached_tokens >= auto.usage.prompt_tokens - 16


async def test_the_same_loop_over_responses_reads_the_cache(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    # The Agents SDK's default model speaks Responses; its tool_choice reset is the same.
    config = attrs.evolve(make_engine_config(prompt_cache=evolve_cache(min_prefix=16)),
                          model_path=fixture_copy(tmp_path / "tools", template=TOOL_TEMPLATE))
    engine = await nursery.start(run_engine, config)
    client = openai.OpenAI(base_url=f"{await start_server(engine)}/v1", api_key="unused", max_retries=0, timeout=120)
    tools = [{"type": "function", **TOOLS[0]["function"]}]

    async def create(tool_choice: Any) -> Any:
        return await trio.to_thread.run_sync(partial(
            client.responses.create, model=engine.model_id, instructions=MESSAGES[0]["content"],
            input=MESSAGES[1]["content"], tools=tools, tool_choice=tool_choice, max_output_tokens=40,
            temperature=0, store=False, parallel_tool_calls=False))

    forced = await create("required")
    assert forced.output[-1].type == "function_call"
    auto = await create("auto")
    assert auto.usage.input_tokens == forced.usage.input_tokens
    assert auto.usage.input_tokens_details.cached_tokens >= auto.usage.input_tokens - 16
