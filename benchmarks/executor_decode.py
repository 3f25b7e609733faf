"""The executor's decode step on one thread, without actors: is the gap to the floor in the step or around it?

Usage: python benchmarks/executor_decode.py --model-path DIR [--batches 1,16,64] [--steps 64] [--ragged on,off]
       [--serial] [--in-thread] [--profile N [--profile-rows 22]] [--edge-output]

--in-thread: the whole run (loading included) on a thread of its own, as the server's device thread runs.

--serial: every step evaluated to the end before the next is built (no overlap), for the floor and the executor,
split into the host's own work (building the graph, the executor's bookkeeping), queueing the kernels (inside
``mx.async_eval``) and the wait for the device to finish them (an ``mx.eval`` right after): which of the three
makes the executor's step longer than the floor's when both are pipelined.

--profile N: after the table, cProfile N timed steps of the executor and of the floor at each batch size and
print the functions with the most time of their own (MLX's calls count in their Python callers): where the
executor's host time per step goes beyond the floor's.

A scheduling core of the real capabilities plans for mlxcel's StepExecutor on this thread, as the
device warm-up does (no Trio, no HTTP, no steps ahead beyond mlx-lm's own): B short requests start,
then ms per step while all B decode (the core's update included), against the floor (plain KV cache,
B equal rows, decode_step_pieces.pipelined_step_ms) measured in the same process. Beside each, the time a
step's host spends inside ``mx.async_eval`` (queueing the step's kernels; where a launch waits for the GPU,
this is where the host stops building the next step's graph).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


class _Clients:
    def send(self, request_id: str, delta: Any) -> bool:
        return True

    def fail(self, request_id: str, error: Any) -> None:
        raise RuntimeError(error.message)

    def close(self, request_id: str) -> None:
        pass


def executor_step_ms(executor: Any, info: Any, batch: int, steps: int, profile: Any = None,
                     edge_output: bool = False) -> tuple[float, float]:
    """(ms per step of plan + run_step + update, ms inside run_step) once all ``batch`` requests decode;
    ``profile`` (a cProfile.Profile) runs over the timed steps only."""
    from mlxcel.core.plan import Capabilities
    from mlxcel.core.scheduler import NewRequest, SchedulerCore
    from mlxcel.types import SamplingParams

    settings = executor.settings
    core = SchedulerCore(
        Capabilities(prefill_step_size=settings.prefill_step_size, context_size=settings.context_size,
                     max_batch_size=settings.max_batch_size, bucket_starts=executor.bucket_starts),
        tokenizer=info.tokenizer, eos_token_ids=frozenset(),
    )
    clients = _Clients()
    for index in range(batch):
        prompt = tuple(10 + (7 * index + i) % 1000 for i in range(40))
        core.add(NewRequest(request_id=f"r{index}", prompt_tokens=prompt, max_tokens=steps + 64,
                            sampling=SamplingParams(temperature=0.0), cache_context=None,
                            edge_output=edge_output), clients)
    timed = inside = 0.0
    count = 0
    while core.has_work() and count < steps:
        assert core.next_lookup(0.0) is None
        started = time.perf_counter()
        plan = core.schedule()
        result = executor.run_step(plan)
        ran = time.perf_counter()
        core.update(plan, result, clients, 0.0)
        if result.decode_batch_size == batch and not plan.starts:
            count += 1
            if count > 8:  # shapes built
                timed += time.perf_counter() - started
                inside += ran - started
            if count == 8:  # the queue and device counters cover the timed steps only
                _async_eval_seconds[0] = 0.0
                _serial_seconds.update(queue=0.0, device=0.0)
                if profile is not None:
                    profile.enable()
    if profile is not None:
        profile.disable()
    executor.reset()
    return 1000 * timed / (count - 8), 1000 * inside / (count - 8)


_async_eval_seconds = [0.0]


# --serial: seconds inside mx.async_eval (queueing) and in the mx.eval that follows it (the device's work).
_serial_seconds = {"queue": 0.0, "device": 0.0}


def _time_async_eval(serial: bool = False) -> None:
    """Count the seconds spent inside ``mx.async_eval`` (every caller reads it from the module); ``serial``: then
    wait there for what it queued, counted apart."""
    import mlx.core as mx

    original, evaluate = mx.async_eval, mx.eval

    def timed(*args: Any) -> Any:
        started = time.perf_counter()
        try:
            return original(*args)
        finally:
            queued = time.perf_counter()
            _async_eval_seconds[0] += queued - started
            if serial:
                _serial_seconds["queue"] += queued - started
                evaluate(*args)
                _serial_seconds["device"] += time.perf_counter() - queued

    mx.async_eval = timed


def _serial_parts(total_ms: float, steps: int) -> str:
    """``total_ms`` a step as host / queue / device ms (the counters reset)."""
    queue, device = (1000 * _serial_seconds[key] / steps for key in ("queue", "device"))
    _serial_seconds.update(queue=0.0, device=0.0)
    return f"{total_ms:.2f} = {total_ms - queue - device:.2f} + {queue:.2f} + {device:.2f}"


def _unmask_decode(ragged_attention: Any) -> None:
    import mlx.core as mx

    masked = ragged_attention.attention

    def attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any, sinks: Any = None) -> Any:
        if queries.shape[2] == 1 and sinks is None:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=None)
        return masked(queries, keys, values, cache, scale, mask, sinks)

    ragged_attention.attention = attention


def _profiled(title: str, profile: Any, steps: int, shown: int) -> None:
    """The functions with the most time of their own in ``profile``, in us per step."""
    import pstats

    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # type: ignore[attr-defined]
    total = sum(row[1][2] for row in rows)
    print(f"\n{title}: {1e6 * total / steps:.0f} us a step in Python and the MLX calls it makes; most of their own:")
    for (filename, line, name), (_, calls, own, cumulative, _) in rows[:shown]:
        print(f"  {1e6 * own / steps:8.1f} us own {1e6 * cumulative / steps:9.1f} us cum {calls / steps:7.1f} calls "
              f"{Path(filename).name}:{line}({name})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--ragged", default="on", help="the ragged decode kernel: on, off, or on,off (CUDA)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile this many steps of each (0: none)")
    parser.add_argument("--profile-rows", type=int, default=22, help="functions each profile lists")
    parser.add_argument("--serial", action="store_true",
                        help="no overlap: each step evaluated before the next is built, split into host, queue "
                             "and device time")
    parser.add_argument("--in-thread", action="store_true",
                        help="the whole run (loading included) on a thread of its own, as the server's device "
                             "thread runs")
    parser.add_argument("--edge-output", action="store_true",
                        help="the replies' text made at the edge, as with --api-processes (the core relays tokens); "
                             "default: detokenized in the core, as with the edge in the engine's process")
    parser.add_argument("--unmasked-decode", action="store_true",
                        help="an experiment, not a correct step: one-token queries attend with no mask (MLX's "
                             "own kernel), as if no row had padding; what the mask and the ragged kernel cost")
    return parser.parse_args()


def main(args: argparse.Namespace) -> None:
    from mlxcel.blas import load_optimized_blas_in_process

    load_optimized_blas_in_process()  # before MLX loads: on the CPU, the reference BLAS made a 64-row step 13x slower
    import mlx.core as mx
    from decode_step_pieces import pipelined_step_ms
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.model.executor import DeviceSettings, StepExecutor
    from mlxcel.model.loader import default_prefill_step_size, load_model

    _time_async_eval(args.serial)
    loaded = load_model(args.model_path)
    batches = [int(value) for value in args.batches.split(",")]
    if args.serial:
        print("| ragged kernel | B | floor ms: host + queue + device | executor ms: host + queue + device | ratio |")
        print("|---|---|---|---|---|")
    else:
        print("| ragged kernel | B | floor ms | its async_eval ms | executor step ms | inside run_step ms "
              "| its async_eval ms | ratio |")
        print("|---|---|---|---|---|---|---|---|")
    for ragged in args.ragged.split(","):
        from mlxcel.model import ragged_attention

        ragged_attention.uninstall(loaded.model)
        if args.unmasked_decode:
            _unmask_decode(ragged_attention)
        settings = DeviceSettings(model_path=args.model_path, context_size=4096, max_batch_size=max(batches),
                                  prefill_step_size=default_prefill_step_size(), ragged_attention=ragged == "on")
        executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                                tokenizer=loaded.tokenizer)
        for batch in batches:
            executor_step_ms(executor, loaded, batch, 24, edge_output=args.edge_output)  # build the shapes
            step, inside = executor_step_ms(executor, loaded, batch, args.steps, edge_output=args.edge_output)
            executor_parts = _serial_parts(step, args.steps - 8)
            executor_async = 1000 * _async_eval_seconds[0] / (args.steps - 8)
            cache = make_prompt_cache(loaded.model)
            first = mx.argmax(loaded.model(mx.array([[10 + i for i in range(40)]] * batch), cache=cache)[:, -1],
                              axis=-1)
            mx.eval(first)

            def floor_step(tokens: Any, cache: list[Any] = cache) -> Any:
                return mx.argmax(loaded.model(tokens[:, None], cache=cache)[:, -1, :], axis=-1)

            _async_eval_seconds[0] = 0.0
            _serial_seconds.update(queue=0.0, device=0.0)
            floor = pipelined_step_ms(floor_step, first, args.steps)
            floor_async = 1000 * _async_eval_seconds[0] / (args.steps + 9)  # its 8 warm-up steps and the first
            if args.serial:
                print(f"| {ragged} | {batch} | {_serial_parts(floor, args.steps + 9)} | {executor_parts} "
                      f"| {step / floor:.2f}x |", flush=True)
            else:
                print(f"| {ragged} | {batch} | {floor:.2f} | {floor_async:.2f} | {step:.2f} | {inside:.2f} "
                      f"| {executor_async:.2f} | {step / floor:.2f}x |", flush=True)
            if args.profile:
                import cProfile

                profile = cProfile.Profile()
                executor_step_ms(executor, loaded, batch, args.profile + 8, profile, edge_output=args.edge_output)
                _profiled(f"executor, ragged {ragged}, B={batch}", profile, args.profile, args.profile_rows)
                following = floor_step(first)
                profile = cProfile.Profile()
                profile.enable()
                pipelined_step_ms(floor_step, following, args.profile)
                profile.disable()
                _profiled(f"floor, B={batch}", profile, args.profile + 8, args.profile_rows)


if __name__ == "__main__":
    import threading

    arguments = parse_args()
    if arguments.in_thread:
        worker = threading.Thread(target=main, args=(arguments,), name="mlxcel-device")
        worker.start()
        worker.join()
    else:
        main(arguments)
