"""The ragged decode attention kernel (mlxcel/model/ragged_attention.py) against MLX's masked attention, on CUDA.

Usage: python benchmarks/ragged_attention_check.py

1. Agreement: random queries, keys and values (keys and values slices of a larger cache buffer, as
   mlx-lm's caches hand them over), each row with its own left padding; prints the largest difference
   from ``mx.fast.scaled_dot_product_attention`` with the same boolean mask, per dtype and shape.
   With several queries a row (a speculative verify pass), the mask is causal as well.
2. Time of one layer's attention, ms: MLX with the mask (its unfused fallback), the ragged kernel, and
   MLX without a mask (the fused kernel a plain cache gets; the floor), at 1, 16 and 64 rows.
3. A verify pass (5 queries a row), ms: MLX with the mask, each call a new key length (as verify steps
   are: cuDNN plans are built per shape), against the ragged kernel.
"""

from __future__ import annotations

import time
from typing import Any


def _case(batch: int, heads: int, kv_heads: int, dim: int, length: int, dtype: Any, seed: int = 0,
          count: int = 1) -> tuple:
    import mlx.core as mx

    mx.random.seed(seed)
    capacity = length + 37
    queries = mx.random.normal((batch, heads, count, dim)).astype(dtype)
    keys = mx.random.normal((batch, kv_heads, capacity, dim)).astype(dtype)[..., 5:5 + length, :]
    values = mx.random.normal((batch, kv_heads, capacity, dim)).astype(dtype)[..., 5:5 + length, :]
    padding = mx.random.randint(0, max(1, length - 1), (batch,))
    padding = mx.where(mx.arange(batch) == 0, 0, padding)
    mask = mx.expand_dims(padding, (1, 2, 3)) <= mx.arange(length)[None, None, None]
    if count > 1:
        mask = mask & (mx.arange(length - count, length)[:, None] >= mx.arange(length)[None])
    mx.eval(queries, keys, values, mask)
    return queries, keys, values, mask


def _ms(fn: Any, repeats: int = 50) -> float:
    import mlx.core as mx

    for _ in range(5):
        mx.eval(fn())
    started = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return 1000 * (time.perf_counter() - started) / repeats


def main() -> None:
    import mlx.core as mx

    from mlxcel.model.ragged_attention import ragged_attention, supported

    print("| dtype | B | queries | heads/kv | D | keys | max abs diff | supported |")
    print("|---|---|---|---|---|---|---|---|")
    worst = 0.0
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        for (batch, heads, kv_heads, dim, length), count in (
            ((1, 32, 8, 128, 37), 1), ((5, 32, 8, 128, 300), 1), ((64, 32, 8, 128, 1000), 1),
            ((3, 32, 8, 64, 8200), 1), ((7, 14, 2, 64, 129), 1), ((4, 16, 16, 96, 77), 1),
            ((1, 32, 8, 128, 2100), 5), ((16, 32, 8, 128, 700), 5), ((3, 14, 2, 64, 40), 8),
        ):
            queries, keys, values, mask = _case(batch, heads, kv_heads, dim, length, dtype, count=count)
            scale = dim ** -0.5
            expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
            got = ragged_attention(queries, keys, values, scale=scale, mask=mask)
            diff = mx.max(mx.abs(expected.astype(mx.float32) - got.astype(mx.float32))).item()
            if dtype == mx.float32:
                worst = max(worst, diff)
            print(f"| {dtype} | {batch} | {count} | {heads}/{kv_heads} | {dim} | {length} | {diff:.2e} | "
                  f"{supported(queries, keys, values, mask)} |", flush=True)
    print(f"float32 worst difference: {worst:.2e}")

    print("\n| B | keys | masked (MLX fallback) | ragged | unmasked fused (floor) |")
    print("|---|---|---|---|---|")
    for length in (256, 8192):
        for batch in (1, 16, 64):
            queries, keys, values, mask = _case(batch, 32, 8, 128, length, mx.bfloat16)
            scale = 128 ** -0.5
            masked = _ms(lambda: mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask))
            ragged = _ms(lambda: ragged_attention(queries, keys, values, scale=scale, mask=mask))
            fused = _ms(lambda: mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale))
            print(f"| {batch} | {length} | {masked:.3f} | {ragged:.3f} | {fused:.3f} |", flush=True)

    print("\n| verify pass: B | keys | masked, a new key length each call | ragged |")
    print("|---|---|---|---|")
    for length in (2048, 8192):
        for batch in (1, 16):
            cases = [_case(batch, 32, 8, 128, length + step, mx.bfloat16, count=5) for step in range(12)]
            scale = 128 ** -0.5
            timings = {}
            for name, attend in (("masked", mx.fast.scaled_dot_product_attention), ("ragged", ragged_attention)):
                started = time.perf_counter()
                for queries, keys, values, mask in cases:
                    mx.eval(attend(queries, keys, values, scale=scale, mask=mask))
                timings[name] = 1000 * (time.perf_counter() - started) / len(cases)
            print(f"| {batch} | {length} | {timings['masked']:.3f} | {timings['ragged']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
