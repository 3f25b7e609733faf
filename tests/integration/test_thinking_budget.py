"""Reasoning budgets on a real model: once the budget is spent, the model is made to close its thinking.

The random-weight llama fixture is given thinking markers (two of its
rarest vocabulary entries become `<think>` and `</think>`, so mlx-lm detects
them) and a template whose generation prompt opens a thinking block. Left
alone, random weights think until `max_output_tokens`; with an effort's
budget (Responses' `reasoning.effort`), the thinking ends after that many
tokens and the rest of the reply is the answer.
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

from mlxcel.engine import run_engine
from mlxcel.fixtures import fixture_path
from mlxcel.http.effort import EFFORT_BUDGETS
from tests.support import make_engine_config

pytestmark = pytest.mark.slow

# Two tokens past the fixture's vocabulary (its embedding gains two rows).
THINK_IDS = {"<think>": 151646, "</think>": 151647}
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def thinking_fixture(folder: Path) -> Path:
    import mlx.core as mx

    source = fixture_path("llama")
    folder.mkdir()
    weights = mx.load(str(source / "model.safetensors"))
    embedding = weights["model.embed_tokens.weight"]
    weights["model.embed_tokens.weight"] = mx.concatenate([embedding, embedding[:2]], axis=0)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = json.loads((source / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": embedding.shape[0] + 2}))
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    for text, token_id in THINK_IDS.items():
        tokenizer["added_tokens"].append({"id": token_id, "content": text, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": False})
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = THINKING_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return folder


@pytest.fixture
async def client(nursery: trio.Nursery, start_server: Any, tmp_path: Path) -> openai.OpenAI:
    config = attrs.evolve(make_engine_config(), model_path=thinking_fixture(tmp_path / "thinking"))
    engine = await nursery.start(run_engine, config)
    assert engine.model.tokenizer.encode("<think>x</think>")[::2] == list(THINK_IDS.values())
    return openai.OpenAI(base_url=f"{await start_server(engine)}/v1", api_key="unused", max_retries=0, timeout=300)


async def respond(client: openai.OpenAI, **options: Any) -> Any:
    return await trio.to_thread.run_sync(partial(
        client.responses.create, model="thinking", input="Think, then answer.", temperature=0, **options))


async def test_an_effort_budget_closes_the_thinking(client: openai.OpenAI) -> None:
    unbounded = await respond(client, max_output_tokens=40)
    assert [item.type for item in unbounded.output] == ["reasoning"]
    assert unbounded.usage.output_tokens_details.reasoning_tokens == 40

    none = await respond(client, max_output_tokens=40, reasoning={"effort": "none"})
    # Budget 0: the first token is the end of thinking; everything after it is the answer.
    assert [item.type for item in none.output] == ["message"]
    assert none.usage.output_tokens == 40

    budget = EFFORT_BUDGETS["minimal"]
    minimal = await respond(client, max_output_tokens=budget + 30, reasoning={"effort": "minimal"})
    assert [item.type for item in minimal.output] == ["reasoning", "message"]
    # The budget's tokens of thinking, then the forced end marker (its token counts with them).
    assert budget <= minimal.usage.output_tokens_details.reasoning_tokens <= budget + 1
    assert minimal.output[1].content[0].text
