"""Reading back and storing a wave of finished rows (extract + detach + eval), with batch_rows' RowView and without.

Usage: python benchmarks/finish_copy_bench.py [--rounds 6]

64 rows of 8 layers (4 heads of 64, 250 positions; gapped: three more written, each row keeping 1-3), each row's
prompt and reply stored as two pieces, as a finished sequence's are: ms of host time building the copies and ms
until they are evaluated, the best and the median of the rounds. On a GPU the count of copy kernels is what
matters (each costs the host about 12 us to queue on an H100); on the CPU the bytes copied are.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

ROWS, LAYERS, HEADS, LENGTH, DIM = 64, 8, 4, 250, 64


def build(gapped: bool) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    from mlxcel.model.gapped_cache import keep_written

    caches = []
    for _ in range(LAYERS):
        cache = BatchKVCache([0] * ROWS)
        keys = mx.random.normal((ROWS, HEADS, LENGTH, DIM))
        cache.update_and_fetch(keys, keys)
        if gapped:
            written = mx.random.normal((ROWS, HEADS, 3, DIM))
            cache.update_and_fetch(written, written)
            keep_written([cache], 3, [1 + row % 3 for row in range(ROWS)])
        caches.append(cache)
    mx.eval([(cache.keys, cache.values) for cache in caches])
    return caches


def _whole(row: Any) -> Any:
    """A gapped row as the gapped cache read it back before RowView: gathered whole, each piece copied from it."""
    from mlx_lm.models.cache import KVCache

    from mlxcel.model.batch_rows import RowView

    if not isinstance(row, RowView):
        return row
    whole = KVCache()
    whole.keys, whole.values, whole.offset = row.keys, row.values, row.offset
    return whole


def store_all(caches: list[Any], row_views: bool) -> tuple[float, float]:
    """(host ms, total ms) to read back every row and store it as prompt and reply pieces."""
    import mlx.core as mx

    from mlxcel.model.kv import detach

    started = time.perf_counter()
    stored = []
    for row in range(ROWS):
        layers = [cache.extract(row) if row_views else _whole(cache.extract(row)) for cache in caches]
        length = layers[0].offset
        stored.append(detach(layers, length, split_at=length - 20, evaluate=False))
    host = time.perf_counter() - started
    mx.eval([payload.arrays() for payload in stored])
    return 1000 * host, 1000 * (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    from mlxcel.blas import load_optimized_blas_in_process

    load_optimized_blas_in_process()
    from mlxcel.model import batch_rows
    from mlxcel.model.kv import EXACT, use_store_format

    use_store_format(EXACT)
    print("| rows | stored as | host ms, best | total ms, best | total ms, median |")
    print("|---|---|---|---|---|")
    for gapped in (False, True):
        caches = build(gapped)
        results: dict[str, list[tuple[float, float]]] = {"RowView": [], "a copy of the row first": []}
        for _round in range(args.rounds):
            for mode, results_of in results.items():
                (batch_rows.install if mode == "RowView" else batch_rows.uninstall)()
                results_of.append(store_all(caches, row_views=mode == "RowView"))
                gc.collect()
        for mode, measured in results.items():
            print(f"| {'gapped' if gapped else 'plain'} | {mode} | {min(host for host, _ in measured):.1f} | "
                  f"{min(total for _, total in measured):.1f} | "
                  f"{statistics.median(total for _, total in measured):.1f} |")


if __name__ == "__main__":
    main()
