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

- ``warm``: with ``--kv-bits`` (8 or 4, and 0 for the exact baseline in the
  same run), the shared-KV workload through the real store: ``--conversations``
  conversations of three turns over one shared ``--tokens``-token system
  prompt, each turn adding ``--suffix`` tokens, donated as the device donates
  (on the adopted base, so the system prompt is one shared piece), into a
  ``PromptCacheStore`` whose byte budget holds ``--budget-conversations`` of
  them exactly; then how many conversations' last turn still hits past the
  system prompt, per format, and adoption of a warm turn (dequantizing) in ms.

    python benchmarks/shared_kv.py [--layers 32 --kv-heads 8 --head-dim 128 --tokens 8192 --dtype bfloat16]
    python benchmarks/shared_kv.py --kv-bits 8 4 [--conversations 64 --budget-conversations 16]
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
    parser.add_argument("--kv-bits", type=int, nargs="*", default=None,
                        help="run the warm-conversations case for these formats (with 0, exact, as the baseline)")
    parser.add_argument("--kv-group-size", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--budget-conversations", type=int, default=16)
    args = parser.parse_args()
    if args.kv_bits is not None:
        warm_conversations(args)
        return

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


def warm_conversations(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlxcel.cache.key import CacheContext
    from mlxcel.cache.store import PromptCacheStore, StoreLimits
    from mlxcel.model.kv import StoreFormat, adopt, detach, use_store_format

    gpu = mx.default_device() != mx.cpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    system, turn = args.tokens, args.suffix
    full = system + 3 * turn
    shape = (1, args.kv_heads, full, args.head_dim)
    # One conversation's rows, reused for all (the store sees only tokens and bytes; the pieces are real).
    caches = []
    for _ in range(args.layers):
        cache = KVCache()
        cache.keys, cache.values = mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
        cache.offset = full
        caches.append(cache)
    mx.eval([cache.keys for cache in caches] + [cache.values for cache in caches])
    exact_bytes_per_conversation = 2 * args.layers * args.kv_heads * args.head_dim * dtype.size * 3 * turn
    exact_system_bytes = 2 * args.layers * args.kv_heads * args.head_dim * dtype.size * system
    budget = exact_system_bytes + args.budget_conversations * exact_bytes_per_conversation
    context = CacheContext(model_id="bench", template_sig="t")
    results = {}
    for bits in sorted(set(args.kv_bits) | {0}):
        use_store_format(StoreFormat(bits, args.kv_group_size))
        store = PromptCacheStore(StoreLimits(capacity_bytes=budget, max_entries=100_000, min_prefix=16))
        shared = detach(caches, system)
        assert shared is not None
        prompt = tuple(range(system))
        store.insert(context, prompt, shared, shared.nbytes, 0.0)
        now = 1.0
        histories = {index: prompt for index in range(args.conversations)}
        bases = dict.fromkeys(histories, shared)
        for step in range(3):
            for index in range(args.conversations):
                tokens = histories[index] + tuple(10_000_000 + index * 10_000 + step * turn + offset
                                                  for offset in range(turn))
                found = store.lookup(context, tokens, now)
                base = found.payload.cut(found.matched_len) if found is not None else None
                donated = detach(caches, len(tokens), base=base)
                assert donated is not None
                store.insert(context, tokens, donated, donated.nbytes, now)
                histories[index], bases[index] = tokens, donated
                now += 1.0
        store.take_released()
        warm = 0
        for index in range(args.conversations):
            found = store.lookup(context, histories[index] + (1,), now, record=False)
            if found is not None and found.matched_len > system:
                warm += 1
        stored = bases[args.conversations - 1]
        adopt_ms = []
        for _ in range(args.runs):
            started = time.perf_counter()
            adopted = adopt(stored, stored.length, room=turn)
            mx.eval([cache.keys for cache in adopted] + [cache.values for cache in adopted])
            adopt_ms.append((time.perf_counter() - started) * 1e3)
        results[bits] = warm
        stats = store.stats(now)
        print(json.dumps({"case": "warm", "kv_bits": bits, "kv_group_size": args.kv_group_size,
                          "conversations": args.conversations, "budget_bytes": budget, "warm": warm,
                          "warm_vs_exact": round(warm / max(1, results[0]), 3),
                          "unique_bytes": stats.bytes,
                          "adopt_warm_turn_ms": round(statistics.median(adopt_ms), 3),
                          "tokens": stored.length, "device": str(mx.default_device()), "dtype": str(dtype)}),
              flush=True)
        del store, shared, bases, stored
    use_store_format(StoreFormat())


if __name__ == "__main__":
    main()
