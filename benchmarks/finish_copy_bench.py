"""Reading back and storing a wave of finished rows (extract + detach + eval), with batch_rows' RowView and without.

Usage: python benchmarks/finish_copy_bench.py [--rounds 6]

64 rows of 8 layers (4 heads of 64, 250 positions; gapped: three more written, each row keeping 1-3), each row's
prompt and reply stored as two pieces, as a finished sequence's are: ms of host time building the copies and ms
until they are evaluated, the best and the median of the rounds, beside the floor (MLX copying the same pieces
out of the batch's arrays in one process, nothing read back or stored). On a GPU the count of copy kernels is what
matters (each cost the host about 16 us to queue on an H100); on the CPU the bytes copied are.
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


def floor_all(caches: list[Any]) -> tuple[float, float]:
    """The floor: MLX alone copying the same pieces straight out of the batch's arrays (a slice and a copy, or a
    gather over a gapped row's positions, worked out beforehand), nothing read back or stored."""
    import mlx.core as mx

    spans = []
    for row in range(ROWS):
        gaps = getattr(caches[0], "gaps", None)
        padding = int(caches[0].left_padding[row].item())
        positions = caches[0]._positions(row, padding) if gaps and gaps[row] else None
        length = len(positions) if positions is not None else caches[0]._idx - padding
        pieces = [(0, length - 20), (length - 20, length)]
        spans.append((row, padding, [mx.array(positions[b:e]) for b, e in pieces] if positions else None, pieces))
    mx.eval([chosen for *_, chosen, _ in spans if chosen])
    started = time.perf_counter()
    copies = []
    for row, padding, chosen, pieces in spans:
        for cache in caches:
            for index, (begin, end) in enumerate(pieces):
                for array in (cache.keys, cache.values):
                    if chosen is None:
                        copies.append(mx.contiguous(array[row:row + 1, :, padding + begin:padding + end]))
                    else:
                        copies.append(mx.take(array[row:row + 1], chosen[index], axis=2))
    host = time.perf_counter() - started
    mx.eval(copies)
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
    print("| rows | stored as | host ms, best | total ms, best (/ floor) | total ms, median |")
    print("|---|---|---|---|---|")
    for gapped in (False, True):
        caches = build(gapped)
        results: dict[str, list[tuple[float, float]]] = {
            "RowView": [], "a copy of the row first": [], "floor: MLX copying the pieces alone": []}
        for _round in range(args.rounds):
            for mode, results_of in results.items():
                if mode.startswith("floor"):
                    results_of.append(floor_all(caches))
                else:
                    (batch_rows.install if mode == "RowView" else batch_rows.uninstall)()
                    results_of.append(store_all(caches, row_views=mode == "RowView"))
                gc.collect()
        floor = min(total for _, total in results["floor: MLX copying the pieces alone"])
        for mode, measured in results.items():
            best = min(total for _, total in measured)
            print(f"| {'gapped' if gapped else 'plain'} | {mode} | {min(host for host, _ in measured):.1f} | "
                  f"{best:.1f} ({best / floor:.2f}x) | {statistics.median(total for _, total in measured):.1f} |")


if __name__ == "__main__":
    main()
