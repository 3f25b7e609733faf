"""A KV cache's one-token update, the next step's graph queued before the previous step is done or after it.

CPU box, 2026-12-06 (B=32, 8 heads, 1,500 positions, head size 64, float32: 98 MB a side):
  KVCache serial 0.25 ms; pipelined 105.70 ms; built after the previous finished 0.25 ms;
  built before the wait, queued after it 0.19 ms (BatchKVCache the same).
Queued while the previous step's graph still holds the buffer, the slice update cannot be done in place and
copies the whole buffer. The real model's step (model_probe.py) showed no such penalty on this box
(llama-bench, 16 rows, 200 and 1,500-token prompts: queued before the wait 120.75-143.96 / 258.60-319.34 ms,
after it 118.55-129.47 / 272.67-362.60 ms): whether a GPU step pays it is for executor_decode.py --serial there.
"""
import time

from mlxcel.blas import load_optimized_blas_in_process

load_optimized_blas_in_process()
import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache  # noqa: E402

B, H, D, L = 32, 8, 64, 1500


def make(cls):
    cache = cls() if cls is KVCache else cls([0] * B)
    cache.update_and_fetch(mx.zeros((B, H, L, D)), mx.zeros((B, H, L, D)))
    mx.eval(cache.keys, cache.values)
    return cache


def one(cache):
    keys, values = cache.update_and_fetch(mx.ones((B, H, 1, D)), mx.ones((B, H, 1, D)))
    return (keys[:, :, -1:] * 2).sum() + values[:, :, :1].sum()


for cls in (KVCache, BatchKVCache):
    n = 20
    cache = make(cls)
    started = time.perf_counter()
    for _ in range(n):
        mx.eval(one(cache))
    print(cls.__name__, f"serial {(time.perf_counter() - started) / n * 1e3:.2f} ms")
    for order in ("pipelined", "built before the wait, queued after it"):
        cache = make(cls)
        previous = one(cache)
        mx.async_eval(previous)
        started = time.perf_counter()
        for _ in range(n):
            following = one(cache)
            if order == "pipelined":
                mx.async_eval(following)
                mx.eval(previous)
            else:
                mx.eval(previous)
                mx.async_eval(following)
            previous = following
        mx.eval(previous)
        print(cls.__name__, f"{order} {(time.perf_counter() - started) / n * 1e3:.2f} ms")
