"""Grammars built to hurt the server, through real HTTP against a real server (issue 33, items 1 and 2).

Found by hostile testing: a 30 KB schema of 800 patternProperties compiled for
399 s, a 20,000-rule GBNF grammar for over 7 minutes, 41 such requests took
every worker thread (a normal chat timed out, SIGTERM no longer worked), and
100k GBNF branches reached a llguidance panic answered as a 500 with its Rust
backtrace. Now each is refused with a 400 naming its field, in about a
second, while a normal request beside them is served.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest
import trio

from tests.actors.test_grammar_mask_bound import LATE_SLOW_MARK, SLOW_MARK, slow_masks  # noqa: F401 - a fixture

pytestmark = pytest.mark.slow

NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
PATTERN_BOMB = {"type": "object", "patternProperties": {f"^a{i}[a-z]+{i}$": {"type": "string"} for i in range(800)}}
PROPERTY_BOMB = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100_000)}}
RULES_BOMB = "root ::= r0\n" + "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(20_000)) + '\nr20000 ::= "z"'
BRANCH_BOMB = "root ::= " + " | ".join(f'"a{i}"' for i in range(100_000))

BOMBS = [
    ("/v1/chat/completions", {**NORMAL, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bomb", "schema": PATTERN_BOMB}}}, "response_format.json_schema.schema"),
    ("/completion", {"prompt": "hi", "n_predict": 1, "json_schema": PROPERTY_BOMB}, "json_schema"),
    ("/completion", {"prompt": "hi", "n_predict": 1, "grammar": RULES_BOMB}, "grammar"),
    ("/completion", {"prompt": "hi", "n_predict": 1, "grammar": BRANCH_BOMB}, "grammar"),
    ("/v1/chat/completions", {**NORMAL, "tools": [{"type": "function", "function": {
        "name": "bomb", "parameters": PROPERTY_BOMB}}]}, "tools[0].function.parameters"),
    # Each within the bounds, together not: 20,000 properties took 17 s to check against the meta-schema.
    ("/v1/chat/completions", {**NORMAL, "tools": [{"type": "function", "function": {"name": f"t{t}", "parameters": {
        "type": "object", "properties": {f"t{t}p{i}": {"type": "integer"} for i in range(1000)}}}}
        for t in range(20)]}, "tools"),
]


@pytest.fixture
async def serve(start_engine, start_server):
    clients: list[httpx.AsyncClient] = []

    async def start(**engine_changes: Any) -> httpx.AsyncClient:
        engine = await start_engine(**engine_changes)
        client = httpx.AsyncClient(base_url=await start_server(engine), timeout=120)
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.aclose()


async def test_grammar_bombs_are_refused_at_once_naming_the_field_and_others_are_served(serve) -> None:
    client = await serve()
    results: dict[str, tuple[httpx.Response, float]] = {}

    async def post(name: str, path: str, body: dict[str, Any]) -> None:
        started = time.monotonic()
        results[name] = (await client.post(path, json=body), time.monotonic() - started)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for index, (path, body, _param) in enumerate(BOMBS):
                nursery.start_soon(post, f"bomb{index}", path, body)
            nursery.start_soon(post, "normal", "/v1/chat/completions", NORMAL)
    assert results["normal"][0].status_code == 200, results["normal"][0].text
    for index, (_path, _body, param) in enumerate(BOMBS):
        response, seconds = results[f"bomb{index}"]
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert error["code"] == "grammar_too_large"
        assert "\n" not in error["message"]
        assert "backtrace" not in response.text
        assert seconds < 15, (param, seconds)  # minutes before; a few seconds on this loaded CPU


async def test_slow_compiles_are_cut_off_and_plain_requests_keep_their_threads_and_slots(serve) -> None:
    """Within the size bounds a grammar may still compile slowly (2,000 properties: about a second here):
    past --grammar-timeout it is a 400, a grammar that found no compile place a 503, and a plain request
    sent among eight of them is served at once."""
    client = await serve(grammar_timeout=0.1)

    def schema(seed: int) -> dict[str, Any]:
        # Distinct per request, so no verdict is remembered.
        return {"type": "object", "properties": {f"s{seed}p{i}": {"type": "integer"} for i in range(2000)}}

    results: dict[str, tuple[int, float]] = {}

    async def post(name: str, path: str, body: dict[str, Any]) -> None:
        started = time.monotonic()
        response = await (client.post(path, json=body) if body else client.get(path))
        results[name] = (response.status_code, time.monotonic() - started)

    # The first grammar builds the llguidance tokenizer (seconds, outside the limit).
    first = await client.post("/v1/chat/completions", json={**NORMAL, "response_format": {"type": "json_object"}})
    assert first.status_code == 200, first.text
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for seed in range(8):
                nursery.start_soon(post, f"grammar{seed}", "/v1/chat/completions", {
                    **NORMAL, "response_format": {"type": "json_schema", "json_schema": {
                        "name": "big", "schema": schema(seed)}}})
            await trio.sleep(0.2)
            nursery.start_soon(post, "normal", "/v1/chat/completions", NORMAL)
            nursery.start_soon(post, "health", "/health", {})
    assert results["normal"][0] == 200
    assert results["health"][0] == 200
    statuses = [results[f"grammar{seed}"][0] for seed in range(8)]
    assert set(statuses) <= {400, 503}, statuses
    assert 400 in statuses
    assert results["normal"][1] < 10, results
    assert results["health"][1] < 5, results  # the schemas' meta-schema checks still take the CPU



# A real grammar whose masks are slow (issue 33, item 3): ambiguous enough that llguidance's Earley
# parser spends ~0.5 s on its first mask on this CPU, within its item limit (it fails the second).
SLOW_MASK_GBNF = 'root ::= e\ne ::= e e | e e e | "(" e ")" | [a-z]+ | [a-z0-9 ]'
# Through the device's test hook (tests/actors/test_grammar_mask_bound.py): each mask takes 3 s, asleep.
HOOKED_SLOW_GBNF = f'root ::= "{SLOW_MARK}" [a-z]*'
LONG_NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 192, "temperature": 0}


@pytest.mark.usefixtures("slow_masks")
async def test_a_grammar_with_slow_masks_ends_alone_and_a_normal_request_beside_it_keeps_its_pace(serve) -> None:
    """Before: the device built its own llguidance tokenizer on the first constrained step (GIL held
    for 5-8 s here) and waited for every mask, so one such request held every stream up (6.9 s instead
    of 0.2 s in the issue). Now the tokenizer is built at start-up, a mask later than
    --grammar-mask-timeout-ms ends its own request with a 400 naming the field, and a normal request
    running beside two of them keeps within 1.5x of its time alone. The bound is the GPU default here
    (50 ms): a row given up costs the batch one wait of it, which the CPU default (200 ms) would make a
    large share of a short request on this loaded machine."""
    client = await serve(grammar_mask_timeout_ms=50)

    async def normal_seconds() -> float:
        started = time.monotonic()
        response = await client.post("/v1/chat/completions", json=LONG_NORMAL)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 192
        return time.monotonic() - started

    slow: list[httpx.Response] = []
    alone: list[float] = []
    beside: list[float] = []

    async def slow_request(grammar: str) -> None:
        slow.append(await client.post("/completion", json={"prompt": "hi", "n_predict": 32, "grammar": grammar}))

    async def normal_beside(grammar: str, count: int) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(beside, normal_seconds()))
            for _ in range(count):
                await trio.sleep(0.2)
                nursery.start_soon(slow_request, grammar)

    await normal_seconds()  # compiles the shapes
    with trio.fail_after(180):
        # Interleaved rounds, medians compared: this shared machine's speed drifts by 2x within minutes.
        for _ in range(3):
            alone.append(await normal_seconds())
            await normal_beside(HOOKED_SLOW_GBNF, 2)
        # The real slow grammar ends the same way (its abandoned mask still takes a core for a while,
        # which on this 2-core machine the forward pass feels: no bound on the time beside it here).
        await normal_beside(SLOW_MASK_GBNF, 1)
    for index, response in enumerate(slow):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "grammar", error
        if index < 6:
            assert error["code"] == "grammar_too_slow", error
            assert "--grammar-mask-timeout-ms" in error["message"]
        else:
            # Its first mask may also finish in time on a quiet machine; its second is past llguidance's limit.
            assert error["code"] in ("grammar_too_slow", "grammar_failed"), error
    assert statistics.median(beside[:3]) <= 1.5 * statistics.median(alone), (alone, beside)
    # Given up mid-reply while streaming, the reply ends with one error event of the same body, then [DONE].
    streamed = await client.post("/v1/chat/completions", json={**LONG_NORMAL, "stream": True, "response_format": {
        "type": "json_schema", "json_schema": {"name": "slow", "schema": {"enum": [LATE_SLOW_MARK]}}}})
    assert streamed.status_code == 200
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["param"]) == ("grammar_too_slow", "response_format.json_schema.schema"), error
    assert not any("error" in json.loads(event) for event in events[:-2])


async def _append(values: list[float], value: Awaitable[float]) -> None:
    values.append(await value)
