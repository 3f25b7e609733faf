"""What LoRA adapter configurations cost a decoding batch, against no adapters loaded.

Usage: python benchmarks/lora_configs.py [--model-path DIR] [--streams 16] [--reply-tokens 64] [--repeats 3]
       [--device-steps]
(on the GPU machine: PYTHONPATH=. python3 -m benchmarks.lora_configs --model-path DIR)

In-process engine on the llama fixture (or --model-path) with two random
adapters (`mlxcel fixture --lora`; written beside --model-path for another
model). N simultaneous streams decode --reply-tokens each, their adapter
scales spread over 1 (A), 2 (A; B) or 4 (none; A; B; A+B) configurations;
also: every stream on the base model with the adapters loaded. Every row
of the batch runs at its own scales in one forward pass per step
(mlxcel/model/adapter_batches.py), so the mix should cost little. Each
decode rate is printed as a ratio to the same streams on an engine with no
adapter loaded at all, measured before and after the adapted engine (their
rounds pooled) so that drift in the machine's speed cancels, and to the
adapted engine's own streams with no adapter in use, paired round by round
(the steadier figure on a shared machine). Median of --repeats rounds after
a warm-up, the ways interleaved within an engine.

--device-steps times the same ways as decode steps of one mlx-lm batch in
process (no engine, no HTTP): the device's share alone, the fastest of
--repeats rounds (on the CPU in the process's CPU time), which a busy
machine disturbs least.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # structured_output's decode_rate

from mlxcel.blas import describe_blas, reexec_with_optimized_blas  # noqa: E402

NONE: list[dict[str, float]] = []
A, B = [{"id": 0, "scale": 1.0}], [{"id": 1, "scale": 1.0}]
BOTH = [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 1.0}]
# Each way: the streams' `lora` fields, in turn (None: the field left out, on the engine without adapters).
UNUSED = "adapters loaded, none used"
WAYS: dict[str, list[Any]] = {
    UNUSED: [NONE],
    "1 configuration": [A],
    "2 configurations": [A, B],
    "4 configurations": [NONE, A, B, BOTH],
}
NO_ADAPTERS = "no adapters"


async def decode_round(engine: Any, streams: int, configs: list[Any], reply_tokens: int, round_index: int) -> float:
    from structured_output import decode_rate

    bodies: list[dict[str, Any]] = []
    for index in range(streams):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Round {round_index}, stream {index}."}],
                                "max_tokens": reply_tokens, "temperature": 1.0, "seed": index, "cache_prompt": False}
        lora = configs[index % len(configs)]
        if lora is not None:
            body["lora"] = lora
        bodies.append(body)
    return await decode_rate(engine, bodies)


def model_and_adapters(arguments: argparse.Namespace) -> tuple[Path, list[Path]]:
    from mlxcel.fixtures import fixture_path, lora_fixture_path

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
    return model_path, folders


async def run(arguments: argparse.Namespace, with_adapters: bool) -> dict[str, list[float]]:
    import attrs

    from mlxcel.config import EngineConfig, PromptCacheConfig, SchedulerConfig
    from mlxcel.engine import open_engine
    from mlxcel.model.adapters import AdapterSpec

    model_path, folders = model_and_adapters(arguments)
    adapters = tuple(AdapterSpec(path=folder) for folder in folders)
    config = EngineConfig(model_path=model_path, prompt_cache=PromptCacheConfig(capacity_bytes=1 << 30),
                          scheduler=SchedulerConfig(), lora=adapters if with_adapters else ())
    ways = WAYS if with_adapters else {NO_ADAPTERS: [None]}
    rates: dict[str, list[float]] = {way: [] for way in ways}
    async with open_engine(attrs.evolve(config)) as engine:
        for round_index in range(-1, arguments.repeats):
            for way, configs in ways.items():
                rate = await decode_round(engine, arguments.streams, configs, arguments.reply_tokens, round_index)
                if round_index >= 0:
                    rates[way].append(rate)
    return rates


# The same ways as device steps alone: each stream's adapter multipliers (() is none).
STEP_WAYS: dict[str, list[tuple[float, ...]]] = {
    UNUSED: [()], "1 configuration": [(1.0, 0.0)], "2 configurations": [(1.0, 0.0), (0.0, 1.0)],
    "4 configurations": [(), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)],
}


def device_steps(arguments: argparse.Namespace) -> None:
    """Decode steps of one mlx-lm batch in process, no engine: the device's share, its fastest round."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from mlxcel.model.adapter_batches import AdapterBatches
    from mlxcel.model.adapters import AdapterSpec
    from mlxcel.model.loader import load_model
    from mlxcel.model.lora import load_adapters

    model_path, folders = model_and_adapters(arguments)
    plain = load_model(model_path).model
    adapted = load_model(model_path).model
    adapters = load_adapters(adapted, [AdapterSpec(path=folder) for folder in folders])
    ways: dict[str, tuple[Any, Any, list[tuple[float, ...]]]] = {NO_ADAPTERS: (plain, None, [()])}
    ways.update({way: (adapted, adapters, configs) for way, configs in STEP_WAYS.items()})
    streams = arguments.streams
    # On the CPU the process's own CPU time, which other load on a shared machine disturbs least.
    on_cpu = mx.default_device() == mx.cpu
    clock = time.process_time if on_cpu else time.perf_counter

    def seconds_a_step(model: Any, loaded: Any, configs: list[tuple[float, ...]]) -> float:
        batches = AdapterBatches(lambda batched: BatchGenerator(
            batched, stop_tokens=[], completion_batch_size=streams, prefill_batch_size=streams), model, loaded)
        try:
            for index in range(streams):
                batches.insert([[100 + index, 200 + index, 300 + index, 400 + index]],
                               config=configs[index % len(configs)], max_tokens=[1 << 20])
            for _ in range(4):  # the prompts, then the first steps (compiled shapes)
                batches.next()
            started = clock()
            for _ in range(arguments.reply_tokens):
                batches.next()
            mx.synchronize()
            return (clock() - started) / arguments.reply_tokens
        finally:
            batches.close()

    timings: dict[str, list[float]] = {way: [] for way in ways}
    for _round in range(arguments.repeats + 1):
        for way, (model, loaded, configs) in ways.items():
            timings[way].append(seconds_a_step(model, loaded, configs))
    base = min(timings[NO_ADAPTERS][1:])
    print(f"device steps alone: {streams} rows, {arguments.reply_tokens} steps a round; the fastest of "
          f"{arguments.repeats} rounds ({'CPU time' if on_cpu else 'wall time'}) and its ratio of decode rates "
          "to no adapters loaded")
    for way, values in timings.items():
        fastest = min(values[1:])
        print(f"{way:>27}: {fastest * 1e3:8.2f} ms a step  {base / fastest:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device-steps", action="store_true",
                        help="time decode steps of one mlx-lm batch in process instead of the engine's streams")
    arguments = parser.parse_args()
    reexec_with_optimized_blas()
    import trio

    print(describe_blas())
    if arguments.device_steps:
        device_steps(arguments)
        return
    before = trio.run(run, arguments, False)[NO_ADAPTERS]
    adapted = trio.run(run, arguments, True)
    after = trio.run(run, arguments, False)[NO_ADAPTERS]
    figures = {NO_ADAPTERS: statistics.median(before + after),
               **{way: statistics.median(values) for way, values in adapted.items()}}
    print(json.dumps({**figures, "no adapters, before and after": [statistics.median(before),
                                                                   statistics.median(after)]}))
    base = figures[NO_ADAPTERS]
    # Each round's ways ran back to back on one engine: their ratios to its no-adapter-in-use way, paired
    # by round, see the same machine (that way computes what no adapters do: every adapter is skipped).
    unused = adapted[UNUSED]
    paired = {way: statistics.median(rate / alone for rate, alone in zip(values, unused, strict=True))
              for way, values in adapted.items()}
    print(f"{arguments.streams} streams, {arguments.reply_tokens} tokens each; decode tokens/s, its ratio to "
          f"no adapters loaded, and (paired by round) to '{UNUSED}'")
    for way, rate in figures.items():
        line = f"{way:>27}: {rate:8.1f} tok/s  {rate / base:5.2f}x"
        print(line + (f"  {paired[way]:5.2f}x" if way in paired else ""))


if __name__ == "__main__":
    main()
