"""Where a batched decode step's time goes: mlx-lm's BatchGenerator against the plain step, piece by piece.

Usage: python benchmarks/decode_step_pieces.py --model-path DIR [--batches 1,16,64] [--steps 64]

Each variant decodes B equal rows after a 32-token prompt, greedy, the next step built while the
previous one runs (mlx_lm.generate's pattern), and prints ms per step:
  plain          a KVCache per layer (int offsets, no mask): the floor
  batch-cache    mlx-lm's BatchKVCache (per-row offsets, a causal mask array each step)
  + logprobs     and the full-vocabulary log-softmax, split into one array per row (as BatchGenerator does)
  generator      mlx-lm's BatchGenerator itself (B prompts inserted, steps timed once all decode)
With --ragged (CUDA), batch-cache and generator run again with mlxcel's ragged decode attention
(mlxcel/model/ragged_attention.py) in place of MLX's unfused masked fallback.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def pipelined_step_ms(step: Any, first: Any, steps: int) -> float:
    """ms per step of ``step`` fed its own output, the next step built before this one's tokens are read."""
    import mlx.core as mx

    following = step(first)
    mx.async_eval(following)
    for timed in (False, True):
        started = time.perf_counter()
        for _ in range(steps if timed else 8):
            current, following = following, step(following)
            mx.async_eval(following)
            mx.eval(current)
            (current[0] if isinstance(current, tuple) else current).tolist()
    return 1000 * (time.perf_counter() - started) / steps


def main() -> None:
    from mlx_lm import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--ragged", action="store_true")
    args = parser.parse_args()
    model, _tokenizer = load(str(args.model_path))
    prompt = [10 + i for i in range(32)]
    variants = ["plain", "batch-cache", "logprobs", "generator"]
    if args.ragged:
        variants += ["ragged batch-cache", "ragged generator"]
    print("| B | " + " | ".join(variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for batch in (int(value) for value in args.batches.split(",")):
        print(f"| {batch} | " + " | ".join(f"{value:.2f}" for value in _row(model, prompt, batch, args)) + " |",
              flush=True)


def _generator_ms(model: Any, prompt: list[int], batch: int, steps: int) -> float:
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, completion_batch_size=max(batch, 8), prefill_batch_size=max(batch, 8))
    generator.insert([prompt] * batch, max_tokens=[steps + 40] * batch)
    for _ in range(24):  # prefill, then decode shapes built
        generator.next()
    started = time.perf_counter()
    for _ in range(steps):
        generator.next()
    generator.close()
    return 1000 * (time.perf_counter() - started) / steps


def _row(model: Any, prompt: list[int], batch: int, args: Any) -> list[float]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    from mlxcel.model import ragged_attention

    rows = mx.array([prompt] * batch)
    results = []
    for variant in ("plain", "batch-cache", "logprobs", "generator", "ragged batch-cache", "ragged generator"):
        if variant.startswith("ragged"):
            if not args.ragged:
                break
            ragged_attention.install(model)
        if variant.endswith("generator"):
            results.append(_generator_ms(model, prompt, batch, args.steps))
            continue
        cache: list[Any] = make_prompt_cache(model)
        if variant != "plain":
            cache = [BatchKVCache([0] * batch) for _ in cache]
        first = mx.argmax(model(rows, cache=cache)[:, -1, :], axis=-1)

        def step(tokens: Any, cache: list[Any] = cache, variant: str = variant) -> Any:
            tokens = tokens[0] if isinstance(tokens, tuple) else tokens
            logits = model(tokens[:, None], cache=cache)[:, -1, :]
            if variant != "logprobs":
                return mx.argmax(logits, axis=-1)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return (mx.argmax(logprobs, axis=-1), *list(logprobs))

        results.append(pipelined_step_ms(step, first, args.steps))
    ragged_attention.uninstall(model)
    return results


if __name__ == "__main__":
    main()
