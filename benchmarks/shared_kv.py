"""What shared KV storage costs the device: adoption from several pieces, and detaching with a base.

A stored prefix is a list of pieces (mlxcel/model/kv.py). Adopting it from
one piece gives the new sequence views (no copy); from several, one
concatenation per layer. Detaching a finished sequence on a base copies only
the rows past the base. This measures both on synthetic KV of a real shape
(no model: the arrays are random), median of ``--runs``, and prints one JSON
line per case:

- ``adopt``: ``adopt(stored, n)`` plus evaluating the caches' arrays, for
  the prefix held in 1, 2, 4 and 16 pieces; ms and ms per adopted GiB; and
  ``with_first_write_ms``: adopting with room and writing ``--suffix`` new
  rows, as a direct start does (from one piece the write copies the views
  into a new buffer; from several the assembled buffer is written in place);
- ``detach``: a sequence of ``--tokens`` rows detached whole (a copy of
  everything) and on a base covering all but its last ``--suffix`` rows.

    python benchmarks/shared_kv.py [--layers 32 --kv-heads 8 --head-dim 128 --tokens 8192 --dtype bfloat16]
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
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.model.kv import DetachedKV, KvPiece, adopt, detach

    gpu = mx.default_device() != mx.cpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))

    def rows(length: int) -> list[tuple[mx.array, mx.array]]:
        shape = (1, args.kv_heads, length, args.head_dim)
        return [(mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype))
                for _ in range(args.layers)]

    def timed(run) -> float:
        times = []
        for _ in range(args.runs + 1):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]) * 1e3

    total = args.tokens
    for count in (1, 2, 4, 16):
        size = total // count
        pieces = [KvPiece(rows(size), size) for _ in range(count)]
        mx.eval([array for piece in pieces for pair in piece.layers for array in pair])
        stored = DetachedKV([(piece, size) for piece in pieces])

        def adopt_all(stored=stored) -> None:
            caches = adopt(stored, stored.length)
            # The batch merge copies the adopted rows; here an evaluation stands in for it.
            mx.eval([cache.keys for cache in caches] + [cache.values for cache in caches])

        new_rows = rows(args.suffix)
        mx.eval([array for pair in new_rows for array in pair])

        def adopt_and_write(stored=stored, new_rows=new_rows) -> None:
            # A direct start: adopt with room, then write its new tokens (what a hit really pays).
            caches = adopt(stored, stored.length, room=args.suffix)
            mx.eval([cache.update_and_fetch(*pair) for cache, pair in zip(caches, new_rows, strict=True)])

        ms = timed(adopt_all)
        written_ms = timed(adopt_and_write)
        gib = stored.nbytes / 2**30
        print(json.dumps({"case": "adopt", "pieces": count, "tokens": stored.length, "gib": round(gib, 3),
                          "ms": round(ms, 3), "ms_per_gib": round(ms / gib, 3),
                          "with_first_write_ms": round(written_ms, 3), "device": str(mx.default_device()),
                          "dtype": str(dtype)}), flush=True)
        del pieces, stored

    caches = []
    for keys, values in rows(total + 256):  # step-padded, as a batch's caches are
        cache = KVCache()
        cache.keys, cache.values, cache.offset = keys, values, total
        caches.append(cache)
    mx.eval([cache.keys for cache in caches] + [cache.values for cache in caches])
    base = detach(caches, total - args.suffix)
    assert base is not None
    whole_ms = timed(lambda: detach(caches, total))
    based_ms = timed(lambda: detach(caches, total, base=base))
    print(json.dumps({"case": "detach", "tokens": total, "suffix": args.suffix, "whole_ms": round(whole_ms, 3),
                      "on_base_ms": round(based_ms, 3), "ratio": round(based_ms / whole_ms, 4),
                      "device": str(mx.default_device())}), flush=True)


if __name__ == "__main__":
    main()
