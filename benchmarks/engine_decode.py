"""Decode and admission inside the engine (no HTTP), against MLX decoding the same model in one process.

Usage: python benchmarks/engine_decode.py --model-path DIR [--levels 1,16,64] [--reply-tokens 128]
       [--wave 64] [--steps-ahead 1,2] [--profile] [--json PATH]

For each ``--steps-ahead`` value an engine is opened on the model and:
  streams  N concurrent greedy streams of --reply-tokens each: the median gap between a stream's
           tokens (after its first five) and the aggregate tokens/s, with how many streams fell short;
  wave     --wave short distinct requests submitted at once: time to first token, median and p99.
Then the floor: mlx-lm's model with a plain KV cache per layer, B equal rows, greedy, the next step
built while the previous one runs (mlx_lm.generate's pattern); ms per step at each level.

--profile samples every thread's stack every 5 ms during the largest level of the last engine and
prints where each thread spent its samples (the innermost three frames): the profile of the step.
The HTTP benchmark (benchmarks/decode_speed.py) measures the same through the server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import trio

import mlxcel
from mlxcel.bench.stacks import StackSampler
from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.types import ChatRequest, SamplingParams


def _request(index: int, reply_tokens: int) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": f"stream {index}: " + "tell me more " * 3},),
                       sampling=SamplingParams(temperature=0.0, max_tokens=reply_tokens), stream=True)


async def _streams(engine: Any, level: int, reply_tokens: int) -> dict[str, Any]:
    gaps: list[float] = []
    counts: list[int] = []
    spans: list[tuple[float, float]] = []

    async def one(index: int) -> None:
        times = []
        async with engine.stream(_request(index, reply_tokens)) as stream:
            async for _delta in stream:
                times.append(time.perf_counter())
        gaps.extend(later - earlier for earlier, later in zip(times[5:], times[6:], strict=False))
        counts.append(len(times))
        spans.append((times[0], times[-1]))

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for index in range(level):
            nursery.start_soon(one, index)
    wall = time.perf_counter() - started
    # While every stream decodes: from the last first token to the first last token.
    together = min(last for _first, last in spans) - max(first for first, _last in spans)
    return {"streams": level, "gap_ms": 1000 * statistics.median(gaps) if gaps else None,
            "tokens_per_s": sum(counts) / wall, "all_started_s": max(first for first, _ in spans) - started,
            "together_s": together, "short_streams": sum(count < reply_tokens for count in counts)}


async def _wave(engine: Any, size: int) -> dict[str, Any]:
    ttfts: list[float] = []

    async def one(index: int) -> None:
        sent = time.perf_counter()
        request = ChatRequest(messages=({"role": "user", "content": f"wave {index} " + "hello " * 6},),
                              sampling=SamplingParams(temperature=0.0, max_tokens=8), stream=True)
        async with engine.stream(request) as stream:
            async for _delta in stream:
                ttfts.append(time.perf_counter() - sent)
                break

    async with trio.open_nursery() as nursery:
        for index in range(size):
            nursery.start_soon(one, index)
    ttfts.sort()
    return {"wave": size, "ttft_median_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
            "ttft_deciles_s": [round(ttfts[min(len(ttfts) - 1, len(ttfts) * tenth // 10)], 4) for tenth in range(11)]}


async def _engine_run(model_path: Path, steps_ahead: int, args: argparse.Namespace, profile: bool) -> dict[str, Any]:
    fields = {"max_batch_size": max(args.levels + [args.wave])}
    if "steps_ahead" in attrs.fields_dict(SchedulerConfig):  # an older mlxcel (before/after runs) has none
        fields["steps_ahead"] = steps_ahead
    scheduler = SchedulerConfig(**fields)
    results: dict[str, Any] = {"steps_ahead": steps_ahead, "streams": [], "profile": None}
    async with mlxcel.open_engine(EngineConfig(model_path=model_path, scheduler=scheduler)) as engine:
        for level in args.levels:
            # The first round at a batch size builds its kernels (and, on CUDA, their plans): untimed.
            await _streams(engine, level, 16)
            if profile and level == max(args.levels):
                with StackSampler() as sampler:
                    row = await _streams(engine, level, args.reply_tokens)
                results["profile"] = sampler.report()
            else:
                row = await _streams(engine, level, args.reply_tokens)
            results["streams"].append(row)
            print(f"steps_ahead={steps_ahead} {row}", flush=True)
        if args.wave:
            await _wave(engine, 4)
            await _wave(engine, args.wave)  # the wave's shapes built: untimed
            if profile:
                with StackSampler() as sampler:
                    results["wave"] = await _wave(engine, args.wave)
                results["wave_profile"] = sampler.report()
            else:
                results["wave"] = await _wave(engine, args.wave)
            print(f"steps_ahead={steps_ahead} {results['wave']}", flush=True)
    return results


def floor_step_ms(model_path: Path, batch: int, steps: int = 64) -> float:
    """The in-process floor: a plain KV cache per layer, B equal rows, greedy, pipelined (decode_step_pieces.py)."""
    import mlx.core as mx
    from decode_step_pieces import pipelined_step_ms
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _tokenizer = load(str(model_path))
    cache = make_prompt_cache(model)
    logits = model(mx.array([[10 + i for i in range(32)]] * batch), cache=cache)
    first = mx.argmax(logits[:, -1, :], axis=-1)

    def step(tokens: Any) -> Any:
        return mx.argmax(model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)

    return pipelined_step_ms(step, first, steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, default=None)
    parser.add_argument("--levels", default="1,16,64")
    parser.add_argument("--reply-tokens", type=int, default=128)
    parser.add_argument("--wave", type=int, default=64)
    parser.add_argument("--steps-ahead", default="1,2")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--no-floor", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    args.levels = [int(level) for level in args.levels.split(",")]
    if args.model_path is None:
        from mlxcel.fixtures import fixture_path

        args.model_path = fixture_path("llama-bench")
    aheads = [int(value) for value in args.steps_ahead.split(",")]
    runs = [trio.run(_engine_run, args.model_path, ahead, args, args.profile and ahead == aheads[-1])
            for ahead in aheads]
    floor = {} if args.no_floor else {level: floor_step_ms(args.model_path, level) for level in args.levels}
    print(f"\nmodel {args.model_path}, {args.reply_tokens}-token replies; ratio = engine gap / floor step")
    print("| steps ahead | streams | gap ms | floor ms | ratio | tokens/s | floor tokens/s | short |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        for row in run["streams"]:
            step = floor.get(row["streams"])
            ratio = f"{row['gap_ms'] / step:.2f}x" if step and row["gap_ms"] else "-"
            floor_rate = f"{1000 * row['streams'] / step:.0f}" if step else "-"
            print(f"| {run['steps_ahead']} | {row['streams']} | {row['gap_ms']:.2f} | "
                  f"{f'{step:.2f}' if step else '-'} | {ratio} | {row['tokens_per_s']:.0f} | {floor_rate} | "
                  f"{row['short_streams']} |")
    for run in runs:
        if "wave" in run:
            wave = run["wave"]
            print(f"wave of {wave['wave']} (steps ahead {run['steps_ahead']}): TTFT median "
                  f"{wave['ttft_median_s']:.3f} s, p99 {wave['ttft_p99_s']:.3f} s; deciles {wave['ttft_deciles_s']}")
    for run in runs:
        if run["profile"]:
            print(f"\nprofile, steps ahead {run['steps_ahead']}, {max(args.levels)} streams:\n{run['profile']}")
        if run.get("wave_profile"):
            print(f"\nprofile of the wave, steps ahead {run['steps_ahead']}:\n{run['wave_profile']}")
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "floor_ms": floor}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
