"""Where a warm turn's time-to-first-token goes, layer by layer, in one process.

Four measurements of the same kind of hit (a stored prefix plus a short new
suffix), each median of ``--runs``:

1. floor: mlx-lm primitives on a ``KVCache`` already holding the prefix
   (what ``mlxcel.bench.floor`` measures);
2. generator: mlx-lm's ``BatchGenerator`` seeded with a stored prefix
   (``mlxcel.model.kv.adopt``), ``next()`` until the first generated token;
   the time of each ``next()`` call is shown, since a hit takes several;
3. device step: the device actor's admitting step for such a hit, alone
   (adopt, the suffix's forward pass, the first token), with the last
   token's logits in the same pass or a second one;
4. engine: ``Engine.stream`` on a warm turn (conversation N's turn 1 after
   its turn 0), time to the first delta, with the device time of the steps
   it waited for (the rest is router, scheduler, cache store and Trio).

HTTP is not included: ``mlxcel bench`` measures it against a real server.

    python benchmarks/hit_path.py --model-path DIR [--system-tokens 8000 --user-tokens 128]
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

from mlxcel.bench.workload import Shape, add_shape_arguments, build_workload  # noqa: E402


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompts(tokenizer: Any, workload: Any, conversation: int) -> tuple[list[int], list[int]]:
    replies = list(workload.stand_in_replies[conversation])
    previous = render(tokenizer, workload.messages(conversation, 0, []))
    current = render(tokenizer, workload.messages(conversation, 1, replies[:1]))
    assert current[: len(previous)] == previous, "the template does not extend the previous prompt"
    return previous, current


def measure_floor(model: Any, previous: list[int], suffix: list[int], runs: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    model(mx.array(previous)[None], cache=cache)
    mx.eval([c.state for c in cache])
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        model(mx.array(suffix[:-1])[None], cache=cache)
        logits = model(mx.array(suffix[-1:])[None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        int(token.item())
        times.append(time.perf_counter() - start)
        for layer in cache:
            layer.trim(len(suffix))
    return statistics.median(times[1:])


def measure_generator(model: Any, previous: list[int], suffix: list[int], runs: int,
                      prefill_step_size: int, *, donate: bool = False, clear_cache: bool = True) -> dict[str, Any]:
    """``donate`` copies the prompt's KV out when its prefill ends (as the engine does);
    ``clear_cache=False`` stubs out mlx-lm's ``mx.clear_cache()`` calls to price them."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.model.kv import adopt, detach

    cache = make_prompt_cache(model)
    model(mx.array(previous)[None], cache=cache)
    mx.eval([c.state for c in cache])
    stored = detach(cache, len(previous))
    assert stored is not None
    generator = BatchGenerator(model, prefill_step_size=prefill_step_size)
    real_clear = mx.clear_cache
    if not clear_cache:
        mx.clear_cache = lambda: None
    totals, per_call = [], []
    for _ in range(runs + 1):
        start = time.perf_counter()
        calls = []
        (uid,) = generator.insert([suffix], max_tokens=[4], caches=[adopt(stored, len(previous))],
                                  all_tokens=[list(previous)])
        while True:
            tic = time.perf_counter()
            prompt_responses, generated = generator.next()
            if donate and any(response.end_of_prompt for response in prompt_responses):
                caches, tokens = generator.extract_cache([uid])[uid]
                detach(caches, len(tokens))
            calls.append(time.perf_counter() - tic)
            if generated:
                break
        totals.append(time.perf_counter() - start)
        per_call.append(calls)
        generator.remove([uid])
    mx.clear_cache = real_clear
    return {
        "median_s": statistics.median(totals[1:]),
        "next_calls_s": [round(statistics.median(call[i] for call in per_call[1:]), 5)
                         for i in range(len(per_call[1]))],
    }


def measure_device_step(model: Any, previous: list[int], suffix: list[int], runs: int, prefill_step_size: int,
                        *, one_pass: bool) -> float:
    """The device actor's admitting step alone (adopt, forward pass, first token): no Trio, no store."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from benchmarks.start_shapes import run_pass
    from mlxcel.actors.device import DeviceSettings
    from mlxcel.model.executor import StepExecutor
    from mlxcel.model.kv import detach

    cache = make_prompt_cache(model)
    model(mx.array(previous)[None], cache=cache)
    stored = detach(cache, len(previous))
    del cache
    settings = DeviceSettings(model_path=Path("."), prefill_step_size=prefill_step_size, one_pass_starts=one_pass)
    worker = StepExecutor(model, set(), settings)
    times = run_pass(worker, stored, [(tuple(previous), tuple(suffix))] * (runs + 1))
    return statistics.median(times[1:])


def measure_engine(model_path: str, workload: Any, runs: int, prefill_step_size: int | None,
                   pause: float = 0.0) -> dict[str, Any]:
    """``pause``: seconds between a conversation's turn 0 ending and its turn 1 being sent."""
    import trio

    from mlxcel.actors import device
    from mlxcel.config import EngineConfig, SchedulerConfig
    from mlxcel.engine import open_engine
    from mlxcel.types import ChatRequest, SamplingParams

    step_log: list[tuple[float, float, int]] = []
    original = device._StepWorker.run_step

    def timed_run_step(self: Any, step: Any) -> Any:
        start = time.perf_counter()
        done = original(self, step)
        step_log.append((start, time.perf_counter(), len(step.admit)))
        return done

    device._StepWorker.run_step = timed_run_step  # type: ignore[method-assign]
    config = EngineConfig(model_path=Path(model_path),
                          scheduler=SchedulerConfig(prefill_step_size=prefill_step_size))
    sampling = SamplingParams(max_tokens=workload.shape.reply_tokens, temperature=0.0)
    rows: list[dict[str, Any]] = []
    step_times: list[list[float]] = []

    async def first_delta(engine: Any, messages: list[dict[str, str]]) -> tuple[float, str, Any]:
        request = ChatRequest(messages=tuple(messages), sampling=sampling, stream=True, include_usage=True)
        start = time.perf_counter()
        first = None
        text = []
        usage = None
        async with engine.stream(request) as deltas:
            async for delta in deltas:
                if first is None and delta.text:
                    first = time.perf_counter() - start
                text.append(delta.text)
                usage = delta.usage or usage
        return start, "".join(text), (first, usage)

    async def main() -> None:
        async with open_engine(config) as engine:
            for conversation in range(runs + 1):
                _start, reply, _ = await first_delta(engine, workload.messages(conversation, 0, []))
                await trio.sleep(pause)
                del step_log[:]
                start, _text, (ttft, usage) = await first_delta(engine, workload.messages(conversation, 1, [reply]))
                end = start + ttft
                steps = [(a, b, n) for a, b, n in step_log if a < end]
                device_s = sum(min(b, end) - a for a, b, _n in steps)
                first_admit = next((a for a, _b, n in steps if n), end)
                step_times.append([round(min(b, end) - a, 5) for a, b, _n in steps])
                rows.append({"ttft_s": ttft, "device_s": device_s, "steps": len(steps),
                             "before_first_step_s": first_admit - start,
                             "cached": usage.cached_tokens, "prompt": usage.prompt_tokens})

    trio.run(main)
    device._StepWorker.run_step = original  # type: ignore[method-assign]
    warm = rows[1:]
    summary: dict[str, Any] = {key: round(statistics.median(row[key] for row in warm), 5)
                               for key in ("ttft_s", "device_s", "steps", "before_first_step_s", "cached", "prompt")}
    summary["step_s"] = step_times[1:]
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    add_shape_arguments(parser, counts=False)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefill-step-size", type=int, default=None)
    parser.add_argument("--skip", nargs="*", default=(), choices=("floor", "generator", "step", "engine"))
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds between turn 0's end and turn 1 (engine measurement)")
    options = parser.parse_args(argv)

    from mlxcel.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas()
    import mlx.core as mx
    from mlx_lm import load

    from mlxcel.model.loader import default_prefill_step_size

    shape = Shape(conversations=options.runs + 1, turns=2, system_tokens=options.system_tokens,
                  user_tokens=options.user_tokens, reply_tokens=options.reply_tokens)
    workload = build_workload(shape, model_path=options.model_path)
    step = options.prefill_step_size or default_prefill_step_size()
    result: dict[str, Any] = {"device": str(mx.default_device()), "prefill_step_size": step}
    if not {"floor", "generator", "step"} <= set(options.skip):
        model, tokenizer = load(options.model_path)
        previous, current = prompts(tokenizer, workload, 0)
        suffix = current[len(previous):]
        result.update(prefix_tokens=len(previous), suffix_tokens=len(suffix))
        if "floor" not in options.skip:
            result["floor_s"] = round(measure_floor(model, previous, suffix, options.runs), 5)
        if "step" not in options.skip:
            for one_pass in (False, True):
                result[f"device_step_{'one' if one_pass else 'two'}_pass_s"] = round(
                    measure_device_step(model, previous, suffix, options.runs, step, one_pass=one_pass), 5)
        if "generator" not in options.skip:
            result["generator"] = measure_generator(model, previous, suffix, options.runs, step)
            result["generator_donating"] = measure_generator(model, previous, suffix, options.runs, step,
                                                             donate=True)
            result["generator_no_clear_cache"] = measure_generator(model, previous, suffix, options.runs,
                                                                   step, clear_cache=False)
        del model
        mx.clear_cache()
    if "engine" not in options.skip:
        result["engine"] = measure_engine(options.model_path, workload, options.runs, options.prefill_step_size,
                                          options.pause)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
