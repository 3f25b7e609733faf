"""Hostile prompts against a demo server started from a given checkout.

Starts ``python -m mlxcel serve`` (the random-weight demo model) with
PYTHONPATH pointing at ``--checkout`` and prints, for that code:

1. the template bomb: a request-supplied ``chat_template`` of
   ``{{ "ab " * N }}`` (``--bomb-repeat``, default 3,000,000: 9 MB of text;
   the original report used 30,000,000), its status and time and the
   server's RSS before and after;
2. a normal chat request's latency alone and while a ``--big-mb`` (default 9)
   MB prompt is in flight;
3. the tokenizer-memo probe: a message too long for the context, refused
   after tokenizing; tenant A sends it, then tenant B (another cache_salt)
   times the same message against a message nobody sent;
4. an out-of-vocabulary token-id prompt (``[200000]``): status, or the exit
   code of the crashed server. Last, since it may kill the server.

    python benchmarks/hostile_prompts.py --checkout /tmp/before-router
    python benchmarks/hostile_prompts.py --checkout . --allow-request-chat-template
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_server(checkout: Path, port: int, extra: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout.resolve())}
    process = subprocess.Popen(
        [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), "--log-level", "warning", *extra],
        cwd=checkout, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise SystemExit("the server did not start")


def timed(client: httpx.Client, path: str, body: dict) -> tuple[int, float]:
    started = time.perf_counter()
    status = client.post(path, json=body).status_code
    return status, time.perf_counter() - started


def words(count: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(f"w{rng.randrange(10**6)}x" for _ in range(count))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, required=True)
    parser.add_argument("--allow-request-chat-template", action="store_true",
                        help="start the server with that flag (the fixed code only)")
    parser.add_argument("--bomb-repeat", type=int, default=3_000_000)
    parser.add_argument("--big-mb", type=float, default=9.0)
    args = parser.parse_args()
    port = free_port()
    extra = ["--allow-request-chat-template"] if args.allow_request_chat_template else []
    server = start_server(args.checkout, port, extra)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
    try:
        timed(client, "/v1/chat/completions", NORMAL)  # warm
        # 1. the template bomb
        before = rss_mib(server.pid)
        bomb = {**NORMAL, "chat_template_kwargs": {"chat_template": f'{{{{ "ab " * {args.bomb_repeat} }}}}'}}
        status, seconds = timed(client, "/v1/chat/completions", bomb)
        print(f"template bomb x{args.bomb_repeat:,}: status {status} in {seconds:.2f} s; "
              f"server RSS {before:.0f} -> {rss_mib(server.pid):.0f} MiB")

        # 2. a normal request alone, and while a big prompt is in flight
        alone = statistics.median(timed(client, "/v1/chat/completions", NORMAL)[1] for _ in range(5))
        big_text = "lorem ipsum " * int(args.big_mb * 1e6 / 12)
        big_result: list[tuple[int, float]] = []
        big = threading.Thread(target=lambda: big_result.append(timed(
            httpx.Client(base_url=client.base_url, timeout=600), "/v1/chat/completions",
            {**NORMAL, "messages": [{"role": "user", "content": big_text}]})))
        big.start()
        time.sleep(0.5)  # the body is uploaded and parsed
        during = timed(client, "/v1/chat/completions", NORMAL)[1]
        big.join()
        print(f"normal request: {alone:.3f} s alone, {during:.3f} s with a {args.big_mb:g} MB prompt in flight "
              f"(that prompt: status {big_result[0][0]} in {big_result[0][1]:.2f} s)")

        # 3. the memo probe: ~5x the context in tokens, under the character bound
        seen_times, fresh_times, status = [], [], 0
        for index in range(5):
            seen = words(12_000, seed=index)
            timed(client, "/v1/chat/completions", {**NORMAL, "cache_salt": "tenant-a",
                                                   "messages": [{"role": "user", "content": seen}]})
            for text, times in ((seen, seen_times), (words(12_000, seed=100 + index), fresh_times)):
                status, seconds = timed(client, "/v1/chat/completions", {
                    **NORMAL, "cache_salt": "tenant-b", "messages": [{"role": "user", "content": text}]})
                times.append(seconds)
        print(f"memo probe across salts (status {status}): tenant A's message "
              f"{statistics.median(seen_times) * 1e3:.1f} ms vs an unseen one "
              f"{statistics.median(fresh_times) * 1e3:.1f} ms (medians of 5)")

        # 4. an out-of-vocabulary token id
        try:
            status, _ = timed(client, "/v1/completions", {"prompt": [200000], "max_tokens": 1})
            outcome = f"status {status}"
        except httpx.HTTPError as error:
            outcome = f"no response ({type(error).__name__})"
        time.sleep(1)
        code = server.poll()
        alive = "server alive" if code is None else f"server exited with {code}"
        print(f"OOV prompt [200000]: {outcome}; {alive}")
        if code is None:
            print(f"  after it, a normal request: status {timed(client, '/v1/chat/completions', NORMAL)[0]}")
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(30)
    print(json.dumps({"checkout": str(args.checkout)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
