"""Ways to bring a disk hit's verified safetensors pieces into MLX, and what the device's first read costs after.

    python benchmarks/disk_copy_options.py [--pieces 24 --layers 32]

Writes ``--pieces`` files of Llama-8B-shaped KV rows (32 layers x keys and values, 512 tokens, bf16; 64 MiB
each), reads them once (the page cache holds them, as after a restart on the same machine), then brings all of
them into MLX three ways, best of ``--repeats``:

  mapped copy     what the tier does: the file memory-mapped, one ``mx.array`` copy per tensor, one thread
  mapped, 3 thr.  the same copies on three threads (MLX holds the GIL while it copies: does it scale?)
  mx.load         MLX's own safetensors reader, evaluated (C++, the GIL released), one thread

(MLX 0.32's streams are per thread: an array made by an op on another thread's stream cannot be read on this
one, so ``mx.load`` on reader threads is not an option; a copy from numpy makes no op.)

and then the time of one device op reading every array (on CUDA, the pages' move to the GPU). Prints MB/s.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import mmap
import os
import tempfile
import time
from typing import Any


def main() -> None:
    import mlx.core as mx
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=24)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    def mapped(path: str) -> list[Any]:
        # uint16 bits: a view as bfloat16 is an op, which must be made on the thread that reads it
        with open(path, "rb") as file:
            view = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
        length = int.from_bytes(view[:8], "little")
        header = json.loads(bytes(view[8:8 + length]))
        base = 8 + length
        return [mx.array(np.frombuffer(view[base + entry["data_offsets"][0]:base + entry["data_offsets"][1]],
                                       dtype=np.uint16).reshape(entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"]

    def loaded(path: str) -> list[Any]:
        arrays = list(mx.load(path).values())
        mx.eval(arrays)
        return arrays

    with tempfile.TemporaryDirectory(prefix="mlxcel-copy-options-") as scratch:
        paths = []
        for index in range(args.pieces):
            path = os.path.join(scratch, f"piece-{index}.safetensors")
            mx.save_safetensors(path, {
                f"layer{layer}.{part}": mx.array(np.random.randint(0, 1 << 15, size=(1, 8, 512, 128),
                                                                   dtype=np.uint16)).view(mx.bfloat16)
                for layer in range(args.layers) for part in ("keys", "values")})
            paths.append(path)
        megabytes = sum(os.path.getsize(path) for path in paths) / 1e6
        for path in paths:
            with open(path, "rb") as file:
                file.read()
        figures: dict[str, Any] = {"device": str(mx.default_device()), "megabytes": round(megabytes)}
        ways = {
            "mapped_copy": lambda: [mapped(path) for path in paths],
            "mapped_copy_3_threads": lambda: list(pool.map(mapped, paths)),
            "mx_load": lambda: [loaded(path) for path in paths],
        }
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            for name, way in ways.items():
                best_in, best_read = float("inf"), float("inf")
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    pieces = way()
                    arrays = [array for piece in pieces for array in piece]  # each way returns them evaluated
                    middle = time.perf_counter()
                    mx.eval([mx.sum(array) for array in arrays])  # the device reads every byte once
                    ended = time.perf_counter()
                    best_in, best_read = min(best_in, middle - started), min(best_read, ended - middle)
                    del pieces, arrays
                figures[name] = {"into_mlx_mb_per_s": round(megabytes / best_in),
                                 "device_first_read_mb_per_s": round(megabytes / best_read),
                                 "both_mb_per_s": round(megabytes / (best_in + best_read))}
                print(json.dumps({name: figures[name]}), flush=True)
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
