"""response_format json_object / json_schema through a real server: the grammar makes random weights emit valid JSON.

The fixture's weights are random, so unconstrained it writes gibberish that
never parses; under a grammar every token it may sample keeps the reply
inside the schema, and EOS passes once the JSON is complete.
"""

from __future__ import annotations

import json
import re
from functools import partial
from typing import Any

import httpx
import jsonschema
import openai
import pytest
import trio

pytestmark = pytest.mark.slow

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

    # Constraints act on sampling only: the same constrained prompt is a cache hit, with the same answer.
    long_messages = [{"role": "system", "content": "You answer in JSON, briefly and exactly. " * 12}, *MESSAGES]
    cold = await create(client, model=engine.model_id, temperature=0, messages=long_messages,
                        response_format=CITY_FORMAT)
    warm = await create(client, model=engine.model_id, temperature=0, messages=long_messages,
                        response_format=CITY_FORMAT)
    assert warm.usage.prompt_tokens_details.cached_tokens > 0
    assert warm.choices[0].message.content == cold.choices[0].message.content

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


# Ten schemas of the shapes extraction asks for: nested objects, arrays, enums, bounded numbers, required fields.
SCHEMAS = [
    CITY,
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["age"],
     "additionalProperties": False},
    # Properties are written in this order: an unbounded-digit number last, so a seed that writes a long one
    # has written the rest by then (with "score" first, seed 12 runs its digits to max_tokens).
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["score", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"person": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                         "year": {"type": "integer", "minimum": 1900, "maximum": 2030}},
        "required": ["name", "year"], "additionalProperties": False}}, "required": ["person"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"const": "event"}, "level": {"enum": [1, 2, 3]}},
     "required": ["kind", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"],
     "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                      "confidence": {"type": "integer", "minimum": 0, "maximum": 100}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"when": {"type": "object", "properties": {
        "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "month": {"enum": ["jan", "feb", "mar"]}}, "required": ["day", "month"], "additionalProperties": False},
        "note": {"type": "string", "maxLength": 5}}, "required": ["when"], "additionalProperties": False},
]


async def test_a_hundred_constrained_replies_over_ten_schemas_all_validate(start_engine, start_server) -> None:
    """16 streams at a time, constrained and free in one batch, streaming and not; then /metrics shows the cost."""
    engine = await start_engine("llama")
    base_url = await start_server(engine, metrics=True)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    failures: list[str] = []
    free_replies: list[str] = []

    async def constrained(index: int) -> None:
        schema = SCHEMAS[index % len(SCHEMAS)]
        response_format = {"type": "json_schema", "json_schema": {"name": f"s{index % 10}", "schema": schema}}
        kwargs = {"model": engine.model_id, "temperature": 1.0, "seed": index, "max_tokens": 200,
                  "response_format": response_format}
        if index % 2:
            chunks = await create(client, stream=True, **kwargs)
            pieces = await trio.to_thread.run_sync(list, chunks)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
            finish = [chunk.choices[0].finish_reason for chunk in pieces if chunk.choices][-1]
        else:
            reply = await create(client, **kwargs)
            text, finish = reply.choices[0].message.content, reply.choices[0].finish_reason
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as error:
            failures.append(f"request {index} ({finish}): {text!r}: {error}")

    async def free(index: int) -> None:
        reply = await create(client, model=engine.model_id, temperature=1.0, seed=index, max_tokens=30)
        free_replies.append(reply.choices[0].message.content)

    limiter = trio.CapacityLimiter(16)

    async def limited(job: Any, index: int) -> None:
        async with limiter:
            await job(index)

    async with trio.open_nursery() as nursery:
        for index in range(100):
            nursery.start_soon(limited, constrained, index)
            if index % 4 == 0:
                nursery.start_soon(limited, free, index)
    assert failures == []
    # The free replies in the same batches were not constrained (random weights do not write JSON).
    assert sum(parses(text) for text in free_replies) < len(free_replies) // 2

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        metrics = (await http.get("/metrics")).text
    series = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
              if line.startswith("mlxcel_grammar_")}
    assert series["mlxcel_grammar_matchers_built_total"] == 100
    assert series["mlxcel_grammar_masks_total"] >= 100 * 5
    assert 0 < series["mlxcel_grammar_mask_seconds_total"] < 60


async def test_native_completion_json_schema_and_gbnf_grammar(start_engine, start_server) -> None:
    engine = await start_engine("llama")
    base_url = await start_server(engine)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        body = {"prompt": "Answer:", "n_predict": 40, "temperature": 1.0, "seed": 3}
        schema = await http.post("/completion", json={**body, "json_schema": CITY})
        jsonschema.validate(json.loads(schema.json()["content"]), CITY)
        gbnf = 'root ::= answer " " digit\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
        for seed in range(4):
            reply = await http.post("/completion", json={**body, "seed": seed, "grammar": gbnf})
            text = reply.json()["content"]
            assert re.fullmatch(r"(yes|no) [0-9]", text), text
        broken = await http.post("/completion", json={**body, "grammar": "root ::= missing"})
        assert broken.status_code == 400
        assert broken.json()["error"]["param"] == "grammar"
        assert "missing" in broken.json()["error"]["message"]
        assert (await http.post("/completion", json=body)).status_code == 200
