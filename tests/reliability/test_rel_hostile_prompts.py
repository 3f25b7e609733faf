"""Prompts built to hurt the server, through real HTTP against a real server.

Found by hostile testing against the demo model: token ids past the vocabulary
(a segfault, or a read past the embedding table), a request-supplied chat
template that renders for a minute into gigabytes, and a prompt of many
megabytes that held every other request up while it was tokenized.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

pytestmark = pytest.mark.slow

VOCAB_SIZE = 151_646  # the llama fixture's embedding rows and tokenizer size
NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
BOMB = '{{ "ab " * 30000000 }}'


@pytest.fixture
async def serve(start_engine, start_server):
    clients: list[httpx.AsyncClient] = []

    async def start(**engine_changes: Any) -> httpx.AsyncClient:
        engine = await start_engine(**engine_changes)
        client = httpx.AsyncClient(base_url=await start_server(engine), timeout=60)
        clients.append(client)
        return client

    yield start
    # Closed while the server still runs, so no pooled connection is left to the collector.
    for client in clients:
        await client.aclose()


async def assert_still_serves(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/chat/completions", json=NORMAL)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": [VOCAB_SIZE], "max_tokens": 1}, "prompt[0]"),
    ("/v1/completions", {"prompt": [1, 2, VOCAB_SIZE + 50], "max_tokens": 1}, "prompt[2]"),
    ("/completion", {"prompt": [0, VOCAB_SIZE], "n_predict": 1}, "prompt[1]"),
])
async def test_token_ids_past_the_vocabulary_get_a_400(serve, path: str, body: dict, param: str) -> None:
    client = await serve()
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = await client.post("/v1/completions", json={"prompt": [0, VOCAB_SIZE - 1], "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    await assert_still_serves(client)


async def test_a_request_chat_template_is_refused_by_default(serve) -> None:
    client = await serve()
    for body in ({**NORMAL, "chat_template_kwargs": {"chat_template": BOMB}},
                 {**NORMAL, "extra_body": {"chat_template_kwargs": {"chat_template": BOMB}}}):
        with trio.fail_after(10):
            response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "chat_template_kwargs.chat_template"
    await assert_still_serves(client)


async def test_an_allowed_template_bomb_is_refused_quickly_and_others_are_served(serve) -> None:
    client = await serve(allow_request_chat_template=True)
    statuses: dict[str, int] = {}

    async def post(name: str, body: dict) -> None:
        statuses[name] = (await client.post("/v1/chat/completions", json=body)).status_code

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "bomb", {**NORMAL, "chat_template_kwargs": {"chat_template": BOMB}})
            nursery.start_soon(post, "normal", NORMAL)
    assert statuses == {"bomb": 400, "normal": 200}
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
    response = await client.post("/v1/chat/completions", json={**NORMAL, "chat_template_kwargs": {
        "chat_template": template}})
    assert response.status_code == 200, response.text
    raw = await client.post("/v1/completions", json={"prompt": "user: hi\nassistant:", "max_tokens": 1})
    assert response.json()["usage"]["prompt_tokens"] == raw.json()["usage"]["prompt_tokens"]


async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(serve) -> None:
    """4 MB of text cannot fit 4,096 tokens of at most 128 characters: refused on its length,
    while a normal request sent alongside is served."""
    client = await serve()
    huge = "lorem ipsum " * 350_000
    responses: dict[str, httpx.Response] = {}

    async def post(name: str, path: str, body: dict) -> None:
        responses[name] = await client.post(path, json=body)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "chat", "/v1/chat/completions",
                               {**NORMAL, "messages": [{"role": "user", "content": huge}]})
            nursery.start_soon(post, "completion", "/v1/completions", {"prompt": huge, "max_tokens": 1})
            nursery.start_soon(post, "normal", "/v1/chat/completions", NORMAL)
    assert responses["normal"].status_code == 200
    for name in ("chat", "completion"):
        error = responses[name].json()["error"]
        assert responses[name].status_code == 400
        assert error["code"] == "context_length_exceeded"
        assert "characters" in error["message"]
