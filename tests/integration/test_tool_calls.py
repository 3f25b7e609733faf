"""An agent's tool loop through a real server and the openai SDK: every turn reuses the one before it.

The fixture's weights are random, so its replies are never tool calls; the
calls are scripted here as an agent sends them back (their parsing is
tested on scripted token ids in tests/core/test_output.py). The template
names `<tool_call>` and `tool_call.name`, so mlx-lm picks its json_tools
parser and parsing is on for these requests, as for a Qwen model.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import openai
import pytest
import trio

from mlxcel.core.output import ReplyFormat
from mlxcel.engine import Engine, run_engine
from mlxcel.http.validation import parse_chat_request
from mlxcel.model.prompt import PromptRenderer
from tests.http.test_tool_loop_and_logprobs import fixture_copy
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

# Qwen2.5's way with tools: listed in the system turn, calls written as
# `<tool_call>` JSON after the content, results sent back as user turns.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- for call in message.tool_calls or [] %}{%- set tool_call = call.function %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + tool_call.arguments | tojson + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time", "description": "the local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
]


async def start(nursery: trio.Nursery, start_server: Any, folder: Path) -> tuple[Engine, openai.OpenAI]:
    engine = await nursery.start(run_engine, attrs.evolve(make_engine_config(), model_path=folder))
    base_url = await start_server(engine)
    return engine, openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


async def in_thread(function: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


async def test_a_four_step_tool_loop_hits_the_cache_at_every_step(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, client = await start(nursery, start_server, fixture_copy(tmp_path / "qwen-tools", template=TOOL_TEMPLATE))
    assert ReplyFormat.of(engine.model.tokenizer).tool_parser is not None
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You plan trips and call tools for facts. " * 6},
        {"role": "user", "content": "Plan a day in Paris, then Oslo."},
    ]
    previous_prompt = 0
    for step in range(4):
        reply = await in_thread(client.chat.completions.create, model=engine.model_id, messages=messages,
                                tools=TOOLS, max_tokens=6, temperature=0)
        usage = reply.usage
        assert usage is not None
        assert usage.prompt_tokens_details is not None
        # This turn's prompt starts with the last one's, so the cache holds all of it but, at most,
        # its last token: the "\n" after `assistant` merges with a reply that starts with a newline
        # (always so for Qwen's template when a call has no content: "\n\n<tool_call>").
        assert usage.prompt_tokens_details.cached_tokens >= previous_prompt - 1, step
        assert usage.prompt_tokens > previous_prompt
        previous_prompt = usage.prompt_tokens
        message = reply.choices[0].message
        assert message.tool_calls is None  # random weights write text, parsed as content
        city = ("Paris", "Oslo")[step % 2]
        # What an agent sends back: the reply with its calls (scripted here), then each call's result.
        calls = [{"id": f"call_{step}_{index}", "type": "function",
                  "function": {"name": name, "arguments": json.dumps({"city": city})}}
                 for index, name in enumerate(("get_weather", "get_time")[: 1 + step % 2])]
        # With the reasoning a thinking model would have returned: it renders in the history every turn.
        messages.append({"role": "assistant", "content": message.content or None, "tool_calls": calls,
                         "reasoning_content": f"I need step {step}'s facts."})
        messages.extend({"role": "tool", "tool_call_id": call["id"], "content": f"result {call['id']}"}
                        for call in calls)
    renderer = PromptRenderer(engine.model, default_template_kwargs={}, cache_enabled=True)
    rendered = renderer.render(parse_chat_request({"messages": messages, "tools": TOOLS}))
    assert "<think>\nI need step 0's facts.\n</think>" in engine.model.tokenizer.decode(list(rendered.tokens))


async def test_tool_choice_none_renders_no_tools_and_a_forced_call_renders_them_all(
    nursery: trio.Nursery, start_server: Any, tmp_path: Path,
) -> None:
    engine, client = await start(nursery, start_server, fixture_copy(tmp_path / "qwen-tools", template=TOOL_TEMPLATE))
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]

    async def prompt_tokens(**options: Any) -> int:
        reply = await in_thread(client.chat.completions.create, model=engine.model_id, messages=messages,
                                max_tokens=1, temperature=0, **options)
        return reply.usage.prompt_tokens

    bare = await prompt_tokens()
    assert await prompt_tokens(tools=TOOLS, tool_choice="none") == bare
    with_tools = await prompt_tokens(tools=TOOLS, tool_choice="auto")
    assert with_tools > bare
    # Forcing a call (tests/integration/test_forced_tool_calls.py) shows the template every tool, as auto does.
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        assert await prompt_tokens(tools=TOOLS, tool_choice=tool_choice) == with_tools
