"""What LoRA adapter configurations cost a decoding batch.

Usage: python benchmarks/lora_configs.py [--model-path DIR] [--streams 16] [--reply-tokens 64] [--repeats 3]

In-process engine on the llama fixture (or --model-path) with two random
adapters (`mlxcel fixture --lora`; written beside --model-path for another
model). N simultaneous streams decode --reply-tokens each, their
adapter scales spread over 1, 2 or 4 configurations (none; A; B; A+B). Each
configuration runs as its own batch, one forward pass per configuration per
step, so decode tokens/s falls as configurations are added; also shown:
all streams on the base model with no adapter loaded at all. Median of
--repeats rounds after a warm-up, interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # structured_output's decode_rate

from mlxcel.blas import describe_blas, reexec_with_optimized_blas  # noqa: E402

CONFIGS = [[], [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}], [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]]


async def decode_round(engine: Any, streams: int, num_configs: int, reply_tokens: int, round_index: int) -> float:
    from structured_output import decode_rate

    bodies: list[dict[str, Any]] = []
    for index in range(streams):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Round {round_index}, stream {index}."}],
                                "max_tokens": reply_tokens, "temperature": 1.0, "seed": index, "cache_prompt": False}
        if num_configs:
            body["lora"] = CONFIGS[index % num_configs]
        bodies.append(body)
    return await decode_rate(engine, bodies)


async def run(arguments: argparse.Namespace, with_adapters: bool) -> dict[str, float]:
    import attrs

    from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig
    from mlxcel.engine import open_engine
    from mlxcel.fixtures import fixture_path, lora_fixture_path
    from mlxcel.model.adapters import AdapterSpec

    if arguments.model_path is None:
        model_path = fixture_path("llama")
        folders = [lora_fixture_path(seed=1), lora_fixture_path(seed=2)]
    else:
        from mlxcel.fixtures import write_lora_fixture

        model_path = Path(arguments.model_path)
        folders = [model_path.parent / f"{model_path.name}-lora{seed}" for seed in (1, 2)]
        for seed, folder in zip((1, 2), folders, strict=True):
            if not (folder / "adapters.safetensors").exists():
                write_lora_fixture(model_path, folder, seed=seed)
    adapters = tuple(AdapterSpec(path=folder) for folder in folders)
    config = EngineConfig(model_path=model_path, prompt_cache=PromptCacheConfig(capacity_bytes=1 << 30),
                          scheduler=SchedulerConfig(), lora=adapters if with_adapters else ())
    ways = {"1 configuration": 1, "2 configurations": 2, "4 configurations": 4} if with_adapters else {"no adapters": 0}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    async with open_engine(attrs.evolve(config)) as engine:
        for round_index in range(-1, arguments.repeats):
            for way, count in ways.items():
                rate = await decode_round(engine, arguments.streams, count, arguments.reply_tokens, round_index)
                if round_index >= 0:
                    rates[way].append(rate)
    return {way: statistics.median(values) for way, values in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    reexec_with_optimized_blas()
    import trio

    print(describe_blas())
    figures = {**trio.run(run, arguments, False), **trio.run(run, arguments, True)}
    print(json.dumps(figures))
    base = figures["no adapters"]
    for way, rate in figures.items():
        print(f"{way:>18}: {rate:8.1f} tok/s  {rate / base:5.2f}x")


if __name__ == "__main__":
    main()
