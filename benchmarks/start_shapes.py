"""Hits of varied lengths through the device actor's admitting step, with and without shape buckets.

A stream of hits, each resuming a stored prefix of a random length P and
running S random new tokens, goes through ``_StepWorker.run_step`` (adopt,
forward pass, first token) in one process: first unbucketed, then with
bucketed starts, on the same (P, S) list, each twice. The first pass pays
whatever the backend builds per new shape (on CUDA a cuDNN attention plan
per query/key length pair); the second shows the steady cost of each mode.
Prints one JSON line per mode and pass (median, p90, mean and the median of
each quarter of the stream, seconds).

With ``--cold`` the stream is of never-seen prompts of random lengths
(``--min-cold``..``--max-cold`` tokens), each timed from its admission to its
first token over as many steps as it takes; a third line per pass gives the
raw prefill of the same prompts (mlx-lm's way, in chunks of 2048, each prompt
run twice and the second timed, so no first-use cost) and the median of
server-path / raw per prompt.

    python benchmarks/start_shapes.py --model-path DIR [--requests 24] [--cold]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run_pass(worker: Any, stored: Any, requests: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> list[float]:
    """Seconds of each admitting step; a request is (cached tokens, new tokens), resumed from ``stored``."""
    from mlxcel.actors.messages import AdmitSequence, RemoveSequence, RunStep
    from mlxcel.types import SamplingParams

    times = []
    for sequence_id, (cached, new) in enumerate(requests):
        admission = AdmitSequence(sequence_id=sequence_id, prompt_tokens=new, cached_tokens=cached, adopted=stored,
                                  sampling=SamplingParams(temperature=0.0), max_tokens=4)
        start = time.perf_counter()
        done = worker.run_step(RunStep(admit=(admission,), reply_to=None))  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        assert done.error is None and done.sampled, done
        worker.run_step(RunStep(remove=(RemoveSequence(sequence_id=sequence_id, donate=False),),
                                reply_to=None))  # type: ignore[arg-type]
    return times


def run_cold_pass(worker: Any, prompts: list[tuple[int, ...]]) -> list[float]:
    """Seconds from each cold prompt's admission to its first token, through as many steps as it takes."""
    from mlxcel.actors.messages import AdmitSequence, RemoveSequence, RunStep
    from mlxcel.types import SamplingParams

    times = []
    for sequence_id, prompt in enumerate(prompts):
        admission = AdmitSequence(sequence_id=sequence_id, prompt_tokens=prompt, cached_tokens=(),
                                  sampling=SamplingParams(temperature=0.0), max_tokens=4)
        step = RunStep(admit=(admission,), reply_to=None)  # type: ignore[arg-type]
        start = time.perf_counter()
        while True:
            done = worker.run_step(step)
            assert done.error is None, done.error
            if any(token.sequence_id == sequence_id for token in done.sampled):
                break
            step = RunStep(reply_to=None)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
        worker.run_step(RunStep(remove=(RemoveSequence(sequence_id=sequence_id, donate=False),),
                                reply_to=None))  # type: ignore[arg-type]
    return times


def raw_prefill_times(model: Any, prompts: list[tuple[int, ...]], step: int = 2048) -> list[float]:
    """mlx-lm's prefill of each prompt to its first greedy token; the second of two runs is timed."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    times = []
    for prompt in prompts:
        for run in range(2):
            cache = make_prompt_cache(model)
            start = time.perf_counter()
            for offset in range(0, len(prompt) - 1, step):
                model(mx.array(prompt[offset:min(offset + step, len(prompt) - 1)])[None], cache=cache)
                mx.eval([c.state for c in cache])
            token = mx.argmax(model(mx.array(prompt[-1:])[None], cache=cache)[:, -1, :], axis=-1)
            mx.eval(token)
            if run:
                times.append(time.perf_counter() - start)
    return times


def describe(times: list[float], **fields: Any) -> str:
    import mlx.core as mx

    ordered = sorted(times)
    return json.dumps({
        "device": str(mx.default_device()), **fields, "requests": len(times),
        "median_s": round(statistics.median(times), 4),
        "p90_s": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "mean_s": round(statistics.fmean(times), 4),
        "median_by_quarter_s": [round(statistics.median(times[i * len(times) // 4:(i + 1) * len(times) // 4]), 4)
                                for i in range(4)],
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--min-cached", type=int, default=6000)
    parser.add_argument("--max-cached", type=int, default=8400)
    parser.add_argument("--min-new", type=int, default=60)
    parser.add_argument("--max-new", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cold", action="store_true", help="never-seen whole prompts instead of hits")
    parser.add_argument("--modes", nargs="+", choices=("unbucketed", "bucketed"), default=["unbucketed", "bucketed"])
    parser.add_argument("--prefix-align", type=int, default=None,
                        help="START_PREFIX_ALIGN for the bucketed mode (default: the device actor's)")
    parser.add_argument("--min-cold", type=int, default=8000)
    parser.add_argument("--max-cold", type=int, default=8400)
    options = parser.parse_args()

    from mlxcel.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.actors import device
    from mlxcel.actors.device import DeviceSettings
    from mlxcel.model.executor import StepExecutor
    from mlxcel.model.kv import detach

    if options.prefix_align is not None:
        device.START_PREFIX_ALIGN = options.prefix_align
    model, _tokenizer = load(options.model_path)
    rng = random.Random(options.seed)
    if options.cold:
        return cold_main(model, rng, options)
    prefix = [rng.randrange(100, 30000) for _ in range(options.max_cached)]
    cache = make_prompt_cache(model)
    model(mx.array(prefix)[None], cache=cache)
    stored = detach(cache, len(prefix))
    del cache
    cases = [(rng.randint(options.min_cached, options.max_cached), rng.randint(options.min_new, options.max_new))
             for _ in range(options.requests)]
    for bucket in (mode == "bucketed" for mode in options.modes):
        settings = DeviceSettings(model_path=Path(options.model_path), prefill_step_size=2048, bucket_starts=bucket)
        worker = StepExecutor(model, set(), settings)
        for attempt in (1, 2):
            words = random.Random(options.seed + attempt)
            requests = [(tuple(prefix[:cached]), tuple(words.randrange(100, 30000) for _ in range(new)))
                        for cached, new in cases]
            print(describe(run_pass(worker, stored, requests), bucketed=bucket, prefix_align=device.START_PREFIX_ALIGN,
                           **{"pass": attempt}), flush=True)
    return 0


def cold_main(model: Any, rng: random.Random, options: argparse.Namespace) -> int:
    from mlxcel.actors.device import DeviceSettings
    from mlxcel.model.executor import StepExecutor

    lengths = [rng.randint(options.min_cold, options.max_cold) for _ in range(options.requests)]
    for bucket in (mode == "bucketed" for mode in options.modes):
        settings = DeviceSettings(model_path=Path(options.model_path), prefill_step_size=2048, bucket_starts=bucket)
        worker = StepExecutor(model, set(), settings)
        worker.warm_up()  # as the server does at start-up
        for attempt in (1, 2):
            words = random.Random(f"cold/{options.seed}/{bucket}/{attempt}")  # never seen: new texts every pass
            prompts = [tuple(words.randrange(100, 30000) for _ in range(length)) for length in lengths]
            times = run_cold_pass(worker, prompts)
            raw = raw_prefill_times(model, prompts)
            print(describe(times, cold=True, bucketed=bucket, **{"pass": attempt}), flush=True)
            print(json.dumps({"raw_prefill_median_s": round(statistics.median(raw), 4),
                              "median_over_raw": round(statistics.median(t / r for t, r in zip(times, raw)), 3)}),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
