"""Sampling fields through a real server and the openai SDK: each one honoured, or refused naming it.

The fixture's weights are random and its greedy reply repeats one token, so
each field's effect is plain: a logit_bias of +100 makes its token the
reply, top_k 1 and min_p 1 at temperature 1 are greedy, a repetition penalty
breaks the repetition. The same prompt runs more than once, so later
requests start directly from the cached prefix and earlier ones in the batch.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import httpx
import openai
import pytest
import trio
from tokenizers import Tokenizer

from mlxcel import fixtures

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Say something about sampling."}]


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", "llama-v1-seed0")
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 6)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


async def refused(client: openai.OpenAI, **kwargs: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        await create(client, **kwargs)
    return caught.value


async def test_sampling_fields_are_honoured_or_refused_through_the_openai_sdk(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    tokenizer = Tokenizer.from_file(str(fixtures.tokenizer_json_path()))
    (favoured,) = tokenizer.encode(" cat").ids

    greedy = (await create(client, model=engine.model_id, temperature=0)).choices[0].message.content
    assert greedy
    for _ in range(2):  # the batch, then a direct start from the cached prompt
        biased = await create(client, model=engine.model_id, temperature=0, logit_bias={str(favoured): 100})
        # The reply's leading space is trimmed; six tokens, each " cat".
        assert biased.choices[0].message.content.split() == ["cat"] * 6
        assert biased.usage.completion_tokens == 6
    top_one = await create(client, model=engine.model_id, temperature=1, seed=3, extra_body={"top_k": 1})
    assert top_one.choices[0].message.content == greedy
    min_p = await create(client, model=engine.model_id, temperature=1, extra_body={"min_p": 1.0})
    assert min_p.choices[0].message.content == greedy
    penalized = await create(client, model=engine.model_id, temperature=0, extra_body={"repetition_penalty": 1.5})
    assert penalized.choices[0].message.content != greedy
    # OpenAI's own penalties are honoured too (greedy included).
    presence = await create(client, model=engine.model_id, temperature=0, presence_penalty=2)
    assert presence.choices[0].message.content != greedy

    for kwargs, param in (
        ({"logit_bias": {"151646": 5}}, "logit_bias"),  # past the vocabulary
        ({"logit_bias": {str(favoured): 101}}, f"logit_bias.{favoured}"),
        ({"extra_body": {"top_k": -1}}, "top_k"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"n": 2}, "n"),
        ({"response_format": {"type": "grammar"}}, "response_format.type"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ):
        error = await refused(client, model=engine.model_id, **kwargs)
        assert error.status_code == 400
        assert error.body["param"] == param, (kwargs, error.body)
    text = await create(client, model=engine.model_id, temperature=0, response_format={"type": "text"})
    assert text.choices[0].message.content == greedy


async def test_native_completion_sampling_fields_are_honoured(start_engine, start_server) -> None:
    """llama.cpp's names and its logit_bias pairs, `false` banning a token."""
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    tokenizer = Tokenizer.from_file(str(fixtures.tokenizer_json_path()))
    (favoured,) = tokenizer.encode(" cat").ids
    body = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0, "return_tokens": True, "n_probs": 3}

    async def complete(**fields: Any) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            response = await client.post("/completion", json={**body, **fields})
        assert response.status_code == 200, response.text
        return response.json()

    greedy = (await complete())["tokens"]
    assert len(greedy) == 4
    assert (await complete(logit_bias=[[favoured, 100]]))["tokens"] == [favoured] * 4
    banned = await complete(logit_bias=[[greedy[0], False]])
    assert greedy[0] not in banned["tokens"]
    assert all(math.isfinite(item["logprob"]) for item in banned["completion_probabilities"])
    assert (await complete(top_k=1, temperature=1, seed=5))["tokens"] == greedy
    assert (await complete(repeat_penalty=1.5))["tokens"] != greedy
