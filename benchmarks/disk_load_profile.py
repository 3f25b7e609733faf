"""Where reading KV pieces back from disk goes: file read, checksum, host-to-MLX copy, evaluation on the device.

    python benchmarks/disk_load_profile.py [--pieces 32 --piece-mib 32]

Writes ``--pieces`` files of ``--piece-mib`` MiB of bf16-sized rows to a
temporary directory (read back from the page cache, as a restart on the same
machine mostly does), then times each stage the disk tier runs per piece, and
MLX's own safetensors loader for comparison. Prints one JSON line: MB/s per
stage and in all.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pieces", type=int, default=32)
    parser.add_argument("--piece-mib", type=int, default=32)
    args = parser.parse_args()

    import blake3
    import mlx.core as mx
    import numpy as np

    size = args.piece_mib << 20
    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-profile-") as scratch:
        paths = []
        for index in range(args.pieces):
            path = Path(scratch) / f"piece-{index}.bin"
            path.write_bytes(os.urandom(size))
            paths.append(path)
        rows = (1, 8, size // (8 * 128 * 2), 128)
        stages = dict.fromkeys(("read", "checksum", "to_mlx", "evaluate"), 0.0)
        for path in paths:
            started = time.perf_counter()
            data = path.read_bytes()
            stages["read"] += time.perf_counter() - started
            started = time.perf_counter()
            blake3.blake3(data).hexdigest()
            stages["checksum"] += time.perf_counter() - started
            started = time.perf_counter()
            array = mx.array(np.frombuffer(data, dtype=np.uint16).reshape(rows)).view(mx.bfloat16)
            stages["to_mlx"] += time.perf_counter() - started
            started = time.perf_counter()
            mx.eval(array * 1)  # a device op reads it, as attention will
            stages["evaluate"] += time.perf_counter() - started
        # MLX's own loader on the same bytes as safetensors files.
        safetensors = []
        for index, path in enumerate(paths):
            target = Path(scratch) / f"piece-{index}.safetensors"
            mx.save_safetensors(str(target), {"keys": mx.array(np.frombuffer(path.read_bytes(), dtype=np.uint16))})
            safetensors.append(target)
        started = time.perf_counter()
        for target in safetensors:
            mx.eval(mx.load(str(target))["keys"] * 1)
        native = time.perf_counter() - started
    total_mb = args.pieces * size / 1e6
    rates = {stage: round(total_mb / seconds) for stage, seconds in stages.items()}
    print(json.dumps({"device": str(mx.default_device()), "pieces": args.pieces, "piece_mib": args.piece_mib,
                      "mb_per_s": rates, "all_stages_mb_per_s": round(total_mb / sum(stages.values())),
                      "mx_load_mb_per_s": round(total_mb / native)}), flush=True)


if __name__ == "__main__":
    main()
