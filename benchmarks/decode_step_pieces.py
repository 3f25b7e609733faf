"""Where a batched decode step's time goes: mlx-lm's BatchGenerator against the plain step, piece by piece.

Usage: python benchmarks/decode_step_pieces.py --model-path DIR [--batches 1,16,64] [--steps 64]

Each variant decodes B equal rows after a 32-token prompt, greedy, the next step built while the
previous one runs (mlx_lm.generate's pattern), and prints ms per step:
  plain          a KVCache per layer (int offsets, no mask): the floor
  batch-cache    mlx-lm's BatchKVCache (per-row offsets, a causal mask array each step)
  + logprobs     and the full-vocabulary log-softmax, split into one array per row (as BatchGenerator does)
  generator      mlx-lm's BatchGenerator itself (B prompts inserted, steps timed once all decode)
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
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    model, _tokenizer = load(str(args.model_path))
    prompt = [10 + i for i in range(32)]
    print("| B | plain | batch-cache | + logprobs | generator |")
    print("|---|---|---|---|---|")
    for batch in (int(value) for value in args.batches.split(",")):
        rows = mx.array([prompt] * batch)
        results = []
        for variant in ("plain", "batch-cache", "logprobs"):
            if variant == "plain":
                cache: list[Any] = make_prompt_cache(model)
            else:
                cache = [BatchKVCache([0] * batch) for _ in make_prompt_cache(model)]
            first = mx.argmax(model(rows, cache=cache)[:, -1, :], axis=-1)

            def step(tokens: Any, cache: list[Any] = cache, variant: str = variant) -> Any:
                tokens = tokens[0] if isinstance(tokens, tuple) else tokens
                logits = model(tokens[:, None], cache=cache)[:, -1, :]
                if variant != "logprobs":
                    return mx.argmax(logits, axis=-1)
                logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
                return (mx.argmax(logprobs, axis=-1), *list(logprobs))

            results.append(pipelined_step_ms(step, first, args.steps))
        generator = BatchGenerator(model, completion_batch_size=max(batch, 8), prefill_batch_size=max(batch, 8))
        generator.insert([prompt] * batch, max_tokens=[args.steps + 40] * batch)
        for _ in range(24):  # prefill, then decode shapes built
            generator.next()
        started = time.perf_counter()
        for _ in range(args.steps):
            generator.next()
        results.append(1000 * (time.perf_counter() - started) / args.steps)
        generator.close()
        print(f"| {batch} | " + " | ".join(f"{value:.2f}" for value in results) + " |", flush=True)


if __name__ == "__main__":
    main()
