"""Ways to apply per-row LoRA updates in one batched pass, timed on one adapted projection.

Usage: python benchmarks/lora_row_options.py [--shape fixture|8b] [--rows 16] [--tokens 1] [--depth 16]

One linear layer (the fixture's q_proj, 64 -> 64, or the 8B shape's, 4096 -> 4096)
with two rank-R adapters; the rows of a batch spread over four
configurations (none, A, B, A+B), as benchmarks/lora_configs.py runs them.
Each option computes the base matmul once for the batch and every row's
low-rank update at its own scales:

- base: the base matmul alone (no adapter: the floor);
- per-row scales: every adapter over every row, its scale a (rows, 1, 1)
  array that is 0 for rows not using it (mlx-lm's LoRALinear with an array
  as its scale);
- concatenated: the adapters' matrices concatenated along the rank, one
  pair of matmuls for all of them, each row's scales a (rows, 1, rank sum)
  array over the rank columns;
- gathered rows: each adapter over only the rows using it (``mx.take``),
  its update added back at those rows (``.at[].add``);
- gather_mm: one ``mx.gather_mm`` over every (row, adapter) pair, the
  adapters' matrices stacked, then added back at the pairs' rows.

Reports microseconds per layer (--depth layers chained per evaluation, build
and evaluate; median of --rounds interleaved rounds) and, for each,
the largest difference from a row-by-row reference.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel.blas import describe_blas, reexec_with_optimized_blas  # noqa: E402

SHAPES = {"fixture": (64, 64, 4), "8b": (4096, 4096, 8)}
# Per configuration, each adapter's multiplier.
CONFIGS = [(0.0, 0.0), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="fixture")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per row (1: a decode step)")
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--depth", type=int, default=16, help="layers chained in one evaluation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="activations and base weights (default: float32 on the CPU, bfloat16 on a GPU)")
    arguments = parser.parse_args()
    reexec_with_optimized_blas()
    import mlx.core as mx

    print(describe_blas())
    dtype_name = arguments.dtype or ("float32" if mx.default_device() == mx.cpu else "bfloat16")
    dtype = getattr(mx, dtype_name)
    input_dims, output_dims, rank = SHAPES[arguments.shape]
    rows, tokens = arguments.rows, arguments.tokens
    mx.random.seed(0)
    weight = (mx.random.normal((output_dims, input_dims)) / input_dims**0.5).astype(dtype)
    # Adapter matrices stay float32, as mlx-lm saves and serves them.
    lora_a = [mx.random.normal((input_dims, rank)) / input_dims**0.5 for _ in range(2)]
    lora_b = [mx.random.normal((rank, output_dims)) * 0.05 for _ in range(2)]
    trained = [20.0, 20.0]
    x = mx.random.normal((rows, tokens, input_dims)).astype(dtype)
    mx.eval(weight, lora_a, lora_b, x)
    row_configs = [CONFIGS[row % len(CONFIGS)] for row in range(rows)]

    def scales_of(adapter: int) -> list[float]:
        return [trained[adapter] * config[adapter] for config in row_configs]

    # Each option: what it builds once per forward pass (from the rows' configurations), and one layer.
    def no_pass() -> None:
        return None

    def base(x: mx.array, _pass: None) -> mx.array:
        return x @ weight.T

    def per_row_pass() -> list[mx.array]:
        return [mx.array(scales_of(adapter)).reshape(rows, 1, 1) for adapter in range(2)]

    def per_row_scales(x: mx.array, scales: list[mx.array]) -> mx.array:
        y = x @ weight.T
        for adapter in range(2):
            z = (x @ lora_a[adapter]) @ lora_b[adapter]
            y = y + (scales[adapter] * z).astype(x.dtype)
        return y

    concatenated_a, concatenated_b = mx.concatenate(lora_a, axis=1), mx.concatenate(lora_b, axis=0)

    def concatenated_pass() -> mx.array:
        return mx.array([[scales_of(adapter)[row] for adapter in range(2) for _ in range(rank)]
                         for row in range(rows)]).reshape(rows, 1, 2 * rank)

    def concatenated(x: mx.array, columns: mx.array) -> mx.array:
        y = x @ weight.T
        z = ((x @ concatenated_a) * columns) @ concatenated_b
        return y + z.astype(x.dtype)

    def gathered_pass() -> list[tuple[mx.array, mx.array]]:
        found = []
        for adapter in range(2):
            used = [row for row, scale in enumerate(scales_of(adapter)) if scale]
            found.append((mx.array(used), mx.array([scales_of(adapter)[row] for row in used]).reshape(-1, 1, 1)))
        return found

    def gathered_rows(x: mx.array, gathered: list[tuple[mx.array, mx.array]]) -> mx.array:
        y = x @ weight.T
        for adapter, (index, scale) in enumerate(gathered):
            z = (mx.take(x, index, axis=0) @ lora_a[adapter]) @ lora_b[adapter]
            y = y.at[index].add((scale * z).astype(x.dtype))
        return y

    stacked_a, stacked_b = mx.stack(lora_a), mx.stack(lora_b)

    def gather_mm_pass() -> tuple[mx.array, mx.array, mx.array]:
        pairs = [(row, adapter, scale) for adapter in range(2)
                 for row, scale in enumerate(scales_of(adapter)) if scale]
        return (mx.array([row for row, _adapter, _scale in pairs], dtype=mx.uint32),
                mx.array([adapter for _row, adapter, _scale in pairs], dtype=mx.uint32),
                mx.array([scale for _row, _adapter, scale in pairs]).reshape(len(pairs), 1, 1))

    def gather_mm(x: mx.array, pairs: tuple[mx.array, mx.array, mx.array]) -> mx.array:
        pair_rows, pair_adapters, pair_scales = pairs
        y = x @ weight.T
        z = mx.gather_mm(x, stacked_a, lhs_indices=pair_rows, rhs_indices=pair_adapters)
        z = mx.gather_mm(z, stacked_b, rhs_indices=pair_adapters)
        return y.at[pair_rows].add((pair_scales * z).astype(x.dtype))

    def reference(x: mx.array) -> mx.array:
        out = []
        for row in range(rows):
            y = x[row:row + 1] @ weight.T
            for adapter in range(2):
                if scales_of(adapter)[row]:
                    z = (x[row:row + 1] @ lora_a[adapter]) @ lora_b[adapter]
                    y = y + (scales_of(adapter)[row] * z).astype(x.dtype)
            out.append(y)
        return mx.concatenate(out)

    expected = reference(x)
    print(f"shape {arguments.shape} ({input_dims} -> {output_dims}, rank {rank}), {rows} rows x {tokens} tokens, "
          f"{dtype_name}, {arguments.depth} layers per evaluation")
    options: dict[str, tuple[Callable[[], Any], Callable[[mx.array, Any], mx.array]]] = {
        "base": (no_pass, base), "per-row scales": (per_row_pass, per_row_scales),
        "concatenated": (concatenated_pass, concatenated), "gathered rows": (gathered_pass, gathered_rows),
        "gather_mm": (gather_mm_pass, gather_mm),
    }
    timings: dict[str, list[float]] = {name: [] for name in options}

    def chained(prepare: Callable[[], Any], layer: Callable[[mx.array, Any], mx.array]) -> mx.array:
        # Layers in a row, as in a model: the pass's arrays built once, one evaluation's fixed cost spread.
        built = prepare()
        y = x
        for _ in range(arguments.depth):
            y = layer(y, built)
        return y

    for _round in range(arguments.rounds):  # interleaved rounds; the median round is reported
        for name, option in options.items():
            for _ in range(5):
                mx.eval(chained(*option))
            started = time.perf_counter()
            for _ in range(arguments.iterations):
                mx.eval(chained(*option))
            elapsed = time.perf_counter() - started
            timings[name].append(elapsed / arguments.iterations / arguments.depth * 1e6)
    floor = statistics.median(timings["base"])
    for name, option in options.items():
        micros = statistics.median(timings[name])
        prepare, layer = option
        error = "" if name == "base" else f"  max |diff| {mx.abs(layer(x, prepare()) - expected).max().item():.2e}"
        print(f"{name:>15}: {micros:8.1f} us  (+{micros - floor:7.1f} us over base){error}")


if __name__ == "__main__":
    main()
