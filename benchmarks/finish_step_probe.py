"""Where the device thread's time goes in the steps around rows finishing (issue 28: the last token's stall).

Usage: python benchmarks/finish_step_probe.py MODEL_DIR [--streams 64] [--reply-tokens 64] [--shown 3]
       [--switch-interval-ms MS] [--gc-freeze]

The embedded engine (no HTTP) runs STREAMS concurrent greedy streams of REPLY_TOKENS tokens, after a shorter
round that builds the shapes. Every device step of the timed round is timed and profiled (cProfile); the table
gives each step's ms with its batch size, tokens sampled, sequences finished and KV copies donated, and the
SHOWN slowest steps that started no request get their profile (the functions with the most cumulative time).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import os
import pstats
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mlxcel.blas import load_optimized_blas_in_process

    load_optimized_blas_in_process()
    import engine_decode
    import trio

    from mlxcel.model import executor

    model_path, streams, reply_tokens, shown = args.model_path, args.streams, args.reply_tokens, args.shown
    steps: list[tuple[float, Any, Any, cProfile.Profile]] = []
    # Python's garbage collections during the timed round: (generation, seconds, on the device thread).
    collections: list[tuple[int, float, bool]] = []
    collecting: dict[str, float] = {}

    def on_collection(phase: str, info: dict[str, int]) -> None:
        if not timing[0]:
            return
        if phase == "start":
            collecting["started"] = time.perf_counter()
        elif "started" in collecting:
            device = threading.current_thread().name != "MainThread"
            collections.append((info["generation"], time.perf_counter() - collecting.pop("started"), device))

    gc.callbacks.append(on_collection)
    timing = [False]
    run_step = executor.StepExecutor.run_step

    def timed_step(self: Any, plan: Any) -> Any:
        if not timing[0]:
            return run_step(self, plan)
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        result = run_step(self, plan)
        profile.disable()
        steps.append((time.perf_counter() - started, plan, result, profile))
        return result

    executor.StepExecutor.run_step = timed_step  # type: ignore[method-assign]

    async def rounds() -> None:
        import mlxcel
        from mlxcel.config import EngineConfig, SchedulerConfig

        config = EngineConfig(model_path=model_path, scheduler=SchedulerConfig(max_batch_size=streams))
        async with mlxcel.open_engine(config) as engine:
            if args.switch_interval_ms is not None:
                sys.setswitchinterval(args.switch_interval_ms / 1000)
            if args.gc_freeze:
                gc.freeze()
            await engine_decode._streams(engine, streams, 16)
            timing[0] = True
            print(await engine_decode._streams(engine, streams, reply_tokens))
            timing[0] = False

    trio.run(rounds)
    for generation in (0, 1, 2):
        runs = [seconds for gen, seconds, _device in collections if gen == generation]
        on_device = sum(1 for gen, _seconds, device in collections if gen == generation and device)
        print(f"garbage collections of generation {generation}: {len(runs)} ({on_device} on the device thread), "
              f"{1000 * sum(runs):.1f} ms in all, the longest {1000 * max(runs, default=0):.1f} ms")
    typical = sorted(step[0] for step in steps)[len(steps) // 2]
    print(f"{len(steps)} steps, median {1000 * typical:.2f} ms; the steps over 1.5x that, or donating:")
    print("| step | ms | batch | sampled | finished | donated | starts |")
    print("|---|---|---|---|---|---|---|")
    for index, (seconds, plan, result, _profile) in enumerate(steps):
        finished = sum(1 for item in result.detached if item.final)
        if seconds < 1.5 * typical and not result.detached:
            continue
        print(f"| {index} | {1000 * seconds:.1f} | {result.decode_batch_size} | {len(result.sampled)} | "
              f"{finished} | {len(result.detached)} | {len(plan.starts)} |")
    quiet = [step for step in steps if not step[1].starts]
    for seconds, _plan, result, profile in sorted(quiet, key=lambda step: -step[0])[:shown]:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(28)
        print(f"\n== step of {1000 * seconds:.1f} ms, batch {result.decode_batch_size}, "
              f"{len(result.detached)} donated")
        print("\n".join(line[:170] for line in text.getvalue().splitlines()[6:]))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_path", type=Path)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--shown", type=int, default=3, help="profiles of this many of the slowest steps")
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="Python's GIL switch interval once the engine is up (Python's default: 5 ms)")
    parser.add_argument("--gc-freeze", action="store_true", help="gc.freeze() once the engine is up")
    main(parser.parse_args())
