"""llama.cpp's native surface through a real server: `/completion` fields, n_probs, /tokenize, /detokenize."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mlxcel.http.llamacpp import token_bytes

pytestmark = pytest.mark.slow

MODEL_ID = "llama-v1-seed0"
TIMING_KEYS = {
    "cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second",
}


@pytest.fixture
async def server(start_engine, start_server) -> tuple[Any, str]:
    engine = await start_engine()
    return engine, await start_server(engine)


async def post(base_url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        return await client.post(path, json=body)


async def test_openai_routes_answer_without_v1(server) -> None:
    _engine, base_url = server
    chat = await post(base_url, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.status_code == 200
    assert chat.json()["object"] == "chat.completion"
    legacy = await post(base_url, "/completions", {"prompt": "hi", "max_tokens": 2})
    assert legacy.status_code == 200
    assert legacy.json()["object"] == "text_completion"


async def test_completion_carries_llamacpp_fields(server) -> None:
    engine, base_url = server
    # Long enough for the prompt cache to keep it.
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 8, "n_predict": 4, "temperature": 0, "return_tokens": True, "n_probs": 3}
    first = (await post(base_url, "/completion", body)).json()
    reply = (await post(base_url, "/completion", body)).json()
    assert reply["stop"] is True
    assert reply["stop_type"] == "limit"
    assert reply["stopping_word"] == ""
    assert reply["truncated"] is False
    assert reply["has_new_line"] == ("\n" in reply["content"])
    assert len(reply["tokens"]) == 4 == reply["tokens_predicted"]
    # mlx-lm's streaming detokenizer drops the one space a reply starts with (as mlx_lm.server does).
    assert engine.model.tokenizer.decode(reply["tokens"]).removeprefix(" ") == reply["content"] == first["content"]
    timings = reply["timings"]
    assert set(timings) == TIMING_KEYS
    # The second identical prompt reuses the first one's prefix.
    assert timings["cache_n"] == reply["tokens_cached"] > 0
    assert timings["prompt_n"] == reply["tokens_evaluated"] - reply["tokens_cached"]
    assert timings["predicted_n"] == 4
    assert timings["prompt_ms"] > 0
    assert timings["predicted_ms"] > 0
    assert timings["predicted_per_second"] > 0
    assert timings["predicted_per_token_ms"] == pytest.approx(timings["predicted_ms"] / 4)
    settings = reply["generation_settings"]
    assert (settings["n_predict"], settings["n_probs"], settings["model"]) == (4, 3, MODEL_ID)
    assert settings["n_ctx"] == engine.model.context_size
    probabilities = reply["completion_probabilities"]
    assert [entry["id"] for entry in probabilities] == reply["tokens"]
    for entry in probabilities:
        assert set(entry) == {"id", "token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry["top_logprobs"][0]["id"] == entry["id"]
        assert entry["logprob"] <= 0
        assert entry["bytes"] == list(token_bytes(engine.model.tokenizer, entry["id"]))
        assert set(entry["top_logprobs"][0]) == {"id", "token", "logprob", "bytes"}


async def test_completion_without_return_tokens_has_empty_tokens_and_no_probabilities(server) -> None:
    _engine, base_url = server
    reply = (await post(base_url, "/completion", {"prompt": "hello", "n_predict": 2})).json()
    assert reply["tokens"] == []
    assert "completion_probabilities" not in reply
    assert reply["generation_settings"]["n_probs"] == 0


async def test_completion_stopped_by_a_word_says_which(server) -> None:
    _engine, base_url = server
    plain = (await post(base_url, "/completion", {"prompt": "Count", "n_predict": 6, "temperature": 0})).json()
    word = plain["content"][2:5]
    assert word
    reply = (await post(base_url, "/completion", {
        "prompt": "Count", "n_predict": 6, "temperature": 0, "stop": [word]})).json()
    assert reply["stop_type"] == "word"
    assert reply["stopping_word"] == word
    assert reply["content"] == plain["content"][: plain["content"].index(word)]


async def test_streamed_completion_carries_tokens_and_ends_with_the_final_fields(server) -> None:
    engine, base_url = server
    body = {"prompt": "Tell me", "n_predict": 5, "temperature": 0, "stream": True, "n_probs": 1}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client, \
            client.stream("POST", "/completion", json=body) as response:
        events = [json.loads(line[len("data: "):]) async for line in response.aiter_lines() if line.startswith("data: ")]
    ids = [token for event in events for token in event["tokens"]]
    assert len(ids) == 5
    assert engine.model.tokenizer.decode(ids).removeprefix(" ") == "".join(event["content"] for event in events)
    assert [entry["id"] for event in events for entry in event.get("completion_probabilities", [])] == ids
    final = events[-1]
    assert final["stop"] is True
    assert final["stop_type"] == "limit"
    assert set(final["timings"]) == TIMING_KEYS
    assert all(event["stop"] is False for event in events[:-1])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x", "n_probs": -1}, "n_probs"),
        ({"prompt": "x", "n_probs": 21}, "n_probs"),
        ({"prompt": "x", "n_probs": 1.5}, "n_probs"),
        ({"prompt": "x", "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs"),
        ({"prompt": "x", "return_tokens": "yes"}, "return_tokens"),
    ],
)
async def test_completion_options_are_validated(server, body: dict[str, Any], param: str) -> None:
    _engine, base_url = server
    response = await post(base_url, "/completion", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


async def test_tokenize_and_detokenize_round_trip(server) -> None:
    engine, base_url = server
    text = "Hello world á <|im_end|>"
    plain = (await post(base_url, "/tokenize", {"content": text})).json()["tokens"]
    assert plain == engine.model.tokenizer.encode(text, add_special_tokens=False)
    assert 151645 in plain  # the special token's spelling is parsed by default
    literal = (await post(base_url, "/tokenize", {"content": text, "parse_special": False})).json()["tokens"]
    assert 151645 not in literal
    pieces = (await post(base_url, "/tokenize", {"content": text, "with_pieces": True})).json()["tokens"]
    assert [piece["id"] for piece in pieces] == plain
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == text.encode()
    assert {"id": 151645, "piece": "<|im_end|>"} in pieces
    back = (await post(base_url, "/detokenize", {"tokens": plain})).json()
    assert back == {"content": text}


async def test_tokenize_pieces_that_split_a_character_are_bytes(server) -> None:
    _engine, base_url = server
    # A rare CJK character: byte-level BPE spells it in more than one token.
    pieces = (await post(base_url, "/tokenize", {"content": "\U00020000", "with_pieces": True})).json()["tokens"]
    assert len(pieces) > 1
    assert all(isinstance(piece["piece"], list) for piece in pieces)
    assert bytes(byte for piece in pieces for byte in piece["piece"]) == "\U00020000".encode()


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/detokenize", {"tokens": [1, 2, 151646]}, "tokens[2]"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": ["a"]}, "tokens[0]"),
        ("/detokenize", {"tokens": 5}, "tokens"),
        ("/detokenize", {}, "tokens"),
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": ["a", 1]}, "content"),
        ("/tokenize", {"content": "a", "with_pieces": 1}, "with_pieces"),
        ("/tokenize", {"content": "a", "add_special": "no"}, "add_special"),
    ],
)
async def test_token_routes_validate(server, path: str, body: dict[str, Any], param: str) -> None:
    _engine, base_url = server
    response = await post(base_url, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
