"""Full-size load test: many concurrent streaming multi-turn clients against one server.

Usage:
  python benchmarks/load_test.py [--model-path DIR] [--prompt-cache-capacity-bytes N]
                                 [--clients 64] [--sessions 128] [--turns 4] [--max-seconds 300]
                                 [--max-queued-requests N] [--max-batch-size N] [--serve-flag=--FLAG=VALUE ...]
  python benchmarks/load_test.py --url http://127.0.0.1:8080 [...]   # a server already running

Without --url it starts `mlxcel serve` on a free loopback port (the llama
fixture by default) with the given flags, and stops it with SIGTERM at the
end. --clients workers take conversations from a shared list of --sessions
conversations of --turns turns each (the whole history is resent every turn;
sessions share one of --system-prompts system prompts, so there is both
cross-session and in-session reuse). A 503 is retried after Retry-After
(capped at 1 s) up to --retries times; a turn refused every time is
abandoned and the conversation goes on.

Bounded: at most sessions x turns x (retries + 1) requests, and the run stops
at --max-seconds whatever is left. Every 0.5 s a sampler reads
/v1/cache/stats and, when the server is a local child, its VmRSS from /proc.

Prints: requests, completions, refusals (503), errors, abandoned turns, peak
cache bytes vs capacity, peak snapshot bytes vs capacity, peak RSS, TTFT p50
and p95, and the wall time. --json writes the same as JSON.

Loopback only: --url must point at 127.0.0.1, ::1 or localhost.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402
    WORDS,
    start_mlxcel,
    stop_server as _stop,  # noqa: E402
    wait_healthy,
)

LOOPBACK = {"127.0.0.1", "::1", "localhost"}


@dataclass
class Figures:
    requests: int = 0
    completions: int = 0
    refusals: int = 0
    errors: int = 0
    abandoned_turns: int = 0
    unfinished_turns: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prompt_tokens: int = 0
    capacity_bytes: int = 0
    peak_cache_bytes: int = 0
    peak_cache_entries: int = 0
    budget_violations: int = 0
    snapshot_capacity_bytes: int | None = None
    peak_snapshot_bytes: int | None = None
    peak_rss_bytes: int | None = None
    samples: int = 0
    wall_seconds: float = 0.0
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    error_examples: list[str] = field(default_factory=list)
    final_scheduler: dict[str, Any] = field(default_factory=dict)
    ttfts: list[float] = field(default_factory=list, repr=False)


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


# --- the server ------------------------------------------------------------------


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    from mlxcel.fixtures import fixture_path

    flags = ["--max-queued-requests", str(args.max_queued_requests), "--max-batch-size", str(args.max_batch_size)]
    if args.prompt_cache_capacity_bytes:
        flags += ["--prompt-cache-capacity-bytes", str(args.prompt_cache_capacity_bytes)]
    flags += args.serve_flag
    process, base_url = start_mlxcel(args.model_path or fixture_path("llama"), flags,
                                     log=Path(args.server_log) if args.server_log else None, log_level="warning")
    wait_healthy(process, base_url, seconds=120)
    return process, base_url


def stop_server(process: subprocess.Popen[bytes]) -> int:
    return _stop(process, seconds=60)[0]


# --- the clients ---------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, body: dict[str, Any], figures: Figures) -> tuple[str, Any]:
    """('ok', reply text) | ('busy', retry_after) | ('error', message)."""
    figures.requests += 1
    started = time.monotonic()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code == 503:
                await response.aread()
                figures.refusals += 1
                return "busy", float(response.headers.get("Retry-After", "1"))
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return "error", f"HTTP {response.status_code}: {text}"
            events: list[str] = []
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    if not events:
                        figures.ttfts.append(time.monotonic() - started)
                    events.append(line[len("data: "):])
    except httpx.HTTPError as error:
        return "error", f"{type(error).__name__}: {error}"
    if not events or events[-1] != "[DONE]":
        return "error", "the stream ended without [DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    if any("error" in chunk for chunk in chunks):
        return "error", f"error event: {next(c for c in chunks if 'error' in c)['error']}"
    finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    if len(finishes) != 1:
        return "error", f"finish reasons {finishes}"
    usage = chunks[-1].get("usage") or {}
    figures.completion_tokens += usage.get("completion_tokens", 0)
    figures.prompt_tokens += usage.get("prompt_tokens", 0)
    figures.cached_tokens += usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    figures.completions += 1
    return "ok", "".join(c["delta"].get("content", "") for chunk in chunks for c in chunk["choices"])


async def run_session(client: httpx.AsyncClient, index: int, args: argparse.Namespace,
                      systems: list[str], figures: Figures) -> None:
    rng = random.Random(args.seed * 1000 + index)
    messages = [{"role": "system", "content": systems[index % len(systems)]}]
    for turn in range(args.turns):
        messages.append({"role": "user", "content": f"session {index} turn {turn}: {words(rng, args.user_words)}"})
        body = {"messages": messages, "max_tokens": args.reply_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "user": f"session-{index}"}
        for attempt in range(args.retries + 1):
            outcome, value = await one_request(client, body, figures)
            if outcome == "ok":
                messages.append({"role": "assistant", "content": value})
                break
            if outcome == "error":
                figures.errors += 1
                if len(figures.error_examples) < 5:
                    figures.error_examples.append(value)
                return  # a broken conversation stops
            if attempt == args.retries:
                figures.abandoned_turns += 1
                messages.append({"role": "assistant", "content": "(refused)"})
                break
            await trio.sleep(min(value, 1.0) * rng.uniform(0.5, 1.0))


async def sampler(client: httpx.AsyncClient, pid: int | None, figures: Figures, done: trio.Event) -> None:
    while not done.is_set():
        try:
            stats = (await client.get("/v1/cache/stats", timeout=10)).json()
        except httpx.HTTPError:
            stats = None
        if stats and stats.get("enabled", True):
            figures.samples += 1
            figures.capacity_bytes = stats.get("capacity_bytes", 0)
            figures.peak_cache_bytes = max(figures.peak_cache_bytes, stats.get("bytes", 0))
            figures.peak_cache_entries = max(figures.peak_cache_entries, stats.get("entries", 0))
            if stats.get("bytes", 0) > stats.get("capacity_bytes", 0):
                figures.budget_violations += 1
            snapshots = stats.get("snapshots")
            if snapshots:
                figures.snapshot_capacity_bytes = snapshots.get("capacity_bytes")
                figures.peak_snapshot_bytes = max(figures.peak_snapshot_bytes or 0, snapshots.get("bytes", 0))
                if snapshots.get("bytes", 0) > snapshots.get("capacity_bytes", 0):
                    figures.budget_violations += 1
        if pid is not None:
            rss = rss_bytes(pid)
            if rss is not None:
                figures.peak_rss_bytes = max(figures.peak_rss_bytes or 0, rss)
        with trio.move_on_after(0.5):
            await done.wait()


async def run_load(args: argparse.Namespace, base_url: str, pid: int | None) -> Figures:
    figures = Figures()
    rng = random.Random(args.seed)
    systems = [f"You are assistant {i}. " + words(rng, args.system_words) for i in range(args.system_prompts)]
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    pending = list(range(args.sessions))
    started = time.monotonic()
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        done = trio.Event()

        async def worker() -> None:
            while pending:
                await run_session(client, pending.pop(0), args, systems, figures)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler, client, pid, figures, done)
            with trio.move_on_after(args.max_seconds) as scope:
                async with trio.open_nursery() as workers:
                    for _ in range(args.clients):
                        workers.start_soon(worker)
            if scope.cancelled_caught:
                figures.unfinished_turns = len(pending) * args.turns
                print(f"stopped at --max-seconds {args.max_seconds}", file=sys.stderr)
            done.set()
        figures.wall_seconds = time.monotonic() - started
        try:
            final = (await client.get("/v1/cache/stats", timeout=10)).json()
            figures.final_scheduler = final.get("scheduler", {})
        except httpx.HTTPError:
            pass
    figures.ttft_p50_ms = None if not figures.ttfts else 1000 * percentile(figures.ttfts, 0.50)
    figures.ttft_p95_ms = None if not figures.ttfts else 1000 * percentile(figures.ttfts, 0.95)
    return figures


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / (1 << 20):.1f} MiB"


def report(figures: Figures) -> str:
    capacity = figures.capacity_bytes or 0
    share = f" ({100 * figures.peak_cache_bytes / capacity:.0f}% of budget)" if capacity else ""
    lines = [
        f"requests            {figures.requests}",
        f"completions         {figures.completions}",
        f"refusals (503)      {figures.refusals}",
        f"errors              {figures.errors}",
        f"abandoned turns     {figures.abandoned_turns}",
        f"unfinished turns    {figures.unfinished_turns}",
        f"peak cache bytes    {figures.peak_cache_bytes} / capacity {capacity}{share}",
        f"peak cache entries  {figures.peak_cache_entries}",
        f"peak snapshot bytes {figures.peak_snapshot_bytes if figures.peak_snapshot_bytes is not None else '-'}"
        f" / capacity {figures.snapshot_capacity_bytes if figures.snapshot_capacity_bytes is not None else '-'}",
        f"budget violations   {figures.budget_violations} (over {figures.samples} samples)",
        f"peak RSS            {mib(figures.peak_rss_bytes)}",
        f"TTFT p50 / p95      {figures.ttft_p50_ms or 0:.0f} ms / {figures.ttft_p95_ms or 0:.0f} ms",
        f"prompt tokens       {figures.prompt_tokens} ({figures.cached_tokens} from the cache)",
        f"completion tokens   {figures.completion_tokens}",
        f"wall time           {figures.wall_seconds:.1f} s",
        f"scheduler at end    {figures.final_scheduler}",
    ]
    lines += [f"error example       {example}" for example in figures.error_examples]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server on loopback (default: start one)")
    parser.add_argument("--model-path", type=Path, help="model folder (default: the llama fixture)")
    parser.add_argument("--prompt-cache-capacity-bytes", type=int, default=8 << 20)
    parser.add_argument("--max-queued-requests", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--serve-flag", action="append", default=[],
                        help="one more `mlxcel serve` flag (repeatable), e.g. --serve-flag=--ctx-size=4096")
    parser.add_argument("--server-log", type=Path, help="write the server's output here")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-words", type=int, default=200)
    parser.add_argument("--user-words", type=int, default=30)
    parser.add_argument("--reply-tokens", type=int, default=16)
    parser.add_argument("--retries", type=int, default=5)
    parser.add_argument("--request-timeout", type=float, default=120)
    parser.add_argument("--max-seconds", type=float, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    if args.url and urlsplit(args.url).hostname not in LOOPBACK:
        parser.error("--url must be a loopback address")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    process = None
    base_url = args.url
    if base_url is None:
        process, base_url = start_server(args)
    try:
        figures = trio.run(run_load, args, base_url, process.pid if process else None)
    finally:
        exit_status = stop_server(process) if process else None
    print(report(figures))
    if exit_status is not None:
        print(f"server exit status  {exit_status}")
    if args.json:
        payload = {k: v for k, v in asdict(figures).items() if k != "ttfts"}
        payload["server_exit_status"] = exit_status
        args.json.write_text(json.dumps(payload, indent=2))
    return 0 if figures.errors == 0 and figures.budget_violations == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
