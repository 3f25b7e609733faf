"""Routes that skipped the bounds, through real HTTP against a real server (issue 33, item 4).

Found by hostile testing: `/tokenize` with a 15 MB body raised RSS from 0.39 to
4.2 GB (5.1 GB with `with_pieces`), took 25-59 s and left 1.9-2.4 GB behind;
`/v1/cache/reset` accepted a 1 GiB body. Now the tokenizer routes take the
prompt's own bounds (the characters the context can hold, the context size in
ids) and threads of their own, and every route reads its body within a limit.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
HUGE = "lorem ipsum " * 1_250_000  # 15 MB


@pytest.fixture
async def client(start_engine, start_server):
    engine = await start_engine()
    async with httpx.AsyncClient(base_url=await start_server(engine), timeout=120) as http:
        yield http


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"content": HUGE}, "content"),
    ("/tokenize", {"content": HUGE, "with_pieces": True}, "content"),
    ("/detokenize", {"tokens": [1] * 2_000_000}, "tokens"),
])
async def test_tokenizer_routes_refuse_what_the_context_cannot_hold_at_once(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], param: str,
) -> None:
    results: dict[str, tuple[httpx.Response, float]] = {}

    async def post(name: str, route: str, payload: dict[str, Any]) -> None:
        started = time.monotonic()
        results[name] = (await client.post(route, json=payload), time.monotonic() - started)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "huge", path, body)
            nursery.start_soon(post, "normal", "/v1/chat/completions", NORMAL)
            nursery.start_soon(post, "small", "/tokenize", {"content": "hello world"})
    response, seconds = results["huge"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert seconds < 10  # 25-59 s before, tokenizing all of it
    assert results["normal"][0].status_code == 200
    assert results["small"][0].status_code == 200
    assert results["small"][0].json()["tokens"]


async def test_cache_reset_reads_a_small_body_only(client: httpx.AsyncClient) -> None:
    big = json.dumps({"disk": False, "pad": "x" * (1 << 20)}).encode()
    refused = await client.post("/v1/cache/reset", content=big, headers={"content-type": "application/json"})
    assert refused.status_code == 413
    assert refused.json()["error"]["code"] == "request_too_large"
    assert (await client.post("/v1/cache/reset", json={"disk": False})).status_code == 200
    assert (await client.post("/v1/cache/reset")).status_code == 200
    lora = await client.post("/lora-adapters", content=big, headers={"content-type": "application/json"})
    assert lora.status_code == 413


async def test_huge_prompts_under_the_bound_do_not_hold_up_a_small_one(client: httpx.AsyncClient) -> None:
    """Prompts too large to tokenize quickly but under the character bound took every render slot, and a
    normal request queued behind them (114 s on a 131k-context model); now they take a lane of their own,
    so a normal request sent among eight of them is answered faster than the first of them."""
    rng = random.Random(0)
    done: dict[str, float] = {}
    started = time.monotonic()

    async def post(name: str, body: dict[str, Any]) -> None:
        sent = time.monotonic()
        await client.post("/v1/chat/completions", json=body)
        done[name] = time.monotonic() - sent

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for index in range(8):
                # Distinct random words (no memo hits), 500k characters: under the bound, slow to tokenize.
                text = " ".join(f"w{rng.randrange(10**6)}x" for _ in range(55_000))
                nursery.start_soon(post, f"huge{index}", {**NORMAL, "messages": [{"role": "user", "content": text}]})
            await trio.sleep(max(0.0, 0.3 - (time.monotonic() - started)))
            nursery.start_soon(post, "normal", NORMAL)
    assert done["normal"] < min(done[f"huge{index}"] for index in range(8)), done
