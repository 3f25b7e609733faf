"""The streaming client and the launcher against real servers on loopback."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import trio

from mlxcel.bench.client import ConversationRunner
from mlxcel.bench.launcher import ServerSpec, process_tree_rss, start_server
from mlxcel.bench.workload import Shape, build_workload
from mlxcel.fixtures import fixture_path

pytestmark = pytest.mark.slow

# A stand-in server: answers 200 on every GET, exits on SIGINT.
TINY_SERVER = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(b'{}')\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n"
)


async def test_two_conversations_two_turns_against_mlxcel(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine)
    shape = Shape(conversations=2, turns=2, system_tokens=120, user_tokens=12, reply_tokens=4, seed=1)
    workload = build_workload(shape, model_path=fixture_path("llama"))

    def run() -> list:
        with ConversationRunner(workload, server="mlxcel", base_url=base_url, progress=None,
                                request_timeout_s=60) as runner:
            assert runner.model == "llama-v1-seed0"
            runner.run_all(concurrency=1)
            runner.run_unseen(0)
            runner.run_unseen(1)
            return runner.records

    records = await trio.to_thread.run_sync(run)
    records, probes = records[:4], records[4:]
    assert [(r.conversation, r.turn) for r in records] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    assert [(r.conversation, r.turn, r.unseen) for r in probes] == [(0, 0, True), (1, 0, True)]
    for r in probes:
        assert r.error is None
        assert r.reply
        assert r.completion_tokens
        # Only the template's first few tokens are shared with earlier prompts:
        # less than one 16-token prefix-cache block, so nothing is reused.
        assert r.cached_tokens is not None
        assert r.cached_tokens < 16
    # Probe 1's user turn is 8 single-token words longer.
    assert probes[1].prompt_tokens == probes[0].prompt_tokens + 8
    for r in records:
        assert r.error is None
        assert r.prompt_tokens
        assert r.prompt_tokens > 120
        assert r.cached_tokens is not None
        assert r.completion_tokens is not None
        assert r.completion_tokens >= 1
        assert r.e2e_s > 0
        assert (r.ttft_s is None or r.ttft_s <= r.e2e_s)
    assert all(r.cached_tokens > 0 for r in records if r.turn == 1)
    # Turn 1 resends turn 0 with the reply actually received.
    assert records[2].prompt_tokens > records[0].prompt_tokens


async def test_all_at_once_sends_every_conversation(start_engine, start_server) -> None:
    engine = await start_engine()
    base_url = await start_server(engine)
    workload = build_workload(Shape(conversations=3, turns=1, system_tokens=40, user_tokens=5, reply_tokens=2))

    def run() -> list:
        with ConversationRunner(workload, server="mlxcel", base_url=base_url, progress=None,
                                request_timeout_s=60) as runner:
            return runner.run_turn(0, concurrency=None)

    records = await trio.to_thread.run_sync(run)
    assert [r.conversation for r in records] == [0, 1, 2]
    assert all(r.error is None and r.completion_tokens for r in records)


def test_launcher_starts_samples_and_stops(tmp_path: Path) -> None:
    spec = ServerSpec(name="tiny", argv=(sys.executable, "-c", TINY_SERVER, "{port}"))
    server = start_server(spec, "unused", tmp_path, ready_timeout_s=20)
    try:
        assert server.process.poll() is None
        assert process_tree_rss(server.pid) > 0
    finally:
        status = server.stop(grace_s=5)
    assert server.process.poll() is not None
    assert status is not None
    assert server.sampler.peak_bytes > 0
    assert (tmp_path / "server-tiny.log").read_text().startswith("$ ")
    assert process_tree_rss(os.getpid()) > 0
