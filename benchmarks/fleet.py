"""A fleet of mlxcel replicas behind SGLang's Shepherd Model Gateway (``smg``), against one big replica.

    pip install -e '.[bench]'     # smg (the gateway) and matplotlib
    python benchmarks/fleet.py --out fleet-results

Three replicas of the CPU llama fixture on loopback, each with a prompt-cache
budget of ``--replica-budget`` bytes and KV events on an ipc:// socket, are
put behind ``smg launch`` twice: with its ``cache_aware`` policy (it routes by
the request's text prefix) and with ``round_robin``. A single replica with
three times the budget is the reference. The workload is 24 conversations of
4 turns over 3 system prompts (8 conversations each), every turn of every
conversation sent at a bounded concurrency, turn by turn; the clients are
``mlxcel.bench.client.stream_chat`` (what ``mlxcel bench --url`` sends), since
``mlxcel bench`` itself has one system prompt.

A KV event consumer (``mlxcel.bench.kv_consumer``, written from vLLM's schema)
subscribes to every replica during the run and checks that sequence numbers
have no gaps, that stored blocks arrive in prefix order and removals name held
blocks, and that every cached prefix a reply reports was announced (by some
replica) before that reply's first token. Results go to ``OUT/fleet.json``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from mlxcel.bench.client import stream_chat
from mlxcel.bench.kv_consumer import KvEventSubscriber
from mlxcel.bench.launcher import free_port, mlxcel_spec, start_server
from mlxcel.bench.workload import Shape, build_workload
from mlxcel.fixtures import fixture_path

BLOCK = 16


def start_replicas(count: int, budget: int, model: str, out: Path, sockets: Path,
                   tag: str) -> list[tuple[Any, str]]:
    """The servers, each with its KV event address."""
    replicas = []
    for index in range(count):
        events = f"ipc://{sockets}/{tag}-{index}-events"
        spec = mlxcel_spec((
            "--metrics", "--prompt-cache-capacity-bytes", str(budget), "--prefill-step-size", "512",
            "--kv-events-endpoint", events, "--kv-events-replay-endpoint", f"ipc://{sockets}/{tag}-{index}-replay",
        ))
        replicas.append((start_server(spec, model, out / f"logs-{tag}-{index}"), events))
    return replicas


def start_gateway(policy: str, workers: list[str], out: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    log = open(out / f"smg-{policy}.log", "wb")  # noqa: SIM115 (closed with the process)
    command = [shutil.which("smg") or str(Path(sys.executable).parent / "smg"), "launch", "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--worker-urls", *workers,
               "--disable-tokenizer-autoload", "--prometheus-port", str(free_port()), "--log-level", "warn"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"smg exited with {process.returncode}; see {out}/smg-{policy}.log")
            try:
                if client.get(url + "/v1/models").status_code == 200:
                    return process, url
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"smg did not answer within 60 s; see {out}/smg-{policy}.log")


def run_workload(url: str, workloads: list[Any], shape: Shape, concurrency: int, label: str,
                 render_url: str) -> list[dict[str, Any]]:
    conversations = [(workload, index) for index in range(shape.conversations) for workload in workloads]
    replies: dict[int, list[str]] = {number: [] for number in range(len(conversations))}
    records: list[dict[str, Any]] = []
    with httpx.Client(timeout=600) as client:
        model = client.get(url + "/v1/models").json()["data"][0]["id"]

        def one(number: int, turn: int) -> dict[str, Any]:
            workload, index = conversations[number]
            messages = workload.messages(index, turn, replies[number])
            started = time.time()
            record = stream_chat(client, url, model=model, messages=messages, max_tokens=shape.reply_tokens,
                                 server=label, conversation=number, turn=turn)
            tokens = client.post(render_url + "/v1/chat/completions/render",
                                 json={"messages": messages}).json()["token_ids"]
            first_token_at = started + (record.first_event_s or record.e2e_s)
            return {**record.to_json(), "reply": record.reply, "token_ids": tokens, "first_token_at": first_token_at}

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for turn in range(shape.turns):
                done = list(pool.map(lambda number, turn=turn: one(number, turn), range(len(conversations))))
                for number, record in enumerate(done):
                    replies[number].append(record["reply"])
                records.extend(done)
    return records


def summarize(records: list[dict[str, Any]], subscribers: list[KvEventSubscriber]) -> dict[str, Any]:
    turns = sorted({record["turn"] for record in records})
    per_turn = []
    for turn in turns:
        chosen = [record for record in records if record["turn"] == turn]
        ttfts = sorted(record["ttft_s"] for record in chosen if record["ttft_s"] is not None)
        per_turn.append({
            "turn": turn,
            "cached_share": sum(record["cached_tokens"] or 0 for record in chosen)
            / max(1, sum(record["prompt_tokens"] or 0 for record in chosen)),
            "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
        })
    unannounced = [
        (record["conversation"], record["turn"]) for record in records if record["cached_tokens"]
        and not any(subscriber.log.announced_before(record["token_ids"], record["cached_tokens"],
                                                    record["first_token_at"]) for subscriber in subscribers)
    ]
    ttfts = sorted(record["ttft_s"] for record in records if record["ttft_s"] is not None)
    return {
        "cached_share": sum(record["cached_tokens"] or 0 for record in records)
        / max(1, sum(record["prompt_tokens"] or 0 for record in records)),
        "ttft_median_s": ttfts[len(ttfts) // 2],
        "errors": sum(1 for record in records if record["error"]),
        "per_turn": per_turn,
        "events": [{"seqs": len(s.log.seqs), "problems": s.log.problems[:5], **s.log.counts} for s in subscribers],
        "hits_not_announced_first": unannounced,
    }


def run_setup(label: str, *, replicas: int, budget: int, policy: str | None, model: str, out: Path,
              sockets: Path, workloads: list[Any], shape: Shape, concurrency: int) -> dict[str, Any]:
    print(f"== {label}: {replicas} replica(s) x {budget} bytes, policy {policy}", file=sys.stderr, flush=True)
    started_replicas = start_replicas(replicas, budget, model, out, sockets, label)
    servers = [server for server, _ in started_replicas]
    gateway = None
    subscribers = [KvEventSubscriber(events, block_size=BLOCK, replay_endpoint=events.replace("-events", "-replay"))
                   for _, events in started_replicas]
    try:
        time.sleep(0.5)
        for subscriber in subscribers:  # the start-up AllBlocksCleared came before the subscription
            for seq, payload in subscriber.replay(0):
                if not subscriber.log.seqs:
                    subscriber.log.feed(seq, payload)
        url = servers[0].base_url
        if policy is not None:
            gateway, url = start_gateway(policy, [server.base_url for server in servers], out)
        started = time.perf_counter()
        records = run_workload(url, workloads, shape, concurrency, label, servers[0].base_url)
        wall = time.perf_counter() - started
        time.sleep(0.5)
        for server in servers:  # a reset at the end: it must be announced too
            httpx.post(server.base_url + "/v1/cache/reset", timeout=30)
        time.sleep(0.5)
        summary = summarize(records, subscribers)
        summary["resets_announced"] = all(s.log.events and s.log.events[-1]["type"] == "AllBlocksCleared"
                                          for s in subscribers)
        summary["wall_s"] = wall
        summary["per_replica_requests"] = _served_per_replica(servers)
        return {"summary": summary, "records": [{k: v for k, v in r.items() if k not in ("reply", "token_ids")}
                                                for r in records]}
    finally:
        for subscriber in subscribers:
            subscriber.close()
        if gateway is not None:
            gateway.terminate()
            gateway.wait(timeout=10)
        for server in servers:
            server.stop()


def _served_per_replica(servers: list[Any]) -> list[float]:
    counts = []
    for server in servers:
        text = httpx.get(server.base_url + "/metrics", timeout=10).text
        counts.append(sum(float(line.split()[-1]) for line in text.splitlines()
                          if line.startswith("mlxcel_requests_total")))
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("fleet-results"))
    parser.add_argument("--replica-budget", type=int, default=4_000_000, help="prompt-cache bytes per replica")
    parser.add_argument("--conversations-per-system", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--reply-tokens", type=int, default=24)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--only", choices=("cache_aware", "round_robin", "single"), action="append")
    arguments = parser.parse_args()
    out: Path = arguments.out
    out.mkdir(parents=True, exist_ok=True)
    model = str(fixture_path("llama"))
    shape = Shape(conversations=arguments.conversations_per_system, turns=arguments.turns,
                  system_tokens=arguments.system_tokens, user_tokens=arguments.user_tokens,
                  reply_tokens=arguments.reply_tokens)
    # One workload per system prompt (a different seed draws a different one).
    workloads = [build_workload(_with_seed(shape, seed), model_path=model) for seed in range(3)]
    setups = {
        "cache_aware": dict(replicas=3, budget=arguments.replica_budget, policy="cache_aware"),
        "round_robin": dict(replicas=3, budget=arguments.replica_budget, policy="round_robin"),
        "single": dict(replicas=1, budget=3 * arguments.replica_budget, policy=None),
    }
    results: dict[str, Any] = {
        "machine": f"{platform.machine()} {platform.system()}, {_cpus()} CPU cores (shared)",
        "model": "llama CPU fixture (random weights, float32)",
        "workload": {"system_prompts": 3, "conversations": 3 * shape.conversations, "turns": shape.turns,
                     "system_tokens": shape.system_tokens, "user_tokens": shape.user_tokens,
                     "reply_tokens": shape.reply_tokens, "concurrency": arguments.concurrency},
        "replica_budget_bytes": arguments.replica_budget,
    }
    with tempfile.TemporaryDirectory(prefix="mlxcel-fleet-") as sockets:
        for label in arguments.only or list(setups):
            results[label] = run_setup(label, model=model, out=out, sockets=Path(sockets), workloads=workloads,
                                       shape=shape, concurrency=arguments.concurrency, **setups[label])
            print(json.dumps({label: results[label]["summary"]}, indent=1), file=sys.stderr, flush=True)
    (out / "fleet.json").write_text(json.dumps(results, indent=1))
    return 0


def _with_seed(shape: Shape, seed: int) -> Shape:
    import attrs

    return attrs.evolve(shape, seed=seed)


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


if __name__ == "__main__":
    sys.exit(main())
