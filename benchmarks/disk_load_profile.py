"""Where reading KV pieces back from disk goes: file read, checksum, host-to-MLX copy, evaluation on the device.

    python benchmarks/disk_load_profile.py [--pieces 32 --piece-mib 32]
    python benchmarks/disk_load_profile.py --end-to-end [--tokens 8192 --layers 32 --kv-heads 8 --head-dim 128]

Writes ``--pieces`` files of ``--piece-mib`` MiB of bf16-sized rows to a
temporary directory (read back from the page cache, as a restart on the same
machine mostly does), then times each stage the disk tier runs per piece, and
MLX's own safetensors loader for comparison. Prints one JSON line: MB/s per
stage and in all.

With ``--end-to-end`` it measures the disk tier itself instead: a stored
prefix of ``--tokens`` tokens of the given KV shape (Llama-3.1-8B's by
default, bf16) is written through ``DiskTier`` and ``DeviceDisk``, a new tier
indexes the directory (a restart), and ``DeviceDisk.load`` reads the disk hit
back, evaluated on the device: the rate a restart hit pays, best of
``--repeats``.
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
    parser.add_argument("--end-to-end", action="store_true", help="measure DiskTier + DeviceDisk.load")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--kv-bits", type=int, default=0, help="store the pieces quantized (0: exact)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--read-ahead", default="3", help="comma list: reader threads / pieces verified ahead")
    parser.add_argument("--hash-threads", default="auto", help="comma list: threads per checksum (auto or N)")
    parser.add_argument("--no-verify-ceiling", action="store_true",
                        help="also run once without checksums (a ceiling, not a way the tier reads)")
    parser.add_argument("--via", choices=("mx-load", "mapped-copy"), default="mx-load",
                        help="how the tier brings a verified piece into MLX: MLX's reader (now), or a copy per "
                             "tensor out of the mapped file (before 2026-12-03)")
    args = parser.parse_args()
    if args.end_to_end:
        end_to_end(args)
        return

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
        # The host-to-MLX copy on READ_AHEAD threads at once: does it scale (MLX holds the GIL while it
        # copies), and what does the device's first read of the arrays cost after it?
        import concurrent.futures

        datas = [path.read_bytes() for path in paths]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            started = time.perf_counter()
            arrays = list(pool.map(lambda data: mx.array(np.frombuffer(data, dtype=np.uint16).reshape(rows)), datas))
            threaded_copy = time.perf_counter() - started
        started = time.perf_counter()
        mx.eval([array * 1 for array in arrays])
        threaded_evaluate = time.perf_counter() - started
        del arrays
    total_mb = args.pieces * size / 1e6
    stages["to_mlx_3_threads"], stages["evaluate_after_threads"] = threaded_copy, threaded_evaluate
    rates = {stage: round(total_mb / seconds) for stage, seconds in stages.items()}
    print(json.dumps({"device": str(mx.default_device()), "pieces": args.pieces, "piece_mib": args.piece_mib,
                      "mb_per_s": rates, "all_stages_mb_per_s": round(total_mb / sum(stages[stage] for stage in
                                                                   ("read", "checksum", "to_mlx", "evaluate"))),
                      "mx_load_mb_per_s": round(total_mb / native)}), flush=True)


def _mapped_copy(path: Path, entries: list) -> dict:
    """The tier's read before 2026-12-03: the file memory-mapped, one MLX copy per tensor out of it."""
    import mmap

    import mlx.core as mx
    import numpy as np

    from mlxcel.disk.index import decode_header

    with open(path, "rb") as file:
        view = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    _metadata, _tensors, data_start = decode_header(view, len(view))
    host = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}
    arrays = {}
    for entry in entries:
        data = np.frombuffer(view[data_start + entry.start:data_start + entry.end], dtype=host[entry.dtype])
        array = mx.array(data.reshape(entry.shape))
        arrays[entry.name] = array.view(mx.bfloat16) if entry.dtype == "BF16" else array
    return arrays


def end_to_end(args: argparse.Namespace) -> None:
    import logging
    import resource

    import mlx.core as mx

    from mlxcel.cache.key import CacheContext
    from mlxcel.disk.device import DeviceDisk
    from mlxcel.disk.directory import DiskSettings
    from mlxcel.disk.tier import DiskTier
    from mlxcel.model.kv import DetachedKV

    logging.getLogger("mlxcel").setLevel(logging.ERROR)  # the tier's start-up lines, once per run
    if args.via == "mapped-copy":
        import mlxcel.disk.device

        mlxcel.disk.device._load_verified = _mapped_copy  # type: ignore[assignment]
    context = CacheContext(model_id="profile", template_sig="t")
    tokens = tuple(range(1000, 1000 + args.tokens))
    shape = (1, args.kv_heads, args.tokens, args.head_dim)
    layers = [(mx.random.normal(shape).astype(mx.bfloat16), mx.random.normal(shape).astype(mx.bfloat16))
              for _ in range(args.layers)]
    if args.kv_bits:
        from mlx_lm.models.cache import KVCache

        from mlxcel.model.kv import StoreFormat, detach, use_store_format

        use_store_format(StoreFormat(args.kv_bits))
        caches = []
        for keys, values in layers:
            cache = KVCache()
            cache.keys, cache.values, cache.offset = keys, values, args.tokens
            caches.append(cache)
        quantized = detach(caches, args.tokens)
        assert quantized is not None
        stored = quantized
    else:
        stored = DetachedKV.whole(layers, args.tokens)
    mx.eval(stored.arrays())
    quantization = {"kv_bits": args.kv_bits} if args.kv_bits else {}

    def tier_at(directory: Path) -> DiskTier:
        settings = DiskSettings(directory=directory, budget_bytes=1 << 40, write_bytes_per_second=1 << 40,
                                **quantization)
        tier = DiskTier(settings, "profile-model")
        tier.open()
        return tier

    with tempfile.TemporaryDirectory(prefix="mlxcel-disk-profile-") as scratch:
        directory = Path(scratch) / "kv"
        writer = tier_at(directory)
        device = DeviceDisk(writer, args.layers)
        device.persist(stored, writer.plan_write(context, tokens), urgent=False)
        while device.has_work():
            device.work()
        writer.close(600)
        del stored, layers
        request = (*tokens, 1)
        variants = [(int(ahead), hash_threads) for ahead in args.read_ahead.split(",")
                    for hash_threads in args.hash_threads.split(",")]
        if args.no_verify_ceiling:
            variants.append((int(args.read_ahead.split(",")[0]), "none"))
        for ahead, hash_threads in variants:
            _configure(ahead, hash_threads)
            runs = []
            for _ in range(args.repeats):
                tier = tier_at(directory)  # a restart: a new tier indexes the directory
                plan = tier.probe(context, request, len(request) - 1, 0)
                assert plan is not None
                cpu_before = resource.getrusage(resource.RUSAGE_SELF)
                started = time.perf_counter()
                loaded = DeviceDisk(tier, args.layers).load(plan, None)
                assert loaded is not None
                mx.eval(loaded.arrays())
                seconds = time.perf_counter() - started
                # The device's first read of every byte: on CUDA a copy made on the host moves to the GPU here.
                read_started = time.perf_counter()
                mx.eval([mx.sum(array) for array in loaded.arrays()])
                device_read = time.perf_counter() - read_started
                cpu_after = resource.getrusage(resource.RUSAGE_SELF)
                cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
                stats = tier.statistics(rescan=False)
                runs.append((seconds, stats.bytes_read, loaded.length, cpu, device_read, stats.verify_wait_seconds))
                tier.close()
                del loaded
            seconds, nbytes, length, _cpu, device_read, verify_wait = min(runs, key=lambda run: run[0] + run[4])
            print(json.dumps({"device": str(mx.default_device()), "mode": "end_to_end", "tokens": length,
                              "read_ahead": ahead, "hash_threads": hash_threads,
                              "tokens_per_s": round(length / seconds),
                              "kv_bits": args.kv_bits, "bytes_read": nbytes, "seconds": round(seconds, 4),
                              "verify_wait_seconds": round(verify_wait, 4),
                              "gb_per_s": round(nbytes / seconds / 1e9, 3), "via": args.via,
                              "device_read_seconds": round(device_read, 4),
                              "gb_per_s_with_device_read": round(nbytes / (seconds + device_read) / 1e9, 3),
                              "seconds_all": [round(run[0], 4) for run in runs],
                              # CPU seconds of every thread: the work, whatever the machine's load.
                              "cpu_seconds_best": round(min(run[3] for run in runs), 4)}), flush=True)


def _configure(read_ahead: int, hash_threads: str) -> None:
    """One variant of the read path, set through the modules' constants (checksums off: a ceiling only)."""
    import blake3

    import mlxcel.disk.directory
    import mlxcel.disk.reader

    mlxcel.disk.reader.READ_AHEAD = read_ahead
    if hash_threads == "none":
        mlxcel.disk.reader.check_sum = lambda *_: None  # type: ignore[assignment]
        return
    mlxcel.disk.reader.check_sum = mlxcel.disk.directory.check_sum  # type: ignore[assignment]
    mlxcel.disk.directory.HASH_THREADS = blake3.blake3.AUTO if hash_threads == "auto" else int(hash_threads)


if __name__ == "__main__":
    main()
