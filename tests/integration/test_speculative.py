"""--speculative ngram end to end: replies equal to plain decoding, the prompt cache unaffected, stats counted.

One engine on the llama fixture (random weights soon repeat a token, so the
n-gram proposer has work); ``speculative: false`` on a request is the plain
baseline in the same engine, so the field is tested with it.
"""

from __future__ import annotations

import json
from functools import partial

import httpx
import jsonschema
import pytest
import trio

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def gate_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step with proposals verifies: these tests are about what a verify step gives, not about when
    the gate (mlxcel/core/speculation_gate.py, measured wall times) lets one run."""
    from mlxcel.core.speculation_gate import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "should_verify", lambda gate, batch_size: True)


PATTERN = "alpha beta gamma delta alpha beta gamma epsilon "


@pytest.fixture
async def speculative_server(start_engine, start_server):
    engine = await start_engine("llama", speculative="ngram", speculative_tokens=4)
    return engine, await start_server(engine)


async def complete(client: httpx.AsyncClient, **body) -> dict:
    body = {"model": "llama-v1-seed0", "temperature": 0, "logprobs": 2, **body}
    response = await client.post("/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def same_reply(spoken: dict, plain: dict) -> None:
    a, b = spoken["choices"][0], plain["choices"][0]
    assert a["text"] == b["text"]
    assert a["finish_reason"] == b["finish_reason"]
    assert spoken["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"]
    assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
    for x, y in zip(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"], strict=True):
        assert abs(x - y) < 1e-4


async def stats(client: httpx.AsyncClient) -> dict:
    response = await client.get("/v1/cache/stats")
    assert response.status_code == 200
    return response.json()["speculative"]


async def test_replies_equal_plain_decoding_with_limits_and_stops(speculative_server) -> None:
    engine, base_url = speculative_server
    async with httpx.AsyncClient(base_url=base_url) as client:
        prompt = PATTERN * 12
        before = await stats(client)
        plain = await complete(client, prompt=prompt, max_tokens=24, speculative=False)
        assert (await stats(client))["proposed_tokens"] == before["proposed_tokens"]  # the field is honoured
        spoken = await complete(client, prompt=prompt, max_tokens=24)
        same_reply(spoken, plain)
        after = await stats(client)
        assert after["verify_steps"] > before["verify_steps"]
        assert after["accepted_tokens"] > 0
        assert after["mode"] == "ngram"
        assert 0 < after["acceptance_rate"] <= 1
        # max_tokens and a stop string landing inside accepted runs.
        for limit in (7, 9, 10):
            same_reply(await complete(client, prompt=prompt, max_tokens=limit),
                       await complete(client, prompt=prompt, max_tokens=limit, speculative=False))
        text = plain["choices"][0]["text"]
        for cut in (9, 13):
            stop = text[cut - 3:cut]
            same_reply(await complete(client, prompt=prompt, max_tokens=24, stop=[stop]),
                       await complete(client, prompt=prompt, max_tokens=24, stop=[stop], speculative=False))
        # Several rows at once, some speculating and some not.
        results: dict[int, dict] = {}

        async def one(index: int) -> None:
            results[index] = await complete(client, prompt=PATTERN * (8 + index), max_tokens=20,
                                            speculative=index % 2 == 0)

        async with trio.open_nursery() as nursery:
            for index in range(4):
                nursery.start_soon(one, index)
        for index in range(4):
            same_reply(results[index], await complete(client, prompt=PATTERN * (8 + index), max_tokens=20,
                                                      speculative=False))


async def assert_a_hit_after_a_speculative_turn_equals_a_cold_run(base_url: str, model: str, counter: str) -> None:
    """A speculative turn (its ``counter`` in the stats goes up), then its follow-up: a hit on that turn's
    stored KV answers as a cold run (replies, logprobs and top logprobs within 1e-4)."""
    async with httpx.AsyncClient(base_url=base_url) as client:
        messages = [{"role": "system", "content": PATTERN * 10}, {"role": "user", "content": "go on"}]
        body = {"model": model, "temperature": 0, "max_tokens": 32}
        first = (await client.post("/v1/chat/completions", json={**body, "messages": messages}, timeout=300)).json()
        assert (await stats(client))[counter] > 0
        follow_up = [*messages, {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "again"}]
        request = {**body, "messages": follow_up, "logprobs": True, "top_logprobs": 5, "max_tokens": 8,
                   "speculative": False}
        cached = (await client.post("/v1/chat/completions", json=request, timeout=300)).json()
        cold = (await client.post("/v1/chat/completions", json={**request, "cache_prompt": False},
                                  timeout=300)).json()
        assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"] // 2
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert cached["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
        for a, b in zip(cached["choices"][0]["logprobs"]["content"], cold["choices"][0]["logprobs"]["content"],
                        strict=True):
            assert abs(a["logprob"] - b["logprob"]) < 1e-4
            for x, y in zip(a["top_logprobs"], b["top_logprobs"], strict=True):
                assert x["token"] == y["token"]
                assert abs(x["logprob"] - y["logprob"]) < 1e-4


async def test_a_hit_after_a_speculative_turn_equals_a_cold_run(speculative_server) -> None:
    engine, base_url = speculative_server
    await assert_a_hit_after_a_speculative_turn_equals_a_cold_run(base_url, engine.model_id, "accepted_tokens")


# --- --speculative draft ------------------------------------------------------------------------


@pytest.fixture(params=["itself", "another"])
async def draft_server(request, start_engine, start_server):
    from mlxcel.fixtures import fixture_path

    # The model as its own draft (every greedy proposal holds) and another random-weight model of
    # the same tokenizer (most are rejected).
    draft = fixture_path("llama", seed=0 if request.param == "itself" else 1)
    engine = await start_engine("llama", speculative="draft", draft_model=draft, speculative_tokens=4)
    return request.param, await start_server(engine)


async def test_draft_replies_equal_plain_decoding_with_rows_joining_and_leaving(draft_server) -> None:
    kind, base_url = draft_server
    async with httpx.AsyncClient(base_url=base_url) as client:
        prompt = "the quick brown fox jumps over the lazy dog " * 3
        plain = await complete(client, prompt=prompt, max_tokens=24, speculative=False)
        assert (await stats(client))["proposed_tokens"] == 0  # the field is honoured
        spoken = await complete(client, prompt=prompt, max_tokens=24)
        same_reply(spoken, plain)
        after = await stats(client)
        assert after["mode"] == "draft"
        assert after["verify_steps"] > 0
        if kind == "itself":
            assert after["acceptance_rate"] > 0.9
        else:
            assert after["proposed_tokens"] > after["accepted_tokens"]
        # Rows of different lengths joining and leaving while others speculate, some opted out.
        results: dict[int, dict] = {}

        async def one(index: int) -> None:
            await trio.sleep(0.05 * index)
            results[index] = await complete(client, prompt=PATTERN * (2 + 3 * index), max_tokens=8 + 5 * index,
                                            speculative=index != 2)

        async with trio.open_nursery() as nursery:
            for index in range(5):
                nursery.start_soon(one, index)
        for index in range(5):
            same_reply(results[index], await complete(client, prompt=PATTERN * (2 + 3 * index),
                                                      max_tokens=8 + 5 * index, speculative=False))


async def test_a_hit_after_a_draft_speculative_turn_equals_a_cold_run(draft_server) -> None:
    _kind, base_url = draft_server
    await assert_a_hit_after_a_speculative_turn_equals_a_cold_run(base_url, "llama-v1-seed0", "proposed_tokens")


async def test_sampled_replies_with_a_draft_keep_their_seed(draft_server) -> None:
    # A seeded sampled request twice: the same reply (the draft's own draws come from the row's seed too).
    _kind, base_url = draft_server
    async with httpx.AsyncClient(base_url=base_url) as client:
        body = {"prompt": PATTERN * 4, "max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 7}
        first = await complete(client, **body)
        second = await complete(client, **body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert (await stats(client))["verify_steps"] > 0


async def test_a_closed_gate_decodes_plainly_but_a_seeded_sampled_row_still_verifies(
        speculative_server, monkeypatch) -> None:
    """Where verify steps lose to plain ones the gate stops them: greedy replies stay those of plain decoding
    and no step verifies; a seeded sampled request verifies whatever the gate says, so it repeats."""
    from mlxcel.core.speculation_gate import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "should_verify", lambda gate, batch_size: False)
    _engine, base_url = speculative_server
    async with httpx.AsyncClient(base_url=base_url) as client:
        prompt = PATTERN * 12
        before = (await stats(client))["verify_steps"]
        spoken = await complete(client, prompt=prompt, max_tokens=24)
        plain = await complete(client, prompt=prompt, max_tokens=24, speculative=False)
        same_reply(spoken, plain)
        assert (await stats(client))["verify_steps"] == before
        # Sampled, but cool enough to repeat the pattern as greedy decoding does (so rows propose).
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0.05, "seed": 7}
        first = await complete(client, **body)
        second = await complete(client, **body)
        assert first["choices"][0]["text"] == second["choices"][0]["text"]
        assert (await stats(client))["verify_steps"] > before


LIST_OF_WORDS = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 16, "maxItems": 16}


async def test_grammar_rows_beside_speculating_rows_stay_valid(speculative_server) -> None:
    """A constrained row takes a verify step's first position through its own processor and masked sampler,
    and a plain step's through the step's shared masks (model/batch_step.py): its matcher is fed each token
    once either way, so the reply follows the schema."""
    engine, base_url = speculative_server
    response_format = {"type": "json_schema", "json_schema": {"name": "words", "schema": LIST_OF_WORDS}}
    async with httpx.AsyncClient(base_url=base_url) as client:
        before = await stats(client)
        replies: dict[str, dict] = {}

        async def constrained(name: str, **sampling) -> None:
            body = {"model": "llama-v1-seed0", "max_tokens": 120, "response_format": response_format,
                    "messages": [{"role": "user", "content": f"{name}: list sixteen words"}], **sampling}
            response = await client.post("/v1/chat/completions", json=body, timeout=300)
            assert response.status_code == 200, response.text
            replies[name] = response.json()

        async with trio.open_nursery() as nursery:
            for index in range(3):
                nursery.start_soon(lambda i=index: complete(client, prompt=PATTERN * (10 + i), max_tokens=60))
            nursery.start_soon(partial(constrained, "greedy", temperature=0))
            nursery.start_soon(partial(constrained, "sampled", temperature=1.0, seed=7))
        assert (await stats(client))["verify_steps"] > before["verify_steps"]
    for name, reply in replies.items():
        choice = reply["choices"][0]
        assert choice["finish_reason"] == "stop", name
        jsonschema.validate(json.loads(choice["message"]["content"]), LIST_OF_WORDS)
