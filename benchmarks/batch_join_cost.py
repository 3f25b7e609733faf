"""What joining and leaving mlx-lm's decode batch costs when its rows hold long contexts (issue 28).

    python benchmarks/batch_join_cost.py [--rows 8,16,32] [--context 8192] [--layers 32]

mlx-lm's ``BatchKVCache.extend`` (new rows join) concatenates every layer's keys and values, so a join copies
the whole batch's KV; ``filter`` (rows leave) gathers the kept rows, a copy as well, at a gather's speed
(mlxcel's ``filter_by_slices`` keeps them by slices and one concatenation: timed beside it). With the 8B KV shape (8 KV
heads of 128, bf16: 128 KiB a token over 32 layers) and 64 conversations of 8k tokens the batch holds ~70 GB.
This times, per batch size: 4 rows of the same context joining, the middle row leaving (mlx-lm's gather and
mlxcel's slices), the last row leaving (slices: the result is a slice, which the next write copies once),
each leave with the next step's write, and one decode-sized write alone (a token per row, the in-place update
a step makes) for comparison. Milliseconds, best of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlxcel.model.batch_rows import filter_by_slices

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="8,16,32")
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dtype = mx.bfloat16 if mx.default_device() != mx.cpu else mx.float32

    def batch(rows: int) -> list[BatchKVCache]:
        caches = []
        for _ in range(args.layers):
            cache = BatchKVCache([0] * rows)
            shape = (rows, args.kv_heads, args.context, args.head_dim)
            cache.update_and_fetch(mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype))
            token = mx.zeros((rows, args.kv_heads, 1, args.head_dim), dtype=dtype)
            cache.update_and_fetch(token, token)  # grows the buffer by 256 positions (a copy), so later writes fit
            caches.append(cache)
        mx.eval([(cache.keys, cache.values) for cache in caches])
        return caches

    def best(action) -> float:
        times = []
        for _ in range(args.repeats):
            times.append(action())
        return round(min(times), 2)

    for rows in map(int, args.rows.split(",")):
        def join() -> float:
            caches, joining = batch(rows), batch(4)
            started = time.perf_counter()
            for cache, other in zip(caches, joining, strict=True):
                cache.extend(other)
            mx.eval([(cache.keys, cache.values) for cache in caches])
            return 1000 * (time.perf_counter() - started)

        def leave(keep: list[int], by_slices: bool) -> float:
            caches = batch(rows)
            token = mx.zeros((len(keep), args.kv_heads, 1, args.head_dim), dtype=dtype)
            mx.eval(token)
            started = time.perf_counter()
            for cache in caches:
                if by_slices:
                    filter_by_slices(cache, keep)
                else:
                    BatchKVCache.filter(cache, keep)
                # The next step's write: a slice left by the filter is copied here.
                cache.update_and_fetch(token, token)
            mx.eval([(cache.keys, cache.values) for cache in caches])
            return 1000 * (time.perf_counter() - started)

        def write() -> float:
            caches = batch(rows)
            token = mx.zeros((rows, args.kv_heads, 1, args.head_dim), dtype=dtype)
            mx.eval(token)
            started = time.perf_counter()
            for cache in caches:
                cache.update_and_fetch(token, token)
            mx.eval([(cache.keys, cache.values) for cache in caches])
            return 1000 * (time.perf_counter() - started)

        middle = [row for row in range(rows) if row != rows // 2]
        gigabytes = rows * args.context * args.layers * args.kv_heads * args.head_dim * 2 * dtype.size / 1e9
        print(json.dumps({"rows": rows, "context": args.context, "batch_kv_gb": round(gigabytes, 2),
                          "join_4_rows_ms": best(join),
                          "middle_row_leaves_gather_ms": best(lambda: leave(middle, False)),
                          "middle_row_leaves_slices_ms": best(lambda: leave(middle, True)),
                          "last_row_leaves_slices_ms": best(lambda: leave(list(range(rows - 1)), True)),
                          "decode_write_ms": best(write)}), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
