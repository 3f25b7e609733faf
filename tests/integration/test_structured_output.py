"""response_format json_object / json_schema through a real server: the grammar makes random weights emit valid JSON.

The fixture's weights are random, so unconstrained it writes gibberish that
never parses; under a grammar every token it may sample keeps the reply
inside the schema, and EOS passes once the JSON is complete.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import httpx
import jsonschema
import openai
import trio

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CITY_FORMAT = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
MESSAGES = [{"role": "user", "content": "Which city? Answer in JSON."}]


async def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("model", "llama-v1-seed0")
    kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("max_tokens", 40)
    return await trio.to_thread.run_sync(partial(client.chat.completions.create, **kwargs))


def parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


async def test_response_format_constrains_chat_and_completions(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    free = await create(client, model=engine.model_id, temperature=0)
    assert not parses(free.choices[0].message.content)  # the grammar below does the work

    for temperature in (0, 1):  # greedy, then sampled
        reply = await create(client, model=engine.model_id, temperature=temperature, response_format=CITY_FORMAT)
        choice = reply.choices[0]
        jsonschema.validate(json.loads(choice.message.content), CITY)
        assert choice.finish_reason == "stop"

    any_object = await create(client, model=engine.model_id, temperature=0, max_tokens=200,
                              response_format={"type": "json_object"})
    assert isinstance(json.loads(any_object.choices[0].message.content), dict)

    chunks = await create(client, model=engine.model_id, temperature=0, stream=True, response_format=CITY_FORMAT)
    pieces = await trio.to_thread.run_sync(list, chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    jsonschema.validate(json.loads(text), CITY)
    assert [chunk.choices[0].finish_reason for chunk in pieces if chunk.choices][-1] == "stop"

    completion = await trio.to_thread.run_sync(partial(
        client.completions.create, model=engine.model_id, prompt="The city:", max_tokens=40, temperature=0,
        extra_body={"response_format": CITY_FORMAT},
    ))
    jsonschema.validate(json.loads(completion.choices[0].text), CITY)
    assert completion.choices[0].finish_reason == "stop"

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        bad = await http.post("/v1/chat/completions", json={
            "model": engine.model_id, "messages": MESSAGES,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        })
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "response_format.json_schema.schema"
