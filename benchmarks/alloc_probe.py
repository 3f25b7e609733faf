"""What a batch cache's big copies cost on the device: fresh buffers against buffers MLX's cache hands back.

Usage: python benchmarks/alloc_probe.py [--rows 64] [--layers 32] [--positions 256] [--repeats 3]

The slow decode steps of a 64-stream round (docs/benchmarks.md, issue 28's nineteenth pass) are the ones that
copy the whole batch's KV into new buffers: a start pass joining, the buffers growing by mlx-lm's 256
positions, finished rows filtered out. This times, for the 8B shape's KV (8 heads of 128, bf16) at ROWS rows,
each layer's keys and values grown from POSITIONS to twice as many positions as mlx-lm grows them
(``concatenate`` with zeros), evaluated at once: first into fresh memory (MLX's buffer cache emptied), then
again with the freed buffers of the same sizes in MLX's cache, and a plain elementwise pass over the same bytes
into fresh and cached buffers; each with the memory MLX reports.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import mlx.core as mx

    shape = (args.rows, 8, args.positions, 128)
    cache = [(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
             for _ in range(args.layers)]
    mx.eval(cache)
    grown_bytes = 2 * sum(keys.nbytes + values.nbytes for keys, values in cache)

    def timed(make: Callable[[], list[Any]]) -> float:
        started = time.perf_counter()
        out = make()
        mx.eval(out)
        seconds = time.perf_counter() - started
        del out
        return seconds

    def grow() -> list[Any]:
        return [mx.concatenate([side, mx.zeros(shape, dtype=side.dtype)], axis=2)
                for keys, values in cache for side in (keys, values)]

    def scale() -> list[Any]:
        return [side * 2 for keys, values in cache for side in (keys, values)]

    print(f"{args.rows} rows x {args.layers} layers, {args.positions} -> {2 * args.positions} positions: "
          f"{grown_bytes / 1e9:.2f} GB of grown buffers")
    for name, make, nbytes in (("grow (concatenate)", grow, grown_bytes), ("elementwise pass", scale,
                                                                          grown_bytes // 2)):
        for repeat in range(args.repeats):
            mx.clear_cache()
            fresh = timed(make)
            cached = timed(make)  # the buffers just freed are in MLX's cache now
            print(f"{name}, round {repeat}: fresh {1000 * fresh:.1f} ms ({nbytes / fresh / 1e9:.0f} GB/s), "
                  f"cached {1000 * cached:.1f} ms ({nbytes / cached / 1e9:.0f} GB/s); MLX cache "
                  f"{mx.get_cache_memory() / 1e9:.2f} GB, active {mx.get_active_memory() / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
