"""Float32 1024x1024 matmul throughput on MLX's CPU backend, per BLAS.

Measures this process as it was started, then fresh subprocesses with and
without the optimized BLAS preloaded, and prints the speed-up.

    python benchmarks/blas_matmul.py [--size N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlxcel import blas  # noqa: E402  (after the path fix, before MLX)


def measure(size: int, repeats: int) -> dict[str, object]:
    import mlx.core as mx

    a = mx.random.normal((size, size), dtype=mx.float32)
    b = mx.random.normal((size, size), dtype=mx.float32)
    mx.eval(a, b)
    mx.eval(a @ b)  # warm-up: thread pools, first-touch pages
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(a @ b)
    seconds = (time.perf_counter() - start) / repeats
    return {"gflops": 2 * size**3 / seconds / 1e9, "blas": blas.describe_blas()}


def measure_in_subprocess(size: int, repeats: int, *, preload: str | None) -> dict[str, object]:
    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("LD_PRELOAD", blas.REEXEC_MARKER_ENV)
    }
    if preload is not None:
        environment["LD_PRELOAD"] = preload
    completed = subprocess.run(
        [sys.executable, __file__, "--size", str(size), "--repeats", str(repeats), "--json"],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="measure this process only, print JSON")
    arguments = parser.parse_args()

    if arguments.json:
        print(json.dumps(measure(arguments.size, arguments.repeats)))
        return 0

    size, repeats = arguments.size, arguments.repeats
    here = measure(size, repeats)
    print(f"this process:         {here['gflops']:8.1f} GFLOP/s  ({here['blas']})")
    reference = measure_in_subprocess(size, repeats, preload=None)
    print(f"subprocess, bundled:  {reference['gflops']:8.1f} GFLOP/s  ({reference['blas']})")
    library = blas.find_optimized_blas()
    if library is None:
        print("no optimized BLAS found (install libopenblas0); nothing to compare")
        return 0
    optimized = measure_in_subprocess(size, repeats, preload=library)
    print(f"subprocess, preload:  {optimized['gflops']:8.1f} GFLOP/s  ({optimized['blas']})")
    print(f"speed-up: {optimized['gflops'] / reference['gflops']:.1f}x  ({size}x{size} float32, {repeats} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
