"""HTTP through a real hypercorn on loopback, with the official openai client and httpx."""

from __future__ import annotations

import json
from functools import partial

import httpx
import openai
import pytest
import trio

from tests.support import wait_until

pytestmark = pytest.mark.slow

# The fixture folder's name is the served model id.
MODEL_ID = "llama-v1-seed0"
GOOD_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


async def in_thread(function, *args, **kwargs):
    return await trio.to_thread.run_sync(partial(function, *args, **kwargs))


async def idle_stats(engine):
    """The scheduler's statistics once nothing runs; None while something does."""
    stats = await engine.scheduler_stats()
    return None if stats.num_running else stats


@pytest.fixture
async def base_url(start_engine, start_server) -> str:
    engine = await start_engine()
    return await start_server(engine, metrics=True)


async def test_openai_client_chat_not_streaming(base_url: str) -> None:
    client = openai_client(base_url)
    completion = await in_thread(
        client.chat.completions.create,
        model=MODEL_ID,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello!"}],
        max_tokens=5,
        temperature=0,
        seed=7,
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens == 5 or choice.finish_reason == "stop"
    assert completion.usage.prompt_tokens > 5
    assert completion.usage.prompt_tokens_details.cached_tokens == 0


async def test_openai_client_chat_streaming_with_usage(base_url: str) -> None:
    client = openai_client(base_url)

    def run() -> tuple[list[str], list]:
        chunks = list(client.chat.completions.create(
            model=MODEL_ID,
            messages=[{"role": "user", "content": "Stream to me"}],
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        ))
        texts = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        return texts, chunks

    texts, chunks = await in_thread(run)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["length"], ["stop"])
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens in range(1, 7)
    whole = await in_thread(
        openai_client(base_url).chat.completions.create,
        model=MODEL_ID, messages=[{"role": "user", "content": "Stream to me"}], max_tokens=6, temperature=0,
    )
    assert "".join(texts) == whole.choices[0].message.content


async def test_models_and_health(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url) as client:
        health = await client.get("/health")
        assert health.status_code == 200
        assert health.json()["status"] == "ok"
        models = (await client.get("/v1/models")).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == MODEL_ID
    listed = await in_thread(lambda: [m.id for m in openai_client(base_url).models.list()])
    assert listed == [models["data"][0]["id"]]


BAD_REQUESTS = [
    pytest.param(b"{not json", 400, None, id="malformed-json"),
    pytest.param(json.dumps({"max_tokens": 3}).encode(), 400, "messages", id="missing-messages"),
    pytest.param(json.dumps({"messages": []}).encode(), 400, "messages", id="empty-messages"),
    pytest.param(json.dumps({"messages": "hi"}).encode(), 400, "messages", id="messages-wrong-type"),
    pytest.param(json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400,
                 "messages[0].content", id="content-wrong-type"),
    pytest.param(json.dumps({**GOOD_CHAT, "max_tokens": -1}).encode(), 400, "max_tokens", id="negative-max-tokens"),
    pytest.param(json.dumps({**GOOD_CHAT, "max_tokens": 10**12}).encode(), 400, "max_tokens", id="absurd-max-tokens"),
    pytest.param(json.dumps({**GOOD_CHAT, "temperature": "hot"}).encode(), 400, "temperature", id="temperature-type"),
    pytest.param(json.dumps({"messages": [{"role": "wizard", "content": "x"}]}).encode(), 400,
                 "messages[0].role", id="unknown-role"),
    pytest.param(json.dumps({"messages": [{"role": "user", "content": "word " * 5000}]}).encode(), 400,
                 "messages", id="prompt-over-context"),
    pytest.param(b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, None, id="invalid-utf8"),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_REQUESTS)
async def test_bad_input_gets_openai_error_then_server_keeps_serving(base_url, body, status, param) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        response = await client.post(
            "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
        )
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        if param is not None:
            assert error["param"] == param
        good = await client.post("/v1/chat/completions", json=GOOD_CHAT)
        assert good.status_code == 200, good.text
        assert good.json()["choices"][0]["message"]["content"] is not None


async def test_openai_client_raises_bad_request(base_url: str) -> None:
    client = openai_client(base_url)
    with pytest.raises(openai.BadRequestError) as caught:
        await in_thread(client.chat.completions.create, model=MODEL_ID, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert caught.value.body["param"] == "max_tokens"


async def test_text_completions_and_native_completion(base_url: str) -> None:
    client = openai_client(base_url)
    completion = await in_thread(client.completions.create, model=MODEL_ID, prompt="Once upon a time", max_tokens=4,
                                 temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop")
    assert completion.usage.completion_tokens == 4 or completion.choices[0].finish_reason == "stop"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        native = (await http.post("/completion", json={"prompt": "Once upon a time", "n_predict": 4,
                                                        "temperature": 0})).json()
        assert native["content"] == completion.choices[0].text
        assert native["tokens_predicted"] == completion.usage.completion_tokens
        async with http.stream("POST", "/completion", json={"prompt": "Once upon a time", "n_predict": 4,
                                                              "temperature": 0, "stream": True}) as stream:
            events = [json.loads(line[6:]) async for line in stream.aiter_lines() if line.startswith("data: ")]
    assert "".join(event["content"] for event in events) == native["content"]
    assert events[-1]["stop"] is True
    assert events[-1]["tokens_predicted"] == native["tokens_predicted"]


async def test_unknown_route_and_model(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        missing = await client.get("/v2/nothing")
        assert missing.status_code == 404
        assert "error" in missing.json()
        wrong_model = await client.post("/v1/chat/completions", json={**GOOD_CHAT, "model": "gpt-5"})
        assert wrong_model.status_code == 404
        assert wrong_model.json()["error"]["param"] == "model"


async def test_client_disconnect_mid_stream_frees_the_sequence(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine)
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 3000, "temperature": 0, "stream": True}
    async with (
        httpx.AsyncClient(base_url=base_url, timeout=60) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as stream,
    ):
        received = 0
        async for line in stream.aiter_lines():
            received += line.startswith("data: ")
            if received == 3:
                break  # leaving the block closes the connection mid-stream
    stats = await wait_until(lambda: idle_stats(engine))
    assert stats.num_cancelled == 1
    assert stats.num_completed == 0
    assert (await engine.cache_stats())["entries"] <= 1  # at most the prompt, never the partial reply


async def test_full_queue_answers_503_with_retry_after(start_engine, start_server) -> None:
    from mlxcel.config import SchedulerConfig

    engine = await start_engine(scheduler=SchedulerConfig(max_batch_size=1, max_queued_requests=1))
    base_url = await start_server(engine)
    statuses = []

    async def one(index: int) -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
            response = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": f"q{index}"}], "max_tokens": 30, "temperature": 0})
            statuses.append(response.status_code)
            if response.status_code == 503:
                assert response.headers["retry-after"]
                assert response.json()["error"]["code"] == "server_busy"

    async with trio.open_nursery() as nursery:
        for index in range(5):
            nursery.start_soon(one, index)
    assert 503 in statuses
    assert 200 in statuses


async def test_seed_makes_sampling_repeatable(base_url: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        def body(seed: int) -> dict:
            return {"messages": [{"role": "user", "content": "sample"}], "max_tokens": 12,
                    "temperature": 1.0, "seed": seed}
        first = (await client.post("/v1/chat/completions", json=body(1234))).json()
        again = (await client.post("/v1/chat/completions", json=body(1234))).json()
        other = (await client.post("/v1/chat/completions", json=body(99))).json()
    text = lambda reply: reply["choices"][0]["message"]["content"]  # noqa: E731
    assert text(first) == text(again)
    # Random weights give a near-uniform next-token distribution: other seeds differ.
    assert text(other) != text(first)
