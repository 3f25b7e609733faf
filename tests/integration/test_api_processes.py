"""The HTTP edge in processes of its own (`mlxcel serve --api-processes N`), through the real CLI, the real
HTTP server and the official SDK: the same replies as one process, the shared stores, cancellation, and the
processes' ends."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.support import mlxcel_serve

pytestmark = pytest.mark.slow

MODEL = "llama-v1-seed0"
# Long enough for the prompt cache to keep.
MESSAGES = [{"role": "system", "content": " ".join(f"rule {index}: be brief." for index in range(120))},
            {"role": "user", "content": "Name three colours."}]


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from /proc: each one's parent)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def greedy_stream(base_url: str) -> tuple[str, list[tuple[str, float, tuple[str, ...]]], dict[str, int]]:
    """A streamed greedy reply with logprobs: its text, (token, logprob, top tokens) per token, and usage."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    text, tokens, usage = [], [], {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True, logprobs=True, top_logprobs=2,
        stream_options={"include_usage": True},
    ):
        if chunk.usage is not None:
            usage = {"prompt": chunk.usage.prompt_tokens, "completion": chunk.usage.completion_tokens}
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            for entry in (choice.logprobs.content or []) if choice.logprobs else []:
                tokens.append((entry.token, entry.logprob, tuple(top.token for top in entry.top_logprobs)))
    return "".join(text), tokens, usage


def same_greedy_reply(reply: tuple[str, list[tuple[str, float, tuple[str, ...]]], dict[str, int]],
                      expected: tuple[str, list[tuple[str, float, tuple[str, ...]]], dict[str, int]]) -> None:
    text, tokens, usage = reply
    assert (text, usage) == (expected[0], expected[2])
    assert [(token, top) for token, _, top in tokens] == [(token, top) for token, _, top in expected[1]]
    assert all(abs(a[1] - b[1]) < 1e-4 for a, b in zip(tokens, expected[1], strict=True))


def stopped_reply(base_url: str, stop: str) -> tuple[str, str | None, int, list[str]]:
    """A streamed greedy reply that ``stop`` ends: its text, finish reason, completion tokens, logprob tokens."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
    text, finish, completion, tokens = [], None, -1, []
    for chunk in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3000, temperature=0, stream=True, stop=[stop], logprobs=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ):
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
            if choice.logprobs is not None:
                tokens.extend(entry.token for entry in choice.logprobs.content or [])
    return "".join(text), finish, completion, tokens


def requests_by_reason(base_url: str) -> dict[str, float]:
    counts = {}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("mlxcel_requests_total{"):
            counts[line.split('"')[1]] = float(line.split()[-1])
    return counts


def test_two_api_processes_answer_as_one_process_does() -> None:
    with mlxcel_serve() as (_process, one_url):
        expected = greedy_stream(one_url)
        # A stop string from the middle of the greedy reply.
        stop = expected[0][len(expected[0]) // 2:][:2]
        expected_stopped = stopped_reply(one_url, stop)
        assert expected_stopped[1] == "stop"
        expected_bytes = httpx.get(f"{one_url}/v1/cache/stats", timeout=10).json()["bytes"]
    with mlxcel_serve("--api-processes", "2", "--metrics") as (process, base_url):
        assert len(children(process.pid)) == 2
        # The API process processes the output: the stop string ends the reply where one process ends it, with
        # the same counts, and its metrics count the reply as the API process saw it end.
        same_greedy_reply(greedy_stream(base_url), expected)
        assert stopped_reply(base_url, stop) == expected_stopped
        deadline = time.monotonic() + 20
        while running(base_url) != 0 or requests_by_reason(base_url) != {"length": 1.0, "stop": 1.0}:
            assert time.monotonic() < deadline, (running(base_url), requests_by_reason(base_url))
            time.sleep(0.1)
        # The engine dropped the sequence a step or so after the stop string (not at max_tokens): the store holds
        # about what one process's does.
        stored = httpx.get(f"{base_url}/v1/cache/stats", timeout=10).json()["bytes"]
        assert stored <= expected_bytes * 1.1

        for _ in range(4):  # new connections: whichever process the kernel hands each to
            same_greedy_reply(greedy_stream(base_url), expected)

        # The prompt cache is the engine's: the repeated prompt was a hit.
        stats = httpx.get(f"{base_url}/v1/cache/stats", timeout=10).json()
        assert stats["hits"] >= 3

        # The routes' own refusals, in the route's shape, from the API process.
        refused = httpx.post(f"{base_url}/v1/chat/completions", timeout=10,
                             json={"model": MODEL, "messages": MESSAGES, "bogus": 1})
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == "bogus"
        # The engine's refusals cross the link with their status and shape.
        too_long = httpx.post(f"{base_url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "word " * 5000}]})
        assert too_long.status_code == 400
        assert too_long.json()["error"]["code"] == "context_length_exceeded"

        # Many streams at once, over both processes: each whole, in order, and counted.
        def one_stream(index: int) -> tuple[int, str | None, int]:
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused")
            chunks, finish, completion = 0, None, -1
            for chunk in client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": f"Count to {index}."}], max_tokens=20,
                stream=True, extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
            ):
                for choice in chunk.choices:
                    chunks += bool(choice.delta.content)
                    finish = choice.finish_reason or finish
                if chunk.usage is not None:
                    completion = chunk.usage.completion_tokens
            return chunks, finish, completion

        with ThreadPoolExecutor(24) as pool:
            outcomes = list(pool.map(one_stream, range(24)))
        assert all(finish == "length" and completion == 20 and chunks > 0 for chunks, finish, completion in outcomes)

        # The tokenizer crossed too (llama.cpp's route tokenizes in the API process).
        tokens = httpx.post(f"{base_url}/tokenize", json={"content": "hello world"}, timeout=10).json()["tokens"]
        assert tokens == [14990, 1879]


def test_a_stored_response_is_found_by_every_api_process() -> None:
    with mlxcel_serve("--api-processes", "2") as (_process, base_url):
        created = httpx.post(f"{base_url}/v1/responses", timeout=30, json={
            "model": MODEL, "input": "Hello", "max_output_tokens": 4}).json()
        for _ in range(8):  # each on a new connection
            follow_up = httpx.post(f"{base_url}/v1/responses", timeout=30, json={
                "model": MODEL, "input": "More", "max_output_tokens": 4, "previous_response_id": created["id"],
                "store": False})
            assert follow_up.status_code == 200, follow_up.text
            assert httpx.get(f"{base_url}/v1/responses/{created['id']}", timeout=10).status_code == 200
        assert httpx.delete(f"{base_url}/v1/responses/{created['id']}", timeout=10).status_code == 200
        assert httpx.get(f"{base_url}/v1/responses/{created['id']}", timeout=10).status_code == 404


def running(base_url: str) -> float:
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.split()[-1])
    raise AssertionError("no vllm:num_requests_running")


def test_a_client_that_leaves_mid_stream_frees_its_sequence() -> None:
    with mlxcel_serve("--api-processes", "1", "--metrics") as (_process, base_url):
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 3000, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            received = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in received)
            assert running(base_url) == 1
        deadline = time.monotonic() + 20
        while running(base_url) != 0:
            assert time.monotonic() < deadline, "the abandoned request still runs"
            time.sleep(0.1)


def test_sigterm_stops_the_api_processes_then_the_engine() -> None:
    with mlxcel_serve("--api-processes", "2", "--shutdown-grace-seconds", "5") as (process, _base_url):
        api = children(process.pid)
        assert len(api) == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert not any(alive(pid) for pid in api)


def test_api_processes_exit_when_the_engines_process_is_killed() -> None:
    with mlxcel_serve("--api-processes", "2") as (process, _base_url):
        api = children(process.pid)
        assert len(api) == 2
        process.kill()
        process.wait(timeout=10)
        deadline = time.monotonic() + 20
        while any(alive(pid) for pid in api):
            assert time.monotonic() < deadline, "an API process outlived the engine's"
            time.sleep(0.1)


def test_a_crashed_api_process_takes_the_server_down() -> None:
    with mlxcel_serve("--api-processes", "2") as (process, _base_url):
        api = children(process.pid)
        os.kill(api[0], signal.SIGKILL)
        try:
            status = process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server kept running with one of its API processes gone")
        assert status == 1  # for a supervisor to restart it
        assert not alive(api[1])
