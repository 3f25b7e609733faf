"""Decode throughput under concurrency, and a short request's TTFT behind a long prefill.

Usage: python benchmarks/scheduler_throughput.py [--model-path DIR] [--out DIR]
       [--levels 1,4,16] [--reply-tokens 64] [--long-prompt-tokens 1500] [--peer mlx_lm|none]

Starts mlxcel and mlx_lm.server on the same model folder (the llama fixture
by default) on loopback, both up for the whole run, and measures each in turn
(the order flips between experiments):

  decode   N simultaneous streaming chats with short, distinct prompts and
           --reply-tokens each; tokens/s = all completion tokens / wall time
           of the batch, and per stream = completion tokens / (end - first token)
  behind   a long prompt (--long-prompt-tokens, distinct each time so no cache
           helps) is sent, then after --behind-delay seconds a short request;
           the short one's TTFT, against the same short request alone and the
           long prompt's own TTFT alone

Prints a table and mlxcel/peer ratios; writes throughput.json and the servers'
logs to --out. Each figure is the median of --repeats rounds after a warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel.blas import describe_blas, reexec_with_optimized_blas  # noqa: E402


def _words(seed: int, count: int) -> str:
    from mlxcel.bench.workload import WORDS

    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _chat(client: Any, server: Any, text: str, max_tokens: int, tag: int) -> Any:
    from mlxcel.bench.client import stream_chat

    return stream_chat(client, server.base_url, model=server.model, messages=[{"role": "user", "content": text}],
                       max_tokens=max_tokens, server=server.name, conversation=tag, turn=0)


def _concurrent(calls: list[Any]) -> tuple[list[Any], float]:
    results: list[Any] = [None] * len(calls)

    def one(index: int) -> None:
        results[index] = calls[index]()

    threads = [threading.Thread(target=one, args=(index,), daemon=True) for index in range(len(calls))]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results, time.perf_counter() - start


class Target:
    def __init__(self, running: Any) -> None:
        import httpx

        from mlxcel.bench.client import resolve_model

        self.running = running
        self.name = running.name
        self.base_url = running.base_url
        self.client = httpx.Client(timeout=600.0, limits=httpx.Limits(max_connections=64))
        self.model = running.spec.model_name or resolve_model(self.client, self.base_url)


def decode_round(target: Target, level: int, reply_tokens: int, prompt_tokens: int, seed: int) -> dict[str, Any]:
    calls = [
        (lambda i=i: _chat(target.client, target, _words(seed * 1000 + i, prompt_tokens), reply_tokens, i))
        for i in range(level)
    ]
    records, wall = _concurrent(calls)
    errors = [r.error for r in records if r.error]
    completion = sum(r.completion_tokens or 0 for r in records)
    per_stream = [
        (r.completion_tokens - 1) / (r.e2e_s - r.ttft_s)
        for r in records
        if r.ttft_s is not None and r.completion_tokens and r.completion_tokens > 1 and r.e2e_s > r.ttft_s
    ]
    return {
        "tokens_per_s": completion / wall,
        "per_stream_tokens_per_s": statistics.median(per_stream) if per_stream else None,
        "completion_tokens": completion,
        "wall_s": wall,
        "ttft_median_s": statistics.median([r.ttft_s for r in records if r.ttft_s is not None] or [float("nan")]),
        "errors": errors,
    }


def behind_round(target: Target, long_tokens: int, delay_s: float | None, seed: int) -> dict[str, Any]:
    short_text = _words(seed * 7919 + 1, 24)
    alone_short = _chat(target.client, target, _words(seed * 7919 + 2, 24), 8, 0)
    alone_long = _chat(target.client, target, _words(seed * 7919 + 3, long_tokens), 1, 0)

    # Default: a quarter of the long prompt's own TTFT, so the short one lands mid-prefill.
    delay = delay_s if delay_s is not None else 0.25 * (alone_long.ttft_s or alone_long.e2e_s)

    def short_after_delay() -> Any:
        time.sleep(delay)
        return _chat(target.client, target, short_text, 8, 1)

    (long_record, short_record), _wall = _concurrent([
        lambda: _chat(target.client, target, _words(seed * 7919 + 4, long_tokens), 1, 0),
        short_after_delay,
    ])
    return {
        "short_ttft_behind_long_s": short_record.ttft_s,
        "short_ttft_alone_s": alone_short.ttft_s,
        "long_ttft_alone_s": alone_long.ttft_s,
        "long_ttft_with_short_s": long_record.ttft_s,
        "long_prompt_tokens": alone_long.prompt_tokens,
        "delay_s": delay,
        "errors": [r.error for r in (alone_short, alone_long, long_record, short_record) if r.error],
    }


def _median_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", help="model folder (default: the llama fixture)")
    parser.add_argument("--out", default="bench-throughput")
    parser.add_argument("--levels", default="1,4,16", help="concurrency levels, comma-separated")
    parser.add_argument("--reply-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=24, help="words in each short prompt")
    parser.add_argument("--long-prompt-tokens", type=int, default=1500)
    parser.add_argument("--behind-delay", type=float, default=None,
                        help="seconds between sending the long prompt and the short request "
                             "(default: a quarter of the long prompt's TTFT alone)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peer", default="mlx_lm", choices=("mlx_lm", "none"))
    parser.add_argument("--mlxcel-args", default="", help="extra flags for 'mlxcel serve'")
    parser.add_argument("--peer-args", default="", help="extra flags for the peer")
    namespace = parser.parse_args(argv)
    try:
        levels = [int(level) for level in namespace.levels.split(",")]
    except ValueError:
        parser.error(f"--levels must be integers separated by commas, got {namespace.levels!r}")
    reexec_with_optimized_blas([str(Path(__file__).resolve()), *(sys.argv[1:] if argv is None else argv)])

    import shlex

    from mlxcel.bench.launcher import launch, mlx_lm_spec, mlxcel_spec
    from mlxcel.fixtures import fixture_path

    model_path = str(Path(namespace.model_path or fixture_path("llama")).resolve())
    out = Path(namespace.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = [mlxcel_spec(shlex.split(namespace.mlxcel_args))]
    if namespace.peer == "mlx_lm":
        specs.append(mlx_lm_spec(shlex.split(namespace.peer_args)))
    blas = describe_blas()
    print(f"model {model_path}; {blas}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, Any]] = {}
    with launch(specs, model_path, out) as servers:
        targets = [Target(server) for server in servers]
        for target in targets:
            # Warm-up: first-call compilation of the shapes used below.
            decode_round(target, max(levels), 8, namespace.prompt_tokens, seed=999)
            results[target.name] = {"decode": {}, "behind": None}
        experiments: list[Any] = [("decode", level) for level in levels] + [("behind", None)]
        for index, (kind, level) in enumerate(experiments):
            for target in (targets if index % 2 == 0 else targets[::-1]):
                rounds = []
                for repeat in range(namespace.repeats):
                    seed = 100 * index + repeat
                    if kind == "decode":
                        rounds.append(decode_round(target, level, namespace.reply_tokens, namespace.prompt_tokens, seed))
                    else:
                        rounds.append(behind_round(target, namespace.long_prompt_tokens, namespace.behind_delay, seed))
                    print(f"[{target.name}] {kind} {level or ''} round {repeat}: "
                          + ", ".join(f"{k} {v:.3f}" for k, v in rounds[-1].items() if isinstance(v, float)),
                          file=sys.stderr, flush=True)
                summary = {key: _median_of(rounds, key) for key in rounds[0] if key != "errors"}
                summary["errors"] = [error for r in rounds for error in r["errors"]]
                summary["rounds"] = rounds
                if kind == "decode":
                    results[target.name]["decode"][str(level)] = summary
                else:
                    results[target.name]["behind"] = summary
        for target in targets:
            target.client.close()
    peak = {server.name: server.sampler.peak_bytes / (1 << 20) for server in servers}
    for name in results:
        results[name]["peak_rss_mib"] = peak[name]

    report = {
        "model_path": model_path, "blas": blas, "cpus": os.cpu_count(), "levels": levels,
        "reply_tokens": namespace.reply_tokens, "prompt_tokens": namespace.prompt_tokens,
        "long_prompt_tokens": namespace.long_prompt_tokens, "behind_delay_s": namespace.behind_delay,
        "repeats": namespace.repeats, "servers": results,
    }
    names = list(results)
    if len(names) > 1:
        mine, theirs = results[names[0]], results[names[1]]
        report["ratios"] = {
            **{f"decode_{level}_tokens_per_s": _ratio(mine["decode"][str(level)]["tokens_per_s"],
                                                      theirs["decode"][str(level)]["tokens_per_s"]) for level in levels},
            "short_ttft_behind_long": _ratio(mine["behind"]["short_ttft_behind_long_s"],
                                             theirs["behind"]["short_ttft_behind_long_s"]),
        }
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(_table(report))
    print(f"wrote {out / 'throughput.json'}")
    return 0


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return None if mine is None or not theirs else mine / theirs


def _table(report: dict[str, Any]) -> str:
    levels = report["levels"]
    header = ["server"] + [f"tok/s @{level} (per stream)" for level in levels] + [
        "short TTFT behind long", "short alone", "long alone", "peak RSS"]
    rows = [header]

    def fmt(value: float | None, unit: str = "") -> str:
        return "-" if value is None else f"{value:.{1 if unit == '' else 3}f}{unit}"

    for name, figures in report["servers"].items():
        row = [name]
        for level in levels:
            decode = figures["decode"][str(level)]
            row.append(f"{fmt(decode['tokens_per_s'])} ({fmt(decode['per_stream_tokens_per_s'])})")
        behind = figures["behind"]
        row += [fmt(behind["short_ttft_behind_long_s"], " s"), fmt(behind["short_ttft_alone_s"], " s"),
                fmt(behind["long_ttft_alone_s"], " s"), f"{figures['peak_rss_mib']:,.0f} MiB"]
        rows.append(row)
    if "ratios" in report:
        names = list(report["servers"])
        ratios = report["ratios"]
        rows.append([f"{names[0]} / {names[1]}"]
                    + [fmt(ratios[f"decode_{level}_tokens_per_s"], "x") for level in levels]
                    + [fmt(ratios["short_ttft_behind_long"], "x"), "", "", ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"{report['cpus']} CPUs, {report['blas']}; tokens/s = completion tokens / batch wall time; "
                 f"{report['reply_tokens']} reply tokens; medians of {report['repeats']} rounds")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
