"""Does a pipelined decode step copy every layer's KV buffer, and what does that cost as the context grows?

Usage: python benchmarks/kv_copy_probe.py --model-path DIR [--batch 64] [--contexts 32,480,1500] [--steps 48]

MLX keeps every input of a queued kernel alive until the kernel has run (on CUDA the command encoder's
temporaries), and a slice update writes in place only into a buffer nothing else holds. So when the next
decode step is queued while the previous one still runs (mlx-lm's ``generate``, the floor), each layer's
one-token KV update may copy the layer's whole buffer. For each context length P this fills a plain
``KVCache`` per layer with P random positions (no prefill), B equal rows, greedy, and prints ms per step in
three orders, with MLX's peak memory over the timed steps above what was in use before them:
  pipelined   the next step queued before this step's tokens are read (the floor's order)
  after-wait  the next step's graph built before the wait, queued after it (nothing holds the buffer then)
  serial      built and queued after the wait
If the pipelined step grows with P faster than the other two, and its peak memory by about one buffer
per layer, the copies are real.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def fill(model: Any, batch: int, context: int, steps: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    args = model.args
    heads = args.num_key_value_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    capacity = (context + steps + KVCache.step) // KVCache.step * KVCache.step  # no growth while timed
    dtype = model.layers[0].self_attn.k_proj.weight.dtype
    caches = []
    for _ in model.layers:
        cache = KVCache()
        cache.keys = mx.random.normal((batch, heads, capacity, head_dim)).astype(dtype)
        cache.values = mx.random.normal((batch, heads, capacity, head_dim)).astype(dtype)
        cache.offset = context
        caches.append(cache)
    mx.eval([(cache.keys, cache.values) for cache in caches])
    return caches


def step_ms(model: Any, caches: list[Any], batch: int, steps: int, order: str) -> tuple[float, float]:
    """(ms per step, peak GB over the timed steps above the memory in use before them)."""
    import mlx.core as mx

    def step(tokens: Any) -> Any:
        return mx.argmax(model(tokens[:, None], cache=caches)[:, -1, :], axis=-1)

    following = step(mx.array([11] * batch))
    mx.async_eval(following)
    for timed in (False, True):
        if timed:
            mx.eval(following)
            mx.reset_peak_memory()
            base = mx.get_active_memory()
        started = time.perf_counter()
        for _ in range(steps if timed else 8):
            if order == "pipelined":
                current, following = following, step(following)
                mx.async_eval(following)
                mx.eval(current)
            elif order == "after-wait":
                current, following = following, step(following)
                mx.eval(current)
                mx.async_eval(following)
            else:
                current = following
                mx.eval(current)
                following = step(current)
                mx.async_eval(following)
                mx.eval(following)
            current.tolist()
        elapsed = time.perf_counter() - started
    mx.eval(following)
    return 1000 * elapsed / steps, (mx.get_peak_memory() - base) / 1e9


def main() -> None:
    from mlx_lm import load

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="32,480,1500")
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    import mlx.core as mx

    model, _tokenizer = load(str(args.model_path))
    orders = ("pipelined", "after-wait", "serial")
    print(f"B = {args.batch}; ms per step (peak GB above the start)")
    print("| context | KV GB | " + " | ".join(orders) + " |")
    print("|---" * (len(orders) + 2) + "|")
    for context in (int(value) for value in args.contexts.split(",")):
        cells = []
        for order in orders:
            caches = fill(model, args.batch, context, 2 * (args.steps + 8))
            kv_gb = sum(cache.keys.nbytes + cache.values.nbytes for cache in caches) / 1e9
            ms, peak = step_ms(model, caches, args.batch, args.steps, order)
            cells.append(f"{ms:.2f} ({peak:.2f})")
            del caches
            mx.clear_cache()
        print(f"| {context} | {kv_gb:.2f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
