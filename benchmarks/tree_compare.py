"""Two source trees' servers on one model, in one run: idle memory, and cold turn-0 TTFT by stage.

Issue 32's rule was "behaviour and speed as before"; this measures a tree
against an older one (``git archive COMMIT | tar -x -C /tmp/before``) without
editing either. Each server runs ``python -m mlxcel serve`` from its tree
under this file's ``probe`` mode, which on SIGUSR1 writes a JSON report:
modules imported, threads, /proc/self/status and smaps_rollup, glibc's
``mallinfo2`` (heap in use, free heap held), MLX's active and cache memory,
and, with ``PROBE_TIMING=1``, the durations of the request path's stages
(wrapped at run time by class and method name, wherever each tree keeps them).

    # idle RSS: each variant started alone, in turn (order reversed every other round)
    python benchmarks/tree_compare.py idle --model-path DIR --rounds 3 \\
        before=/tmp/before after=. 'after_notrim=.|PROBE_NO_TRIM=1' 'after_nollg=.|PROBE_NO_LLG=1'
    # start-up peak, idle and workload peak RSS (sampled every 50 ms; the workload is `mlxcel bench`'s default)
    python benchmarks/tree_compare.py peak --model-path DIR --rounds 2 before=/tmp/before32 after=.
    # cold turn-0 TTFT: both servers side by side, one request at a time, alternating which goes first
    python benchmarks/tree_compare.py ttft --model-path DIR --requests 200 --before /tmp/before --after .

A variant is NAME=TREE[|ENV=VALUE,...]. Probe switches: ``PROBE_NO_TRIM=1``
(the llguidance build does not trim the heap afterwards), ``PROBE_NO_LLG=1``
(no llguidance tokenizer built at start-up).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import functools
import importlib
import inspect
import json
import os
import random
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
MIB = 1 << 20

# --- probe: runs inside each server -----------------------------------------------------------------

_RECORDS: list[tuple[str, float, float, str]] = []
# (module candidates, class, method, label): the request path's stages, wherever each tree keeps them.
_STAGES = [
    (("mlxcel.model.prompt", "mlxcel.actors.router"), "PromptRenderer", "render", "render"),
    (("mlxcel.model.prompt", "mlxcel.actors.router"), "PromptRenderer", "_chat_tokens", "tokenize"),
    (("mlxcel.actors.router",), "RouterActor", "_route", "route"),
    (("mlxcel.actors.scheduler",), "SchedulerActor", "_lookup", "lookup"),
    (("mlxcel.cache.store",), "PromptCacheStore", "lookup", "store.lookup"),
    (("mlxcel.core.scheduler",), "SchedulerCore", "schedule", "schedule"),
    (("mlxcel.core.scheduler",), "SchedulerCore", "update", "update"),
    (("mlxcel.model.executor",), "StepExecutor", "run_step", "run_step"),
]
STAGE_LABELS = [label for *_, label in _STAGES]


def _plan_summary(plan: Any) -> str:
    starts = [type(start).__name__ for start in getattr(plan, "starts", ())]
    return f"starts {starts} alone {getattr(plan, 'alone_chunk', None) is not None} batch {getattr(plan, 'run_batch', None)}"


def _timed(owner: Any, attr: str, label: str) -> None:
    function = getattr(owner, attr)
    if inspect.iscoroutinefunction(function):
        @functools.wraps(function)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await function(*args, **kwargs)
            finally:
                _RECORDS.append((label, started, time.perf_counter() - started, ""))
        setattr(owner, attr, timed_async)
        return

    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            extra = _plan_summary(args[1]) if label == "run_step" and len(args) > 1 else ""
            _RECORDS.append((label, started, time.perf_counter() - started, extra))
    setattr(owner, attr, timed)


def _install_stage_timers() -> list[str]:
    installed = []
    for modules, class_name, method, label in _STAGES:
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            owner = getattr(module, class_name, None)
            if owner is not None and method in owner.__dict__:
                _timed(owner, method, label)
                installed.append(f"{label}={name}")
                break
    return installed


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _report(out: str) -> None:
    info: dict[str, Any] = {"modules": sorted(sys.modules), "threads": [t.name for t in threading.enumerate()]}
    for name in ("status", "smaps_rollup"):
        info[name] = Path(f"/proc/self/{name}").read_text()
    if "mlx.core" in sys.modules:
        mx = sys.modules["mlx.core"]
        info["mlx"] = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory()}
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        heap = libc.mallinfo2()
        info["heap"] = {"in_use": heap.uordblks, "free": heap.fordblks, "mmapped": heap.hblkhd}
    except (OSError, AttributeError):
        pass
    info["timing"] = list(_RECORDS)
    Path(out).write_text(json.dumps(info))


def probe(arguments: list[str]) -> None:
    """``mlxcel ARGS`` from the current directory's tree, reporting on SIGUSR1."""
    out = os.environ.get("PROBE_OUT", "probe.json")
    signal.signal(signal.SIGUSR1, lambda *_: _report(out))
    sys.path.insert(0, os.getcwd())
    # The CLI re-executes itself with the optimized BLAS preloaded; patch only in that process.
    if os.environ.get("LD_PRELOAD"):
        if os.environ.get("PROBE_NO_TRIM"):
            try:
                import mlxcel.model.grammar_masks as grammar_masks
                grammar_masks.give_back_freed_heap = lambda: None  # type: ignore[attr-defined]
            except (ImportError, AttributeError):
                pass
        if os.environ.get("PROBE_NO_LLG"):
            import mlxcel.model.grammar_check as grammar_check

            async def skip(self: Any) -> None:
                return None
            grammar_check.GrammarChecker.prepare = skip  # type: ignore[method-assign]
        if os.environ.get("PROBE_TIMING"):
            print("tree_compare probe timing:", _install_stage_timers(), file=sys.stderr, flush=True)
    sys.argv = ["mlxcel", *arguments]
    runpy.run_module("mlxcel", run_name="__main__", alter_sys=True)


# --- drivers ------------------------------------------------------------------------------------------

def _start(tree: str, model: str, port: int, out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    full_env = dict(os.environ, HF_HUB_OFFLINE="1", PROBE_OUT=str(out.with_suffix(".json")), **env)
    log = out.with_suffix(".log").open("w")
    return subprocess.Popen([sys.executable, str(HERE), "probe", "serve", "-m", model, "--port", str(port)],
                            cwd=tree, env=full_env, stdout=log, stderr=subprocess.STDOUT)


def _wait_ready(port: int, process: subprocess.Popen[bytes], timeout_s: float = 300) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if process.poll() is not None:
            raise SystemExit(f"the server on port {port} exited ({process.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as reply:
                if reply.status == 200:
                    return time.perf_counter() - started
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"no server on port {port} after {timeout_s:.0f} s")


def _collect(process: subprocess.Popen[bytes], out: Path) -> dict[str, Any]:
    report = out.with_suffix(".json")
    report.unlink(missing_ok=True)
    process.send_signal(signal.SIGUSR1)
    for _ in range(300):
        time.sleep(0.1)
        try:
            return dict(json.loads(report.read_text()))
        except (OSError, ValueError):
            continue
    raise SystemExit(f"no report at {report}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _status_mib(info: dict[str, Any], field: str) -> float:
    line = next(line for line in info["status"].splitlines() if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def _variant(spec: str) -> tuple[str, str, dict[str, str]]:
    name, _, rest = spec.partition("=")
    tree, _, envs = rest.partition("|")
    return name, tree, dict(pair.split("=", 1) for pair in envs.split(",") if pair)


def idle(args: argparse.Namespace) -> None:
    variants = [_variant(spec) for spec in args.variants]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = args.port
    print(f"load average {os.getloadavg()}")
    for round_number in range(args.rounds):
        for name, tree, env in (variants if round_number % 2 == 0 else variants[::-1]):
            port += 1
            out = out_dir / f"{name}.{round_number}"
            process = _start(tree, args.model_path, port, out, env)
            try:
                ready_s = _wait_ready(port, process)
                time.sleep(args.settle)
                info = _collect(process, out)
            finally:
                _stop(process)
            heap, mlx = info.get("heap", {}), info.get("mlx", {})
            print(f"{name:16s} ready {ready_s:5.1f} s  RSS {_status_mib(info, 'VmRSS'):6.0f} MiB  "
                  f"(anon {_status_mib(info, 'RssAnon'):.0f})  heap in use {heap.get('in_use', 0) / MIB:5.0f}  "
                  f"free heap held {heap.get('free', 0) / MIB:5.0f}  MLX active {mlx.get('active', 0) / MIB:5.0f}  "
                  f"modules {len(info['modules'])}  threads {len(info['threads'])}", flush=True)
    print(f"load average {os.getloadavg()}")


def peak(args: argparse.Namespace) -> None:
    variants = [_variant(spec) for spec in args.variants]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    port = args.port
    print(f"load average {os.getloadavg()}")
    for round_number in range(args.rounds):
        for name, tree, env in (variants if round_number % 2 == 0 else variants[::-1]):
            port += 1
            out = out_dir / f"{name}.{round_number}"
            process = _start(tree, args.model_path, port, out, env)
            samples: list[tuple[float, float]] = []
            stop = threading.Event()

            def sample(pid: int = process.pid, into: list[tuple[float, float]] = samples,
                       stopped: threading.Event = stop) -> None:
                while not stopped.wait(0.05):
                    try:
                        status = Path(f"/proc/{pid}/status").read_text()
                    except OSError:
                        continue
                    line = next(line for line in status.splitlines() if line.startswith("VmRSS:"))
                    into.append((time.perf_counter(), int(line.split()[1]) / 1024))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                _wait_ready(port, process)
                ready = time.perf_counter()
                time.sleep(args.settle)
                idle_mib = samples[-1][1]
                subprocess.run([sys.executable, "-m", "mlxcel", "bench", "--url", f"http://127.0.0.1:{port}",
                                "--model-path", args.model_path, "--no-floor", "--quiet", "--out", str(out) + "_bench"],
                               cwd=HERE.parents[1], env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True,
                               check=True)
            finally:
                stop.set()
                sampler.join()
                _stop(process)
            start_peak = max(mib for at, mib in samples if at < ready)
            work_peak = max(mib for at, mib in samples if at >= ready)
            print(f"{name:16s} start-up peak {start_peak:6.0f} MiB  idle {idle_mib:6.0f}  workload peak {work_peak:6.0f}",
                  flush=True)
    print(f"load average {os.getloadavg()}")


def _chat(client: Any, port: int, model_id: str, system: str, user: str) -> tuple[float, float, dict[str, Any]]:
    body = {"model": model_id, "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": 16, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    sent, first, usage = time.perf_counter(), None, {}
    with client.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            reply.read()
            raise SystemExit(f"HTTP {reply.status_code}: {reply.text[:300]}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content") and first is None:
                    first = time.perf_counter()
    assert first is not None, "no content delta"
    return sent, first, usage


def _paired(differences: list[float]) -> str:
    boots = sorted(statistics.median(random.Random(k).choices(differences, k=len(differences))) for k in range(2000))
    return (f"median {statistics.median(differences):+.2f} ms, 95% bootstrap CI "
            f"[{boots[50]:+.2f}, {boots[1949]:+.2f}], n={len(differences)}")


def ttft(args: argparse.Namespace) -> None:
    """Both servers up, each idle while the other answers; a new conversation per request (its system prompt
    stored by the first request): the path of a cold turn 0 after a cached system prompt."""
    import httpx

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    trees = {"before": args.before, "after": args.after}
    ports = {"before": args.port + 1, "after": args.port + 2}
    processes = {name: _start(tree, args.model_path, ports[name], out_dir / name, {"PROBE_TIMING": "1"})
                 for name, tree in trees.items()}
    atexit.register(lambda: [p.kill() for p in processes.values() if p.poll() is None])
    for name, process in processes.items():
        _wait_ready(ports[name], process)
    words = "alpha beta gamma delta river stone cloud paper window garden light table music orange silver".split()
    rng = random.Random(args.seed)
    system = " ".join(rng.choice(words) for _ in range(args.system_words))
    client = httpx.Client(timeout=120)
    model_id = client.get(f"http://127.0.0.1:{ports['after']}/v1/models").json()["data"][0]["id"]
    for port in ports.values():
        _chat(client, port, model_id, system, "hello there, first request")
    print(f"load average {os.getloadavg()}")
    rows = []
    for index in range(args.requests):
        user = " ".join(rng.choice(words) for _ in range(args.user_words)) + f" question {index}"
        for name in (("before", "after") if index % 2 == 0 else ("after", "before")):
            sent, first, usage = _chat(client, ports[name], model_id, system, user)
            rows.append({"server": name, "index": index, "sent": sent, "first": first,
                         "ttft_ms": (first - sent) * 1000, "usage": usage})
            time.sleep(0.05)
    reports = {name: _collect(process, out_dir / name) for name, process in processes.items()}
    for process in processes.values():
        _stop(process)
    print(f"load average {os.getloadavg()}")
    for row in rows:
        inside = [record for record in reports[row["server"]]["timing"] if row["sent"] <= record[1] <= row["first"]]
        for label in STAGE_LABELS:
            row[label] = 1000 * sum(record[2] for record in inside if record[0] == label)
        row["steps"] = [(round(1000 * record[2], 2), record[3]) for record in inside if record[0] == "run_step"]
    (out_dir / "rows.json").write_text(json.dumps(rows))
    by_server = {name: [row for row in rows if row["server"] == name] for name in trees}
    print(f"{'median per request (ms)':26s} {'before':>8s} {'after':>8s}")
    for label in ["ttft_ms", *STAGE_LABELS]:
        before, after = (statistics.median(row[label] for row in by_server[name]) for name in ("before", "after"))
        print(f"{label:26s} {before:8.2f} {after:8.2f}  {after - before:+.2f}")
    pairs = list(zip(by_server["after"], by_server["before"], strict=True))
    print("paired after - before TTFT:", _paired([a["ttft_ms"] - b["ttft_ms"] for a, b in pairs]))
    early = [a["ttft_ms"] - b["ttft_ms"] for a, b in pairs if a["index"] < 5]
    print("the first 5 after the first request:", _paired(early))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        probe(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("idle", "peak", "ttft"):
        command = commands.add_parser(name)
        command.add_argument("--model-path", required=True)
        command.add_argument("--out", default=f"/tmp/tree_compare_{name}")
        command.add_argument("--port", type=int, default=18900)
    commands.choices["idle"].add_argument("--rounds", type=int, default=3)
    commands.choices["idle"].add_argument("--settle", type=float, default=8.0, help="seconds after ready")
    commands.choices["idle"].add_argument("variants", nargs="+", help="NAME=TREE[|ENV=VALUE,...]")
    commands.choices["peak"].add_argument("--rounds", type=int, default=2)
    commands.choices["peak"].add_argument("--settle", type=float, default=2.0, help="seconds after ready")
    commands.choices["peak"].add_argument("variants", nargs="+", help="NAME=TREE[|ENV=VALUE,...]")
    ttft_command = commands.choices["ttft"]
    ttft_command.add_argument("--before", required=True)
    ttft_command.add_argument("--after", default=".")
    ttft_command.add_argument("--requests", type=int, default=200)
    ttft_command.add_argument("--system-words", type=int, default=900)
    ttft_command.add_argument("--user-words", type=int, default=100)
    ttft_command.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    {"idle": idle, "peak": peak, "ttft": ttft}[args.command](args)


if __name__ == "__main__":
    main()
