"""Where the engine's resident memory goes on the multi-turn chat workload, in one process.

Runs ``mlxcel bench``'s workload (N conversations x T turns, one request at a
time, turns interleaved, each turn built from the engine's own earlier
replies) through ``Engine.stream`` in this process, with a thread sampling
every ``--interval`` seconds:

- RSS (VmRSS, split into anonymous and file-backed) and the high-water mark
  (VmHWM) from /proc/self/status;
- MLX's active memory (live arrays), cache memory (its buffer pool) and peak;
- the glibc heap: ``mallinfo2()``'s in-use bytes and free bytes held by
  malloc (``fordblks``; freed by C code but not given back to the OS).

It prints the figures at each phase (imports, engine started, after every
turn), the peak and what MLX held at the peak, and the median warm TTFT.
"Other" is RSS minus MLX active minus MLX cache minus the RSS before MLX held
anything (interpreter, libraries, tokenizer): mostly freed memory that
malloc keeps.

Knobs, to price fixes without editing the engine (all off by default):

    --cache-limit-mib N      mx.set_cache_limit(N MiB) at start
    --clear-cache step|turn  mx.clear_cache() after every device step / turn
    --malloc-trim step|turn  glibc malloc_trim(0) after every device step / turn
    --capacity-mib N         the prompt store's byte budget (default: model-aware)

glibc's own tunables (``MALLOC_ARENA_MAX``, ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``) can be set in the environment as usual.

    python benchmarks/rss_profile.py --model-path DIR [--conversations 6 --turns 5]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel.bench.workload import Shape, add_shape_arguments, build_workload  # noqa: E402

MIB = 1024**2


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):
        return None


LIBC = _libc()


def status_kib(*fields: str) -> dict[str, int]:
    values = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in fields:
                values[name] = int(rest.split()[0]) * 1024
    return values


def snapshot() -> dict[str, int]:
    import mlx.core as mx

    figures = status_kib("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads")
    figures.update(active=mx.get_active_memory(), cache=mx.get_cache_memory(), mlx_peak=mx.get_peak_memory())
    if LIBC is not None:
        info = LIBC.mallinfo2()
        # arena: heap bytes from sbrk/arenas; hblkhd: bytes in mmapped chunks.
        figures.update(malloc_used=info.uordblks + info.hblkhd, malloc_free=info.fordblks)
    return figures


class Sampler:
    """Keeps the sample with the largest RSS (and the latest one)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.peak: dict[str, int] = {"VmRSS": 0}
        self.phase = "start"
        self.peak_phase = "start"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-sampler")

    def sample(self) -> dict[str, int]:
        figures = snapshot()
        if figures["VmRSS"] > self.peak["VmRSS"]:
            self.peak, self.peak_phase = figures, self.phase
        return figures

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()


def row(label: str, figures: dict[str, int], base_rss: int, store_bytes: int | None = None) -> str:
    other = figures["VmRSS"] - figures["active"] - figures["cache"] - base_rss
    text = (f"{label:<14} rss {figures['VmRSS'] / MIB:7.0f}  hwm {figures['VmHWM'] / MIB:7.0f}  "
            f"anon {figures['RssAnon'] / MIB:6.0f}  mlx active {figures['active'] / MIB:6.0f}  "
            f"cache {figures['cache'] / MIB:4.0f}  peak {figures['mlx_peak'] / MIB:6.0f}  "
            f"other {other / MIB:6.0f}")
    if "malloc_free" in figures:
        text += f"  malloc free {figures['malloc_free'] / MIB:5.0f}"
    if store_bytes is not None:
        text += f"  store {store_bytes / MIB:5.0f}"
    return text


def install_step_hooks(clear_cache: bool, malloc_trim: bool) -> None:
    """After every device step (on the device thread): clear MLX's pool and/or trim malloc."""
    import mlx.core as mx

    from mlxcel.actors import device

    original = device._StepWorker.run_step

    def run_step(self: Any, step: Any) -> Any:
        done = original(self, step)
        if clear_cache:
            mx.clear_cache()
        if malloc_trim and LIBC is not None:
            LIBC.malloc_trim(0)
        return done

    device._StepWorker.run_step = run_step  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    add_shape_arguments(parser)
    parser.add_argument("--interval", type=float, default=0.02, help="sampling period, seconds")
    parser.add_argument("--cache-limit-mib", type=float, default=None)
    parser.add_argument("--clear-cache", choices=("step", "turn"), default=None)
    parser.add_argument("--malloc-trim", choices=("step", "turn"), default=None)
    parser.add_argument("--capacity-mib", type=float, default=None)
    parser.add_argument("--json", action="store_true", help="also print a JSON summary line")
    options = parser.parse_args(argv)

    from mlxcel.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas()
    import mlx.core as mx
    import trio

    from mlxcel.config import EngineConfig, PromptCacheConfig
    from mlxcel.engine import open_engine
    from mlxcel.types import ChatRequest, SamplingParams

    shape = Shape(conversations=options.conversations, turns=options.turns, system_tokens=options.system_tokens,
                  user_tokens=options.user_tokens, reply_tokens=options.reply_tokens)
    workload = build_workload(shape, model_path=options.model_path)
    if options.cache_limit_mib is not None:
        mx.set_cache_limit(int(options.cache_limit_mib * MIB))
    if options.clear_cache == "step" or options.malloc_trim == "step":
        install_step_hooks(options.clear_cache == "step", options.malloc_trim == "step")
    capacity = None if options.capacity_mib is None else int(options.capacity_mib * MIB)
    config = EngineConfig(model_path=Path(options.model_path), prompt_cache=PromptCacheConfig(capacity_bytes=capacity))
    sampling = SamplingParams(max_tokens=shape.reply_tokens, temperature=0.0)
    sampler = Sampler(options.interval)
    base = snapshot()
    lines = [row("imports", base, base["VmRSS"])]
    ttfts: list[tuple[int, float]] = []

    async def run() -> None:
        async with open_engine(config) as engine:
            started = sampler.sample()
            stats = await engine.cache_stats()
            lines.append(row("engine ready", started, base["VmRSS"], stats.get("bytes")))
            lines.append(f"{'':<14} store budget {stats.get('capacity_bytes', 0) / MIB:.0f} MiB")
            replies: list[list[str]] = [[] for _ in range(shape.conversations)]
            for turn in range(shape.turns):
                for conversation in range(shape.conversations):
                    sampler.phase = f"turn {turn} conv {conversation}"
                    request = ChatRequest(messages=tuple(workload.messages(conversation, turn, replies[conversation])),
                                          sampling=sampling, stream=True, include_usage=True)
                    start, first, text = time.perf_counter(), None, []
                    async with engine.stream(request) as deltas:
                        async for delta in deltas:
                            if first is None and delta.text:
                                first = time.perf_counter() - start
                            text.append(delta.text)
                    replies[conversation].append("".join(text))
                    if first is not None:
                        ttfts.append((turn, first))
                    if options.clear_cache == "turn":
                        mx.clear_cache()  # not on the device thread; MLX's pool is global
                    if options.malloc_trim == "turn" and LIBC is not None:
                        LIBC.malloc_trim(0)
                figures = sampler.sample()
                stats = await engine.cache_stats()
                lines.append(row(f"after turn {turn}", figures, base["VmRSS"], stats.get("bytes")))
            lines.append(f"{'':<14} store entries {stats.get('entries')}, evictions {stats.get('evictions')}")

    with sampler:
        trio.run(run)
    peak = sampler.peak
    lines.append(row("at peak RSS", peak, base["VmRSS"]) + f"   ({sampler.peak_phase})")
    warm = [seconds for turn, seconds in ttfts if turn > 0]
    cold = [seconds for turn, seconds in ttfts if turn == 0]
    lines.append(f"peak RSS {max(peak['VmRSS'], peak['VmHWM']) / MIB:.0f} MiB (VmHWM), "
                 f"TTFT median cold {statistics.median(cold) * 1000:.0f} ms, warm {statistics.median(warm) * 1000:.0f} ms"
                 if warm and cold else "no TTFT")
    print("\n".join(lines))
    if options.json:
        print(json.dumps({"peak_rss_mib": round(peak["VmHWM"] / MIB), "peak_phase": sampler.peak_phase,
                          "warm_ttft_ms": round(statistics.median(warm) * 1000, 1) if warm else None,
                          "knobs": {key: value for key, value in vars(options).items() if key not in ("model_path",)}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
