"""``mlxcel bench``: the multi-turn chat benchmark, against one URL or side by side with peers.

With ``--compare`` the servers (mlxcel and each peer, on the same model
folder) are all started first and stay up, and the workload alternates
between them turn by turn: turn k of every conversation on one server, then
turn k on the next, the order reversed on every other turn. Each server sees
exactly the same requests in the same order, and a slow spell of the machine
(other work on a shared host) falls on all of them rather than on whichever
server happened to run during it.

After the chat turns, ``--unseen N`` probes send each server N new prompts
one at a time (turn 0s of new conversations, see ``Workload.unseen_messages``),
alternating the server order per probe: the cold TTFT of a warmed-up server.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

__all__ = ["bench_main", "build_parser"]


class BenchUsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise BenchUsageError(message)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


_positive = _at_least(1)


def _concurrency(text: str) -> int | None:
    if text == "all":
        return None
    if text == "1":
        return 1
    raise argparse.ArgumentTypeError(f"must be 1 or all, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mlxcel bench",
        description="Multi-turn chat benchmark (streaming TTFT, cached tokens, peak RSS) against an "
                    "OpenAI-compatible server, or mlxcel side by side with mlx_lm.server (--compare).",
    )
    target = parser.add_argument_group("target")
    target.add_argument("--url", help="base URL of a running server (e.g. http://127.0.0.1:8080)")
    target.add_argument("--model", help="model name to send (default: the first id at /v1/models)")
    target.add_argument("--name", default="server", help="label of the --url server in the output")
    target.add_argument("--compare", action="store_true",
                        help="start mlxcel and the peers on --model-path on loopback and run them alternately")
    target.add_argument("--serial-servers", action="store_true",
                        help="with --compare: run the servers one after another instead of side by side "
                             "(on a single GPU, so they do not compete for its memory)")
    target.add_argument("--model-path", help="model folder: served with --compare; its tokenizer sizes the "
                                             "texts and the floor is measured on it")
    target.add_argument("--peer", action="append", default=None,
                        help="built-in peer to compare against (mlx_lm; 'none' for none; default mlx_lm)")
    target.add_argument("--peer-command", action="append", default=[],
                        help="another peer: a command with {model} and {port} placeholders (repeatable)")
    target.add_argument("--mlxcel-args", default="", help="extra flags for 'mlxcel serve' (one quoted string)")
    target.add_argument("--peer-args", default="", help="extra flags for the built-in peers (one quoted string)")
    shape = parser.add_argument_group("workload")
    shape.add_argument("--conversations", type=_positive, default=6)
    shape.add_argument("--turns", type=_positive, default=5)
    shape.add_argument("--system-tokens", type=_positive, default=1020)
    shape.add_argument("--user-tokens", type=_positive, default=117)
    shape.add_argument("--reply-tokens", type=_positive, default=16)
    shape.add_argument("--seed", type=int, default=0)
    shape.add_argument("--concurrency", type=_concurrency, default=1,
                       help="1: one request at a time, conversations interleaved turn by turn; "
                            "all: every conversation's turn k at once (default 1)")
    shape.add_argument("--unseen", type=_at_least(0), default=3,
                       help="after the chat turns, N new prompts (nothing to reuse) one at a time: the "
                            "system prompt's length, user turn user-tokens + 8 x probe index (0: none; default 3)")
    output = parser.add_argument_group("output")
    output.add_argument("--out", default="bench-results", help="output folder (default ./bench-results)")
    output.add_argument("--no-floor", action="store_true", help="skip the in-process floor measurement")
    output.add_argument("--floor-runs", type=_positive, default=5)
    output.add_argument("--quiet", action="store_true", help="no line per request on stderr")
    return parser


def _check(namespace: argparse.Namespace) -> None:
    if namespace.compare == bool(namespace.url):
        raise BenchUsageError("give exactly one of --url URL or --compare --model-path FOLDER")
    if namespace.compare and not namespace.model_path:
        raise BenchUsageError("--compare needs --model-path FOLDER")
    if namespace.model_path and not (Path(namespace.model_path) / "config.json").is_file():
        raise BenchUsageError(f"--model-path {namespace.model_path!r} is not a model folder (no config.json)")
    if namespace.url and not namespace.url.startswith(("http://", "https://")):
        raise BenchUsageError(f"--url must start with http:// or https://, got {namespace.url!r}")
    from mlxcel.bench.launcher import command_spec, peer_spec

    for name in namespace.peer or []:
        if name != "none":
            try:
                peer_spec(name)
            except ValueError as error:
                raise BenchUsageError(str(error)) from None
    for command in namespace.peer_command:
        try:
            command_spec(command)
        except ValueError as error:
            raise BenchUsageError(str(error)) from None


def bench_main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        namespace = build_parser().parse_args(arguments)
        _check(namespace)
    except BenchUsageError as error:
        print(f"mlxcel bench: error: {error}", file=sys.stderr)
        return 2
    # Before anything imports MLX: the servers and the floor inherit this BLAS.
    from mlxcel.blas import describe_blas, find_optimized_blas, reexec_with_optimized_blas

    reexec_with_optimized_blas()
    from mlxcel.bench.launcher import ServerStartError

    try:
        return _run(namespace, find_optimized_blas(), describe_blas())
    except ServerStartError as error:
        print(f"mlxcel bench: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mlxcel bench: interrupted", file=sys.stderr)
        return 130


def _specs(namespace: argparse.Namespace) -> list[Any]:
    import shlex

    from mlxcel.bench.launcher import command_spec, mlx_lm_spec, mlxcel_spec

    specs = [mlxcel_spec(shlex.split(namespace.mlxcel_args))]
    peer_args = shlex.split(namespace.peer_args)
    builtin = {"mlx_lm": lambda: mlx_lm_spec(peer_args)}
    for name in dict.fromkeys(namespace.peer if namespace.peer is not None else ["mlx_lm"]):
        if name != "none":
            specs.append(builtin[name]())
    taken = {spec.name for spec in specs}
    for command in namespace.peer_command:
        spec = command_spec(command)
        name, number = spec.name, 2
        while name in taken:
            name, number = f"{spec.name}-{number}", number + 1
        taken.add(name)
        specs.append(command_spec(command, name=name))
    return specs


def _run(namespace: argparse.Namespace, blas_library: str | None, blas: str) -> int:
    from mlxcel.bench.client import ConversationRunner, RequestRecord
    from mlxcel.bench.floor import measure_floor
    from mlxcel.bench.launcher import launch
    from mlxcel.bench.plot import PLOTS_MISSING, plots_available, write_plot
    from mlxcel.bench.summary import format_table, summarize
    from mlxcel.bench.workload import Shape, build_workload

    shape = Shape(
        conversations=namespace.conversations, turns=namespace.turns, system_tokens=namespace.system_tokens,
        user_tokens=namespace.user_tokens, reply_tokens=namespace.reply_tokens, seed=namespace.seed,
    )
    plots = plots_available()
    if not plots:
        print(PLOTS_MISSING, file=sys.stderr, flush=True)
    workload = build_workload(shape, model_path=namespace.model_path)
    out = Path(namespace.out)
    out.mkdir(parents=True, exist_ok=True)
    progress = None if namespace.quiet else sys.stderr
    print(f"mlxcel bench: {shape.conversations} conversations x {shape.turns} turns, system prompt "
          f"{workload.system_tokens_measured or shape.system_tokens} tokens, concurrency "
          f"{'all' if namespace.concurrency is None else 1}, {namespace.unseen} unseen probes; {blas}",
          file=sys.stderr, flush=True)

    floor = None
    if namespace.model_path and not namespace.no_floor:
        print("measuring the in-process floor ...", file=sys.stderr, flush=True)
        floor = measure_floor(namespace.model_path, shape, runs=namespace.floor_runs)
        print(f"floor: warm {floor['warm_floor_s']:.3f} s ({floor['suffix_tokens_median']:.0f} new tokens), "
              f"cold {floor['cold_floor_s']:.3f} s ({floor['cold_prompt_tokens']} tokens in chunks of "
              f"{floor['prefill_step_size']})", file=sys.stderr, flush=True)

    records: list[RequestRecord] = []
    requests_path = out / "requests.jsonl"
    started = time.time()
    peak_rss: dict[str, int | None] = {}
    servers_info: dict[str, Any] = {}
    with open(requests_path, "w", encoding="utf-8") as requests_file:
        def keep(record: RequestRecord) -> None:
            records.append(record)
            requests_file.write(json.dumps(record.to_json()) + "\n")
            requests_file.flush()

        if namespace.compare:
            specs = _specs(namespace)
            # On one GPU, servers that are up together compete for its memory
            # (each MLX process keeps a buffer cache): --serial-servers runs
            # them one after another instead of alternating.
            groups = [[spec] for spec in specs] if namespace.serial_servers else [specs]
            for group in groups:
                with launch(group, str(Path(namespace.model_path).resolve()), out) as servers:
                    runners = [
                        ConversationRunner(workload, server=server.name, base_url=server.base_url,
                                           model=server.spec.model_name, progress=progress, on_record=keep)
                        for server in servers
                    ]
                    by_name = {server.name: server for server in servers}

                    def alive(runner: ConversationRunner, by_name: dict[str, Any] = by_name) -> bool:
                        process = by_name[runner.server].process
                        if process.poll() is None:
                            return True
                        print(f"{runner.server} exited (status {process.returncode}) during the run; "
                              f"skipping it (see {by_name[runner.server].log_path})", file=sys.stderr, flush=True)
                        return False

                    stats: dict[str, Any] = {}
                    try:
                        for turn in range(shape.turns):
                            for runner in (runners if turn % 2 == 0 else runners[::-1]):
                                if alive(runner):
                                    runner.run_turn(turn, concurrency=namespace.concurrency)
                        # After the chat turns, before the unseen prompts push them out.
                        stats = {server.name: _cache_stats(server.base_url) for server in servers}
                        # While the servers are still up, after every chat turn.
                        for index in range(namespace.unseen):
                            for runner in (runners if index % 2 == 0 else runners[::-1]):
                                if alive(runner):
                                    runner.run_unseen(index)
                    finally:
                        for runner in runners:
                            runner.close()
                for server in servers:
                    peak_rss[server.name] = server.sampler.peak_bytes
                    servers_info[server.name] = {
                        "command": server.spec.command(str(Path(namespace.model_path).resolve()), 0),
                        "startup_s": server.startup_s, "log": str(server.log_path),
                        "model_sent": server.spec.model_name, "cache_stats": stats.get(server.name),
                    }
        else:
            with ConversationRunner(workload, server=namespace.name, base_url=namespace.url,
                                    model=namespace.model, progress=progress, on_record=keep) as runner:
                runner.run_all(concurrency=namespace.concurrency)
                cache_stats = _cache_stats(namespace.url)
                for index in range(namespace.unseen):
                    runner.run_unseen(index)
                servers_info[namespace.name] = {"url": namespace.url, "model_sent": runner.model,
                                                "cache_stats": cache_stats}

    summary = summarize(records, peak_rss_bytes=peak_rss, floor=floor)
    summary.update({
        "workload": {**workload.describe(), "concurrency": "all" if namespace.concurrency is None else 1,
                     "unseen": namespace.unseen},
        "servers_info": servers_info,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "blas": blas,
                    "blas_library": blas_library, "python": platform.python_version()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
        "wall_s": time.time() - started,
        "argv": sys.argv,
    })
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    title = (f"{shape.conversations} conversations x {shape.turns} turns, system {shape.system_tokens}, "
             f"user {shape.user_tokens}, reply {shape.reply_tokens} tokens, concurrency "
             f"{'all' if namespace.concurrency is None else 1}")
    written = [requests_path, out / "summary.json"]
    if plots:
        written.append(write_plot(summary, out / "ttft.png", title=title))
    print(format_table(summary))
    for name, info in servers_info.items():
        line = _cache_line(info.get("cache_stats"))
        if line:
            print(f"{name}: {line}")
    print(f"wrote {', '.join(str(path) for path in written)}")
    errors = sum(figures["num_errors"] for figures in summary["servers"].values())
    return 1 if errors else 0


def _cache_stats(base_url: str) -> dict[str, Any] | None:
    """The server's ``/v1/cache/stats`` after the chat turns (None: it has none)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{base_url.rstrip('/')}/v1/cache/stats", timeout=10) as response:
            body = json.loads(response.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None
    return body if isinstance(body, dict) else None


def _cache_line(stats: dict[str, Any] | None) -> str:
    """mlxcel's store at the end: unique bytes against the budget, logical bytes, sharing ratio."""
    if not stats or "logical_bytes" not in stats:
        return ""
    mib = 1 << 20
    unique, budget, logical = (stats[key] / mib for key in ("bytes", "capacity_bytes", "logical_bytes"))
    return (f"prompt cache after the chat turns: {unique:.1f} MiB unique of a {budget:.1f} MiB budget, "
            f"{logical:.1f} MiB logical (sharing {stats['sharing_ratio']:.2f}x), {stats['entries']} entries, "
            f"{stats['pieces']} pieces, evictions {stats['evictions']}")
