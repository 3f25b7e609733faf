"""Snapshot-store bytes per conversation for `mlxcel bench`'s workload, in process.

    PYTHONPATH=. python benchmarks/snapshot_bytes.py [--family hybrid] [--conversations 6] [--turns 4]

Runs the bench's conversations one turn at a time (turn k of every
conversation, then turn k+1), lets each warm-up finish, and prints the
snapshot store's entries, checkpoints and bytes.
"""

from __future__ import annotations

import argparse
import json

import trio

from mlxcel import CacheOptions, ChatRequest, SamplingParams
from mlxcel.bench.workload import Shape, build_workload
from mlxcel.config import EngineConfig, SchedulerConfig
from mlxcel.engine import run_engine
from mlxcel.fixtures import fixture_path


async def main(family: str, conversations: int, turns: int) -> None:
    path = fixture_path(family)
    workload = build_workload(Shape(conversations=conversations, turns=turns), model_path=path)
    config = EngineConfig(model_path=path, scheduler=SchedulerConfig(device_warmup=False))
    async with trio.open_nursery() as nursery:
        engine = await nursery.start(run_engine, config)
        replies: list[list[str]] = [[] for _ in range(conversations)]
        done = 0
        for turn in range(turns):
            for conversation in range(conversations):
                messages = workload.messages(conversation, turn, replies[conversation])
                result = await engine.chat(ChatRequest(
                    messages=tuple(messages), sampling=SamplingParams(temperature=0.0, max_tokens=16),
                    cache=CacheOptions()))
                replies[conversation].append(result.text)
                done += 1
                with trio.fail_after(60):
                    while (await engine.scheduler_stats()).num_warm_completed < done:  # noqa: ASYNC110
                        await trio.sleep(0.01)
        body = await engine.cache_stats()
        stats = body.get("snapshots", body)
        print(json.dumps({key: stats[key] for key in ("entries", "checkpoints", "bytes", "sessions")}))
        print(f"bytes per conversation: {stats['bytes'] / conversations:,.0f}")
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", default="hybrid")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    trio.run(main, args.family, args.conversations, args.turns)
