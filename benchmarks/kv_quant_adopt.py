"""What the quantized store's layouts cost the device: detaching (quantizing) and adopting (dequantizing).

Random KV of a real shape (no model), one stored prefix of ``--tokens`` rows in
every layer, per format: exact, plain ``mx.quantize`` groups, and the default
Hadamard-rotated groups (mlxcel/model/kv.py), at 8 and 4 bits. Median of
``--runs`` of ``detach`` (the copy out of the cache, evaluated) and of
``adopt`` plus evaluating the caches' arrays (what a warm hit pays before its
prefill; exact adoption of one piece is views, so it costs about nothing here
and the batch merge pays the copy). One JSON line per format.

    PYTHONPATH=. python3 -m benchmarks.kv_quant_adopt [--layers 32 --kv-heads 8 --head-dim 128 --tokens 8192]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--pieces", type=int, default=1,
                        help="store the prefix as this many pieces (a disk hit's 256-token files: tokens / 256)")
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.model import kv_dequant
    from mlxcel.model.kv import EXACT, StoreFormat, adopt, detach, use_store_format

    gpu = mx.default_device() != mx.cpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    caches = []
    for _ in range(args.layers):
        cache = KVCache()
        cache.keys, cache.values = mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
        cache.offset = args.tokens
        caches.append(cache)
    mx.eval([cache.keys for cache in caches] + [cache.values for cache in caches])

    def timed(run) -> float:
        times = []
        for _ in range(args.runs + 1):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    formats = [EXACT] + [StoreFormat(bits, args.group_size, rotated=rotated)
                         for bits in (8, 4) for rotated in (False, True)]
    for store_format in formats:
        use_store_format(store_format)
        stored = detach(caches, args.tokens)
        assert stored is not None
        if args.pieces > 1:  # the same rows as consecutive pieces, each grown from the one before
            edges = [round(args.tokens * index / args.pieces) for index in range(args.pieces + 1)]
            stored = None
            for end in edges[1:]:
                stored = detach(caches, end, base=stored)
            assert stored is not None and len(stored.segments) == args.pieces

        def adopt_all(stored=stored) -> None:
            adopted = adopt(stored, args.tokens)
            mx.eval([cache.keys for cache in adopted] + [cache.values for cache in adopted])

        detach_ms = timed(lambda: detach(caches, args.tokens))
        # Rotated groups on CUDA: MLX's operations, then the fused kernel (mlxcel/model/kv_dequant.py).
        for fused in (False, True) if store_format.rotated and mx.cuda.is_available() else (None,):
            if fused is not None:
                kv_dequant.ENABLED = fused
            adopt_ms = timed(adopt_all)
            print(json.dumps({
                "bits": store_format.bits, "group_size": store_format.group_size,
                "layout": "exact" if not store_format.quantized else ("rotated" if store_format.rotated else "plain"),
                "fused_kernel": fused,
                "tokens": args.tokens, "pieces": args.pieces, "stored_gib": round(stored.nbytes / 2**30, 4),
                "detach_ms": round(detach_ms, 2), "adopt_ms": round(adopt_ms, 2),
                "device": str(mx.default_device()), "dtype": str(dtype),
            }), flush=True)
        kv_dequant.ENABLED = True
    use_store_format(EXACT)


if __name__ == "__main__":
    main()
