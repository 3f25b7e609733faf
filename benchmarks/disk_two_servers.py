"""Two servers on one disk-tier directory under load: no errors, the budget kept, each hits what the other wrote.

Usage:
  python benchmarks/disk_two_servers.py [--model-path DIR] [--clients 16] [--seconds 300]
                                        [--disk-bytes 33554432] [--turns 4] [--json FILE]

Starts two `mlxcel serve` processes (the llama fixture by default) with the
same --prompt-cache-dir and --prompt-cache-disk-bytes. --clients workers
(half of them talk to each server first) run conversations of --turns turns
over one of four long shared system prompts, pausing --think-seconds (on
average) between turns; turn n of a conversation goes to the other server
than turn n - 1, so its history beyond the system
prompt is in the other process's memory and on disk only. Every 0.25 s a
sampler sums the sizes of the pieces in the directory (the budget check).

Prints, per server, its /v1/cache/stats disk block (hits, misses, writes,
refusals, evictions), and overall: requests, errors, turns whose
cached_tokens went past the system prompt on the server that had not seen
the history, peak directory bytes vs the budget, TTFT p50/p95.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402
    WORDS,
    start_mlxcel,
    stop_server as _stop,  # noqa: E402
    wait_healthy,
)


def start_server(model: Path, directory: Path, disk_bytes: int, log: Path, extra: list[str]
                 ) -> tuple[subprocess.Popen[bytes], str]:
    return start_mlxcel(model, ["--prompt-cache-dir", str(directory), "--prompt-cache-disk-bytes", str(disk_bytes),
                                *extra], log=log)


def stop_server(process: subprocess.Popen[bytes]) -> int:
    return _stop(process, seconds=60)[0]


class Figures:
    def __init__(self) -> None:
        self.requests = 0
        self.errors: list[str] = []
        self.ttfts: list[float] = []
        # Turns after the first: (cached_tokens, prompt_tokens, system-prompt tokens).
        self.resumed: list[tuple[int, int]] = []
        self.peak_bytes = 0
        self.samples = 0


async def chat(client: httpx.AsyncClient, messages: list[dict[str, str]], figures: Figures) -> dict[str, Any] | None:
    figures.requests += 1
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.monotonic()
    first = None
    text, usage = [], None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                figures.errors.append(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None:
                    first = time.monotonic() - started
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    figures.errors.append(str(chunk["error"])[:200])
                    return None
                for choice in chunk.get("choices", []):
                    text.append(choice.get("delta", {}).get("content") or "")
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as error:
        figures.errors.append(f"{type(error).__name__}: {error}")
        return None
    if first is not None:
        figures.ttfts.append(first)
    return {"text": "".join(text), "usage": usage}


async def client_loop(index: int, clients: list[httpx.AsyncClient], systems: list[str], turns: int,
                      deadline: float, figures: Figures, system_tokens: dict[int, int], think: float) -> None:
    rng = random.Random(index)
    conversation = 0
    while time.monotonic() < deadline:
        system_index = rng.randrange(len(systems))
        history = [{"role": "system", "content": systems[system_index]}]
        server = index % 2
        for turn in range(turns):
            if time.monotonic() >= deadline:
                return
            history.append({"role": "user", "content": f"client {index} conversation {conversation} turn {turn}: "
                            + " ".join(rng.choice(WORDS) for _ in range(60))})
            reply = await chat(clients[server], history, figures)
            if reply is None:
                break
            usage = reply["usage"] or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            if turn == 0:
                system_tokens.setdefault(system_index, usage.get("prompt_tokens", 0) - 80)
            else:
                figures.resumed.append((cached, system_tokens.get(system_index, 0)))
            history.append({"role": "assistant", "content": reply["text"]})
            server = 1 - server  # the next turn goes to the other process
            # A client reads the reply (an agent runs its tool) before the next turn.
            await trio.sleep(rng.uniform(0.5, 1.5) * think)
        conversation += 1


async def sample_directory(directory: Path, deadline: float, figures: Figures) -> None:
    while time.monotonic() < deadline + 5:
        total = 0
        for entry in os.scandir(directory):
            if entry.name.startswith("kv-"):
                try:
                    total += entry.stat().st_size
                except FileNotFoundError:
                    pass
        figures.peak_bytes = max(figures.peak_bytes, total)
        figures.samples += 1
        await trio.sleep(0.25)


async def drive(urls: list[str], args: argparse.Namespace, directory: Path) -> Figures:
    figures = Figures()
    systems = [f"System prompt {number}. " + " ".join(WORDS[(index * (number + 3)) % len(WORDS)]
                                                      for index in range(args.system_words)) for number in range(4)]
    deadline = time.monotonic() + args.seconds
    system_tokens: dict[int, int] = {}
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=urls[0], timeout=600, limits=limits) as first, \
            httpx.AsyncClient(base_url=urls[1], timeout=600, limits=limits) as second, trio.open_nursery() as nursery:
        nursery.start_soon(sample_directory, directory, deadline, figures)
        for index in range(args.clients):
            nursery.start_soon(client_loop, index, [first, second], systems, args.turns, deadline, figures,
                               system_tokens, args.think_seconds)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="model folder (default: the llama fixture)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=1200)
    parser.add_argument("--disk-bytes", type=int, default=32 << 20)
    parser.add_argument("--think-seconds", type=float, default=1.0, help="mean pause between a conversation's turns")
    parser.add_argument("--serve-flag", action="append", default=[], help="one more `mlxcel serve` flag")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from mlxcel.fixtures import fixture_path

    model = args.model_path or fixture_path("llama")
    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-two-") as scratch:
        directory = Path(scratch) / "cache"
        logs = [Path(scratch) / "a.log", Path(scratch) / "b.log"]
        servers = [start_server(model, directory, args.disk_bytes, log, args.serve_flag) for log in logs]
        try:
            for process, url in servers:
                wait_healthy(process, url)
            started = time.monotonic()
            figures = trio.run(drive, [url for _process, url in servers], args, directory)
            wall = time.monotonic() - started
            disks = [httpx.get(f"{url}/v1/cache/stats", timeout=60).json()["disk"] for _process, url in servers]
        finally:
            statuses = [stop_server(process) for process, _url in servers]
        warnings = [line for log in logs for line in log.read_text().splitlines()
                    if " WARNING " in line or " ERROR " in line]
    past_system = sum(1 for cached, system in figures.resumed if cached > system + 16)
    ttfts = sorted(figures.ttfts)
    result = {
        "model": str(model), "clients": args.clients, "seconds": round(wall, 1), "requests": figures.requests,
        "errors": len(figures.errors), "error_samples": figures.errors[:5],
        "resumed_turns": len(figures.resumed), "resumed_turns_cached_past_system_prompt": past_system,
        "disk_budget_bytes": args.disk_bytes, "peak_directory_bytes": figures.peak_bytes,
        "budget_kept": figures.peak_bytes <= args.disk_bytes, "directory_samples": figures.samples,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[int(0.95 * (len(ttfts) - 1))] if ttfts else None,
        "server_exit_statuses": statuses, "server_warnings": warnings[:10], "num_server_warnings": len(warnings),
        "disk": [{key: disk[key] for key in ("hits", "misses", "tokens_loaded", "writes", "duplicates", "evictions",
                                              "refusals_total", "vanished", "write_errors", "writes_dropped",
                                              "load_ms_per_mib", "bytes", "entries")} for disk in disks],
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
