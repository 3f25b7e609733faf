"""Decode speed: MLX's own decode step in one process, and servers streaming over HTTP beside it (issue 28).

One run measures, on one model folder (the llama-bench fixture by default):

  floor          in one process: mlx_lm.load, a plain mlx-lm KV cache per layer (make_prompt_cache), B equal
                 rows after a --floor-prompt-tokens prompt, greedy argmax, the next step's graph built and
                 handed over (mx.async_eval) before the previous step's tokens are read, as mlx_lm.generate
                 does; --floor-steps timed steps after --floor-warmup: ms per step and tokens/s at each B
  streams        N concurrent streaming chats of --reply-tokens tokens (short prompts of their own): the
                 per-token interval (median gap between consecutive content chunks of one stream, pooled
                 over all streams) and aggregate tokens/s (all completion tokens over the round's wall time;
                 also over the window in which every stream was decoding)
  wave           --wave short requests sent at once: TTFT median and p99 (--wave-rounds waves: their medians)
  conversations  --conversations chats sharing one --system-tokens system prompt, --turns turns each, every
                 turn of every conversation sent at once, the history (with the replies given) resent:
                 TTFT median per turn (turn 0 cold, later turns warm)

and prints every server figure beside the floor's, as a ratio, in one table (--out writes it all as JSON).
Every stream must be served: failures (HTTP errors, error events, no [DONE]) and short replies (fewer than
max_tokens tokens or a finish other than "length") are counted and listed per server.

usage:
  PYTHONPATH=. python3 -m benchmarks.decode_speed --model-path DIR [--peer mlx_lm] [--out FILE.json]
  python benchmarks/decode_speed.py --streams 1,4 --reply-tokens 64 --wave 8 --conversations 4 \
      --system-tokens 1000 --out /tmp/decode.json                  # the CPU fixture, scaled down

The servers run one after another (mlxcel first), each on a free loopback port, each given room for the
largest group of concurrent requests (mlxcel --max-batch-size, mlx_lm.server --decode-concurrency).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import REPO, WORDS, start_mlxcel, stop_server, wait_healthy  # noqa: E402

FLOOR_TIMEOUT_S = 900.0
# How far ahead of "now" a round's requests are scheduled, so every client process sends at once.
START_LEAD_S = 0.3
FLOOR_SEED = 0


# --- statistics (pure) ---------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be within [0, 1], got {fraction}")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def stream_gaps(token_times: Sequence[float]) -> list[float]:
    """The gaps between one stream's consecutive tokens."""
    return [later - earlier for earlier, later in zip(token_times, token_times[1:], strict=False)]


def largest_gaps(streams: Sequence[Sequence[float]], opened: float, count: int = 5) -> list[dict[str, float]]:
    """The ``count`` largest gaps between a stream's tokens: each with its length, the token it delayed (1 is a
    stream's second token) and when that token came, in seconds after ``opened`` (the round's first send)."""
    gaps = [(later - earlier, index + 1, later - opened)
            for times in streams for index, (earlier, later) in enumerate(zip(times, times[1:], strict=False))]
    return [{"gap_s": gap, "token": token, "at_s": at} for gap, token, at in sorted(gaps, reverse=True)[:count]]


def median_gap(streams: Sequence[Sequence[float]]) -> float | None:
    """The per-token interval: the median of every stream's consecutive gaps, pooled over all streams."""
    return median([gap for times in streams for gap in stream_gaps(times)])


def all_active_rate(streams: Sequence[Sequence[float]]) -> float | None:
    """Tokens per second in the window where every stream had its first token and none its last.

    The server's steady decode rate at that concurrency, without the admission at the start and the
    stragglers at the end; None when the window is empty.
    """
    streams = [times for times in streams if times]
    if not streams:
        return None
    start, end = max(times[0] for times in streams), min(times[-1] for times in streams)
    if end <= start:
        return None
    inside = sum(1 for times in streams for moment in times if start < moment <= end)
    return inside / (end - start)


def ratio(value: float | None, floor: float | None) -> float | None:
    """value / floor; None when either is missing or the floor is zero."""
    if value is None or floor is None or floor == 0:
        return None
    return value / floor


# --- one streaming request -----------------------------------------------------------------------------------


@dataclass
class StreamResult:
    """One streamed chat request; times are time.monotonic() (one clock for every process of this host)."""

    sent: float
    end: float
    token_times: list[float] = field(default_factory=list)
    text: str = ""
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent if self.token_times else None

    @property
    def served(self) -> bool:
        return self.error is None and self.done and self.finish_reason is not None

    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.token_times)

    def problem(self, expected_tokens: int | None) -> str | None:
        """Why this stream does not count as fully served (None when it does)."""
        if not self.served:
            return self.error or ("no [DONE]" if not self.done else "no finish_reason")
        if expected_tokens is not None and (self.tokens() < expected_tokens or self.finish_reason != "length"):
            return f"short: {self.tokens()}/{expected_tokens} tokens, finish {self.finish_reason}"
        return None


def parse_stream(sent: float, end: float, chunks: Sequence[tuple[float, bytes]], error: str | None) -> StreamResult:
    """A server-sent event stream read as (arrival time, bytes) chunks; an event is timed by its last chunk."""
    result = StreamResult(sent=sent, end=end, error=error)
    buffer = b""
    texts: list[str] = []
    for moment, data in chunks:
        buffer += data.replace(b"\r\n", b"\n")
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    result.done = True
                    continue
                if not payload:
                    continue
                try:
                    body = json.loads(payload)
                except ValueError:
                    result.error = result.error or f"bad event: {payload[:80]!r}"
                    continue
                _take_event(result, body, moment, texts)
    result.text = "".join(texts)
    return result


def _take_event(result: StreamResult, body: dict[str, Any], moment: float, texts: list[str]) -> None:
    if "error" in body:
        result.error = result.error or f"error event: {str(body['error'])[:160]}"
    usage = body.get("usage")
    if usage:
        result.completion_tokens = usage.get("completion_tokens")
        result.prompt_tokens = usage.get("prompt_tokens")
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.cached_tokens = cached if isinstance(cached, int) else None
    for choice in body.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            result.token_times.append(moment)
            texts.append(content)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


async def _one_stream(client: httpx.AsyncClient, body: dict[str, Any], start_at: float,
                      stop_at: float) -> StreamResult:
    # Trio's clock has an offset of its own: wait by time.monotonic(), the clock every process shares.
    await trio.sleep(max(0.0, start_at - time.monotonic()))
    chunks: list[tuple[float, bytes]] = []
    error = None
    sent = time.monotonic()
    with trio.move_on_after(max(0.0, stop_at - sent)) as scope:
        error = await _read_stream(client, body, chunks)
    if scope.cancelled_caught:
        error = f"cut at the run's deadline after {time.monotonic() - sent:.0f} s"
    return parse_stream(sent, time.monotonic(), chunks, error)


async def _read_stream(client: httpx.AsyncClient, body: dict[str, Any],
                       chunks: list[tuple[float, bytes]]) -> str | None:
    """Appends (arrival time, bytes) to ``chunks``; the error, if the request failed."""
    error = None
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {text[:160]}"
            else:
                # Only the arrival is recorded while the stream runs; parsing waits for its end.
                async for data in response.aiter_bytes():
                    chunks.append((time.monotonic(), data))
    except httpx.HTTPError as exception:
        error = f"{type(exception).__name__}: {exception}"[:200]
    return error


async def _streams_async(base_url: str, bodies: list[dict[str, Any]], start_at: float, stop_at: float,
                         timeout_s: float) -> list[StreamResult]:
    results: list[StreamResult | None] = [None] * len(bodies)
    limits = httpx.Limits(max_connections=len(bodies) + 4, max_keepalive_connections=len(bodies) + 4)
    timeout = httpx.Timeout(timeout_s, connect=60.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:

        async def one(index: int) -> None:
            results[index] = await _one_stream(client, bodies[index], start_at, stop_at)

        async with trio.open_nursery() as nursery:
            for index in range(len(bodies)):
                nursery.start_soon(one, index)
    return [result for result in results if result is not None]


def stream_worker(base_url: str, bodies: list[dict[str, Any]], start_at: float, stop_at: float,
                  timeout_s: float) -> tuple[list[dict[str, Any]], float]:
    """One client process's share of a round: its results and its CPU use (a fraction of one core)."""
    cpu, wall = time.process_time(), time.monotonic()
    results = trio.run(_streams_async, base_url, bodies, start_at, stop_at, timeout_s)
    busy = (time.process_time() - cpu) / max(time.monotonic() - wall, 1e-9)
    return [asdict(result) for result in results], busy


def _ready(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


class StreamClient:
    """Sends a round of streaming requests at once, from --client-processes processes.

    A Python client reading thousands of events a second falls behind and then reads them in bursts,
    which would shrink the measured gaps; spreading the streams over processes keeps each one idle
    enough (each reports its CPU use, printed when it passes half a core).
    """

    def __init__(self, base_url: str, *, processes: int, timeout_s: float, stop_at: float) -> None:
        self.base_url = base_url
        self.processes = processes
        # httpx's timeout bounds each wait for bytes; stop_at (time.monotonic()) bounds every stream.
        self.timeout_s = timeout_s
        self.stop_at = stop_at
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        if processes > 1:
            self.pool = concurrent.futures.ProcessPoolExecutor(processes,
                                                               mp_context=multiprocessing.get_context("spawn"))
            # Start every worker now (they start on demand), not inside a timed round.
            list(self.pool.map(_ready, [0.5] * processes))

    def close(self) -> None:
        if self.pool is not None:
            # Not waiting: after an interruption, a worker may still be reading a stream.
            self.pool.shutdown(wait=False, cancel_futures=True)

    def round(self, bodies: list[dict[str, Any]]) -> tuple[list[StreamResult], float]:
        """Every body sent at once; the results in body order and the busiest client process's CPU share."""
        start_at = time.monotonic() + START_LEAD_S
        if self.pool is None:
            payloads, busy = stream_worker(self.base_url, bodies, start_at, self.stop_at, self.timeout_s)
            return [StreamResult(**payload) for payload in payloads], busy
        shares = [bodies[index::self.processes] for index in range(self.processes)]
        futures = [self.pool.submit(stream_worker, self.base_url, share, start_at, self.stop_at, self.timeout_s)
                   for share in shares if share]
        done = [future.result() for future in futures]
        results: list[StreamResult | None] = [None] * len(bodies)
        for offset, (payloads, _busy) in enumerate(done):
            for position, payload in enumerate(payloads):
                results[offset + position * self.processes] = StreamResult(**payload)
        return [result for result in results if result is not None], max(busy for _, busy in done)


# --- the in-process floor ------------------------------------------------------------------------------------


def decode_floor(model_path: str, batches: Sequence[int], *, prompt_tokens: int, warmup: int,
                 steps: int) -> dict[str, Any]:
    """MLX's own batched decode of the model, pipelined as mlx_lm.generate; run in its own process."""
    from importlib.metadata import version

    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.blas import describe_blas

    model = load(model_path)[0]
    vocabulary = int(model.args.vocab_size) if hasattr(model, "args") else 32000
    rng = random.Random(FLOOR_SEED)
    prompt = [rng.randrange(1000, min(vocabulary, 100_000)) for _ in range(prompt_tokens)]
    rows = []
    for batch in batches:
        cache = make_prompt_cache(model)

        def step(tokens: Any, cache: Any = cache) -> Any:
            # Every op of the step on one stream, the row-to-column reshape too, as mlx_lm.generate.
            with mx.stream(generation_stream):
                logits = model(tokens if tokens.ndim == 2 else tokens[:, None], cache=cache)
                return mx.argmax(logits[:, -1, :], axis=-1)

        y = step(mx.array([prompt] * batch))
        mx.async_eval(y)
        moments = []
        for index in range(warmup + steps):
            if index == warmup:
                start = time.perf_counter()
            next_y = step(y)
            mx.async_eval(next_y)
            y.tolist()  # the previous step's tokens reach the host while this one runs
            y = next_y
            moments.append(time.perf_counter())
        y.tolist()
        elapsed = time.perf_counter() - start
        timed = moments[warmup:]
        step_times = [later - earlier for earlier, later in zip(timed, timed[1:], strict=False)]
        per_step = elapsed / steps
        rows.append({"batch": batch, "step_ms": 1000 * per_step, "median_step_ms": 1000 * statistics.median(step_times),
                     "tokens_per_s": batch / per_step})
        del cache
        mx.clear_cache()
    return {"model_path": model_path, "device": str(mx.default_device()), "mlx": version("mlx"),
            "blas": describe_blas(), "prompt_tokens": prompt_tokens, "warmup_steps": warmup, "timed_steps": steps,
            "batches": rows}


def measure_floor(args: argparse.Namespace, batches: Sequence[int]) -> dict[str, Any]:
    """decode_floor in a fresh process (the same environment and BLAS as the servers), freed before they start."""
    command = [sys.executable, str(Path(__file__).resolve()), "--floor-json", "--model-path", str(args.model_path),
               "--streams", ",".join(map(str, batches)), "--floor-prompt-tokens", str(args.floor_prompt_tokens),
               "--floor-warmup", str(args.floor_warmup), "--floor-steps", str(args.floor_steps)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=FLOOR_TIMEOUT_S,
                               env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO)))
    if completed.returncode != 0:
        raise SystemExit(f"the floor measurement failed ({completed.returncode}): {completed.stderr.strip()[-800:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def combine_floors(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several floor runs as one: per B the fastest run's row (a shared machine only ever slows a run down)."""
    best: dict[int, dict[str, Any]] = {}
    for run in runs:
        for row in run["batches"]:
            if row["batch"] not in best or row["step_ms"] < best[row["batch"]]["step_ms"]:
                best[row["batch"]] = row
    return {**runs[0], "batches": [best[batch] for batch in sorted(best)],
            "runs": [run["batches"] for run in runs]}


# --- the servers ---------------------------------------------------------------------------------------------


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def short_prompts(tag: str, count: int, words: int) -> list[list[dict[str, str]]]:
    """``count`` distinct short user turns (seeded by ``tag``, so every server gets the same ones)."""
    rng = random.Random(tag)
    return [[{"role": "user", "content": f"{tag} {index}: {_words(rng, words)}"}] for index in range(count)]


def _problems(results: Sequence[StreamResult], expected_tokens: int | None) -> list[str]:
    return [problem for result in results if (problem := result.problem(expected_tokens)) is not None]


def streams_round(client: StreamClient, model: str, level: int, args: argparse.Namespace) -> dict[str, Any]:
    if args.warmup_tokens:
        client.round([_body(model, messages, args.warmup_tokens)
                      for messages in short_prompts(f"warm-{level}", level, args.prompt_words)])
    bodies = [_body(model, messages, args.reply_tokens)
              for messages in short_prompts(f"streams-{level}", level, args.prompt_words)]
    results, busy = client.round(bodies)
    served = [result for result in results if result.served]
    times = [result.token_times for result in served]
    tokens = sum(result.tokens() for result in served)
    round_start = min(result.sent for result in results)
    wall = max(result.end for result in results) - round_start
    problems = _problems(results, args.reply_tokens)
    chunks = sum(len(result.token_times) for result in served)
    gaps = [gap for t in times for gap in stream_gaps(t)]
    return {
        "streams": level,
        "per_token_interval_s": median_gap(times),
        "gap_p90_s": percentile(gaps, 0.9),
        "gap_p99_s": percentile(gaps, 0.99),
        "gap_max_s": max(gaps, default=None),
        "largest_gaps": largest_gaps(times, round_start),
        # The wait between a stream's first and second token: where other streams' starts hold it up.
        "second_token_gap_median_s": median([t[1] - t[0] for t in times if len(t) > 1]),
        "aggregate_tokens_per_s": tokens / wall if wall > 0 else None,
        "all_active_tokens_per_s": all_active_rate(times),
        "ttft_median_s": median([result.ttft for result in served if result.ttft is not None]),
        "wall_s": wall,
        "completion_tokens": tokens,
        "content_chunks": chunks,
        "served": len(results) - len(problems),
        "problems": problems,
        "client_cpu_share": busy,
        **({"token_times_s": [[round(moment - round_start, 5) for moment in t] for t in times]}
           if args.keep_token_times else {}),
    }


def wave_round(client: StreamClient, model: str, args: argparse.Namespace, tag: str = "wave") -> dict[str, Any]:
    bodies = [_body(model, messages, args.wave_reply_tokens)
              for messages in short_prompts(tag, args.wave, args.prompt_words)]
    results, busy = client.round(bodies)
    ttfts = [result.ttft for result in results if result.served and result.ttft is not None]
    problems = _problems(results, None)
    return {"requests": args.wave, "ttft_median_s": median(ttfts), "ttft_p99_s": percentile(ttfts, 0.99),
            "ttft_max_s": max(ttfts, default=None), "served": len(results) - len(problems), "problems": problems,
            "client_cpu_share": busy, "ttfts_s": ttfts,
            "sent": [result.sent for result in results]}


def wave_rounds(client: StreamClient, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """--wave-rounds waves one after another (distinct prompts each); the figures are the rounds' medians."""
    if args.wave_rounds == 1:
        return wave_round(client, model, args)
    rounds = [wave_round(client, model, args, tag=f"wave-{index}") for index in range(args.wave_rounds)]
    for index, row in enumerate(rounds):
        _progress("wave", f"round {index}", {key: value for key, value in row.items()
                                             if key not in ("ttfts_s", "sent")})
    return {"requests": args.wave, "rounds": rounds,
            "ttft_median_s": median([row["ttft_median_s"] for row in rounds if row["ttft_median_s"] is not None]),
            "ttft_p99_s": median([row["ttft_p99_s"] for row in rounds if row["ttft_p99_s"] is not None]),
            "ttft_max_s": max((row["ttft_max_s"] for row in rounds if row["ttft_max_s"] is not None), default=None),
            "served": sum(row["served"] for row in rounds),
            "problems": [problem for row in rounds for problem in row["problems"]],
            "client_cpu_share": max(row["client_cpu_share"] for row in rounds)}


def conversations_rounds(client: StreamClient, model: str, args: argparse.Namespace) -> dict[str, Any]:
    from mlxcel.bench.workload import Shape, build_workload

    shape = Shape(conversations=args.conversations, turns=args.turns, system_tokens=args.system_tokens,
                  user_tokens=args.user_tokens, reply_tokens=args.conversation_reply_tokens, seed=args.seed)
    workload = build_workload(shape, model_path=args.model_path)
    replies: list[list[str]] = [[] for _ in range(args.conversations)]
    turns = []
    problems: list[str] = []
    for turn in range(args.turns):
        if time.monotonic() >= args.deadline_at:
            break
        bodies = [_body(model, workload.messages(conversation, turn, replies[conversation]), shape.reply_tokens)
                  for conversation in range(args.conversations)]
        results, busy = client.round(bodies)
        for conversation, result in enumerate(results):
            replies[conversation].append(result.text)
        ttfts = [result.ttft for result in results if result.served and result.ttft is not None]
        prompt = sum(result.prompt_tokens or 0 for result in results)
        cached = [result.cached_tokens for result in results if result.cached_tokens is not None]
        turn_problems = _problems(results, None)
        problems += [f"turn {turn}: {problem}" for problem in turn_problems]
        turns.append({"turn": turn, "ttft_median_s": median(ttfts), "ttft_p99_s": percentile(ttfts, 0.99),
                      "wall_s": max(r.end for r in results) - min(r.sent for r in results),
                      "cached_share": sum(cached) / prompt if cached and prompt else None,
                      "served": len(results) - len(turn_problems), "client_cpu_share": busy})
    return {"conversations": args.conversations, "system_tokens_measured": workload.system_tokens_measured,
            "user_tokens_measured": workload.user_tokens_measured, "turns": turns, "problems": problems}


def _out_of_time(args: argparse.Namespace, figures: dict[str, Any], what: str) -> bool:
    if time.monotonic() < args.deadline_at:
        return False
    figures.setdefault("skipped", []).append(what)
    print(f"[{figures['name']}] {what}: skipped, past --deadline-s", file=sys.stderr, flush=True)
    return True


def measure_server(name: str, base_url: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    client = StreamClient(base_url, processes=args.client_processes, timeout_s=args.request_timeout,
                          stop_at=args.deadline_at)
    figures: dict[str, Any] = {"name": name}
    try:
        results, _ = client.round([_body(model, messages, 8) for messages in short_prompts("first", 1, 8)])
        figures["first_request_problems"] = _problems(results, None)
        if not args.skip_streams:
            figures["streams"] = {}
            for level in args.streams:
                if _out_of_time(args, figures, f"{level} streams"):
                    continue
                opened = time.time()
                row = streams_round(client, model, level, args)
                row["wall_window"] = [opened, time.time()]  # for serve_under_timers.py --summarize
                figures["streams"][str(level)] = row
                _progress(name, f"{level} streams", row)
        if not args.skip_wave and not _out_of_time(args, figures, "wave"):
            opened = time.time()
            figures["wave"] = wave_rounds(client, model, args)
            figures["wave"]["wall_window"] = [opened, time.time()]
            _progress(name, f"wave of {args.wave}", {key: value for key, value in figures["wave"].items()
                                                     if key not in ("rounds", "ttfts_s", "sent")})
        if not args.skip_conversations and not _out_of_time(args, figures, "conversations"):
            figures["conversations"] = conversations_rounds(client, model, args)
            for turn in figures["conversations"]["turns"]:
                _progress(name, f"conversations turn {turn['turn']}", turn)
    finally:
        client.close()
    return figures


def _progress(name: str, what: str, row: dict[str, Any]) -> None:
    shown = {key: (round(value, 4) if isinstance(value, float) else value) for key, value in row.items()
             if key != "problems"}
    print(f"[{name}] {what}: {shown}", file=sys.stderr, flush=True)
    for problem in row.get("problems", [])[:8]:
        print(f"[{name}]   {problem}", file=sys.stderr, flush=True)


def concurrency_needed(args: argparse.Namespace) -> int:
    needs = [1]
    if not args.skip_streams:
        needs += args.streams
    if not args.skip_wave:
        needs.append(args.wave)
    if not args.skip_conversations:
        needs.append(args.conversations)
    return max(needs)


def run_mlxcel(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    flags = ["--max-batch-size", str(concurrency_needed(args)), *args.mlxcel_args.split()]
    log = log_dir / "server-mlxcel.log"
    print(f"starting mlxcel {' '.join(flags)} (log {log})", file=sys.stderr, flush=True)
    process, base_url = start_mlxcel(args.model_path, flags, log=log, log_level="warning", stacks=args.server_stacks,
                                     timers=args.server_timers)
    started = time.monotonic()
    try:
        wait_healthy(process, base_url, seconds=args.start_timeout)
        startup = time.monotonic() - started
        with httpx.Client(timeout=30) as client:
            model = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        figures = measure_server("mlxcel", base_url, model, args)
        figures["startup_s"] = startup
    finally:
        status, _ = stop_server(process, seconds=60)
    figures["exit_status"] = status
    return figures


def run_peer(args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    from mlxcel.bench.launcher import mlx_lm_spec, start_server

    spec = mlx_lm_spec(["--decode-concurrency", str(concurrency_needed(args)), *args.peer_args.split()])
    print(f"starting {spec.name} (log {log_dir / 'server-mlx_lm.log'})", file=sys.stderr, flush=True)
    server = start_server(spec, str(args.model_path), log_dir, ready_timeout_s=args.start_timeout)
    try:
        figures = measure_server(spec.name, server.base_url, spec.model_name or "default_model", args)
        figures["startup_s"] = server.startup_s
    finally:
        figures_status = server.stop()
    figures["exit_status"] = figures_status
    return figures


# --- the table -----------------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.2f} ms"


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _rate(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per figure: its floor (or None) and each server's value, as numbers (seconds, tokens/s)."""
    floor = {row["batch"]: row for row in (report.get("floor") or {}).get("batches", [])}
    servers = report["servers"]
    rows: list[dict[str, Any]] = []

    def add(label: str, unit: str, floor_value: float | None, pick: Any) -> None:
        values = {name: pick(figures) for name, figures in servers.items()}
        rows.append({"figure": label, "unit": unit, "floor": floor_value, "values": values,
                     "ratios": {name: ratio(value, floor_value) for name, value in values.items()}})

    for level in report["config"]["streams"] if not report["config"]["skip_streams"] else []:
        in_floor = floor.get(level)
        plural = "stream" if level == 1 else "streams"
        add(f"{level} {plural}: per-token interval", "ms", in_floor and in_floor["step_ms"] / 1000,
            lambda f, n=str(level): f.get("streams", {}).get(n, {}).get("per_token_interval_s"))
        add(f"{level} {plural}: aggregate tokens/s", "rate", in_floor and in_floor["tokens_per_s"],
            lambda f, n=str(level): f.get("streams", {}).get(n, {}).get("aggregate_tokens_per_s"))
        add(f"{level} {plural}: tokens/s, all decoding", "rate", in_floor and in_floor["tokens_per_s"],
            lambda f, n=str(level): f.get("streams", {}).get(n, {}).get("all_active_tokens_per_s"))
    if not report["config"]["skip_wave"]:
        wave = report["config"]["wave"]
        add(f"{wave} short requests at once: TTFT median", "s", None,
            lambda f: f.get("wave", {}).get("ttft_median_s"))
        add(f"{wave} short requests at once: TTFT p99", "s", None, lambda f: f.get("wave", {}).get("ttft_p99_s"))
    if not report["config"]["skip_conversations"]:
        config = report["config"]
        for turn in range(config["turns"]):
            label = (f"{config['conversations']} conversations, {config['system_tokens']}-token system prompt, "
                     f"turn {turn} ({'cold' if turn == 0 else 'warm'}): TTFT median")

            def pick(f: dict[str, Any], turn: int = turn) -> float | None:
                turns = f.get("conversations", {}).get("turns", [])
                return turns[turn]["ttft_median_s"] if turn < len(turns) else None

            add(label, "s", None, pick)
    return rows


def format_table(report: dict[str, Any]) -> str:
    names = list(report["servers"])
    show = {"ms": _ms, "s": _s, "rate": _rate}
    header = ["figure", "in-process", *[part for name in names for part in (name, f"{name} / in-process")]]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in report["table"]:
        cells = [row["figure"], show[row["unit"]](row["floor"])]
        for name in names:
            cells += [show[row["unit"]](row["values"][name]), _x(row["ratios"][name])]
        lines.append("| " + " | ".join(cells) + " |")
    for name, figures in report["servers"].items():
        problems = [*figures.get("first_request_problems", [])]
        for level, row in figures.get("streams", {}).items():
            problems += [f"{level} streams: {problem}" for problem in row["problems"]]
        problems += [f"wave: {problem}" for problem in figures.get("wave", {}).get("problems", [])]
        problems += [f"conversations {problem}" for problem in figures.get("conversations", {}).get("problems", [])]
        summary = f"{name}: {len(problems)} streams failed or short" if problems else f"{name}: every stream served"
        lines.append("")
        if figures.get("skipped"):
            lines.append(f"{name}: skipped at the deadline: {', '.join(figures['skipped'])}")
        lines.append(summary + "".join(f"\n  {problem}" for problem in problems[:20]))
        if len(problems) > 20:
            lines.append(f"  ... and {len(problems) - 20} more")
        busiest = max((row.get("client_cpu_share", 0.0) for row in figures.get("streams", {}).values()), default=0.0)
        if busiest > 0.5:
            lines.append(f"  note: a client process used {busiest:.0%} of a core in a stream round; "
                         "raise --client-processes")
    return "\n".join(lines)


# --- the command line ----------------------------------------------------------------------------------------


def _levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"every level must be at least 1, got {text!r}")
    return levels


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, help="model folder (default: the llama-bench fixture)")
    parser.add_argument("--streams", type=_levels, default=[1, 16, 64], help="concurrent streams (and floor B)")
    parser.add_argument("--reply-tokens", type=_positive, default=256, help="tokens per stream (max_tokens)")
    parser.add_argument("--warmup-tokens", type=int, default=16,
                        help="a round of this many tokens at each level before the timed one (0: none)")
    parser.add_argument("--prompt-words", type=_positive, default=24, help="words of each short prompt")
    parser.add_argument("--wave", type=_positive, default=64, help="short requests sent at once")
    parser.add_argument("--wave-reply-tokens", type=_positive, default=16)
    parser.add_argument("--wave-rounds", type=_positive, default=1,
                        help="waves sent one after another (each its own prompts): the figures are their medians")
    parser.add_argument("--conversations", type=_positive, default=64)
    parser.add_argument("--turns", type=_positive, default=3)
    parser.add_argument("--system-tokens", type=_positive, default=8000)
    parser.add_argument("--user-tokens", type=_positive, default=128)
    parser.add_argument("--conversation-reply-tokens", type=_positive, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--floor-prompt-tokens", type=_positive, default=32)
    parser.add_argument("--floor-warmup", type=int, default=16)
    parser.add_argument("--floor-steps", type=_positive, default=64)
    parser.add_argument("--floor-runs", type=_positive, default=2,
                        help="floor measurements: one before the servers, the rest after; the table takes the fastest")
    parser.add_argument("--deadline-s", type=float,
                        help="start no part after this many seconds; streams open then are cut (and listed)")
    parser.add_argument("--peer", choices=["none", "mlx_lm"], default="none",
                        help="also measure mlx_lm.server on the same folder, after mlxcel")
    parser.add_argument("--mlxcel-args", default="", help="more `mlxcel serve` flags, one string")
    parser.add_argument("--peer-args", default="", help="more mlx_lm.server flags, one string")
    parser.add_argument("--client-processes", type=_positive, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="processes the streams are spread over (default: a quarter of the cores, at most 4)")
    parser.add_argument("--request-timeout", type=float, default=300.0)
    parser.add_argument("--start-timeout", type=float, default=300.0)
    for section in ("floor", "mlxcel", "streams", "wave", "conversations"):
        parser.add_argument(f"--skip-{section}", action="store_true")
    parser.add_argument("--out", type=Path, help="write the figures, the table and the settings here as JSON")
    parser.add_argument("--server-stacks", type=Path, help="run mlxcel under the sampling profiler; its report here")
    parser.add_argument("--server-timers", type=Path,
                        help="run mlxcel under benchmarks/serve_under_timers.py; its counters appended here")
    parser.add_argument("--keep-token-times", action="store_true",
                        help="--out keeps each stream's token times (s after the round's first request)")
    parser.add_argument("--log-dir", type=Path, help="the servers' logs (default: beside --out, else /tmp)")
    parser.add_argument("--floor-json", action="store_true", help=argparse.SUPPRESS)
    return parser


def _print_floor(floor: dict[str, Any], when: str) -> None:
    for row in floor["batches"]:
        print(f"[floor, {when}] B = {row['batch']}: {row['step_ms']:.2f} ms/step, {row['tokens_per_s']:,.0f} tokens/s",
              file=sys.stderr, flush=True)


def _save(report: dict[str, Any], path: Path | None) -> None:
    """Written after every part, so a run cut short still leaves what it measured."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1))


def _interrupt(signal_number: int, _frame: object) -> None:
    # SIGTERM (a `timeout` around the run) unwinds like Ctrl-C, so every server started is stopped.
    raise KeyboardInterrupt(f"signal {signal_number}")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from mlxcel.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas()
    if args.model_path is None:
        from mlxcel.fixtures import fixture_path

        args.model_path = fixture_path("llama-bench")
    if args.floor_json:
        print(json.dumps(decode_floor(str(args.model_path), args.streams, prompt_tokens=args.floor_prompt_tokens,
                                      warmup=args.floor_warmup, steps=args.floor_steps)))
        return 0
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    args.deadline_at = math.inf if args.deadline_s is None else started + args.deadline_s
    log_dir = args.log_dir or (args.out.parent if args.out else Path("/tmp/decode-speed"))
    log_dir.mkdir(parents=True, exist_ok=True)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
              if key not in ("floor_json", "deadline_at")}
    report: dict[str, Any] = {"config": config, "host": {"cpus": os.cpu_count(), "platform": sys.platform},
                              "servers": {}}
    floors = []
    if not args.skip_floor:
        print(f"measuring the in-process floor at B = {args.streams} ...", file=sys.stderr, flush=True)
        floors.append(measure_floor(args, args.streams))
        _print_floor(floors[-1], "before the servers")
        report["floor"] = combine_floors(floors)
        _save(report, args.out)
    if not args.skip_mlxcel:
        report["servers"]["mlxcel"] = run_mlxcel(args, log_dir)
        _save(report, args.out)
    if args.peer == "mlx_lm":
        report["servers"]["mlx_lm"] = run_peer(args, log_dir)
        _save(report, args.out)
    if floors and report["servers"] and args.floor_runs > 1:
        for _ in range(args.floor_runs - 1):
            if time.monotonic() >= args.deadline_at:
                break
            floors.append(measure_floor(args, args.streams))
            _print_floor(floors[-1], "after the servers")
        report["floor"] = combine_floors(floors)
    report["wall_s"] = time.monotonic() - started
    report["table"] = table_rows(report)
    _save(report, args.out)
    floor = report.get("floor") or {}
    print(f"\n{args.model_path} ({floor.get('device', '?')}, mlx {floor.get('mlx', '?')}, {floor.get('blas', '')}); "
          f"{args.reply_tokens}-token replies; {report['wall_s']:.0f} s in all\n")
    print(format_table(report))
    problems = any(figures.get("first_request_problems") or figures.get("skipped") or any(
        row["problems"] for row in figures.get("streams", {}).values()) or figures.get("wave", {}).get("problems")
        or figures.get("conversations", {}).get("problems") for figures in report["servers"].values())
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
