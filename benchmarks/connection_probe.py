"""Hostile-client figures for one source tree: hung follow-ups, held sockets, SIGTERM, start-up, warm-up.

    python benchmarks/connection_probe.py [--tree DIR] [pairs|held|sigterm|startup|warmup ...]

``--tree`` is the checkout whose ``mlxcel`` is run (default: this one), so the
same script measures an older commit from a worktree. Each scenario starts
its own ``mlxcel serve`` on a free loopback port and prints one line of figures.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from tests.reliability.test_rel_connections import read_response

KEY = "probe-key"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def status_of(response: tuple[int, dict[str, str], bytes] | None) -> str:
    return "closed" if response is None else str(response[0])


@contextmanager
def server(tree: Path, *flags: str, soft_nofile: int | None = None, wait: str = "ok"):
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)}

    def limit() -> None:
        if soft_nofile is not None:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (soft_nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "mlxcel", "serve", "--port", str(port), *flags],
                               cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=limit)  # noqa: PLW1509 - no threads yet
    timings = {"first_answer": None, "ready": None}
    try:
        while timings["ready"] is None:
            assert process.poll() is None, "server exited"
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    head = read_response(sock)
                if head is not None:
                    timings["first_answer"] = timings["first_answer"] or time.monotonic() - started
                    if status_of(head) == "200" or wait == "any":
                        timings["ready"] = time.monotonic() - started
            except OSError:
                pass
            time.sleep(0.05)
        yield process, port, timings
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def unread_body_pair(port: int, first: bytes, body: bytes, timeout: float) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(first)
        time.sleep(0.05)  # the body arrives after the server has seen the headers, as from most clients
        sock.sendall(body)
        try:
            if read_response(sock) is None:
                return "first closed"
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            return "answered" if read_response(sock) is not None else "closed"
        except TimeoutError:
            return "hung"
        except OSError:
            return "closed"


def pairs(tree: Path, count: int = 40) -> None:
    body = b'{"model": "x", "messages": []}'
    kinds = [
        b"POST /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n",
        b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n",
    ]
    with server(tree) as (_, port, _timings):
        results: list[str] = []

        def one(head: bytes) -> None:
            results.append(unread_body_pair(port, head % len(body), body, 3.0))

        threads = [threading.Thread(target=one, args=(kinds[i % len(kinds)],)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    summary = {name: results.count(name) for name in sorted(set(results))}
    print(f"pairs: {count} unread-body-then-follow-up pairs: {summary}")


def held(tree: Path, count: int, soft_nofile: int, *flags: str) -> None:
    """``count`` sockets kept busy on /health (a request every 2 s), then one authenticated request."""
    with server(tree, "--api-key", KEY, *flags, soft_nofile=soft_nofile) as (process, port, _timings):
        sockets: list[socket.socket] = []
        for _ in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                sockets.append(sock)
            except OSError:
                break
        stop = threading.Event()

        def refresh() -> None:
            while not stop.is_set():
                for sock in sockets:
                    try:
                        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                    except OSError:
                        pass
                stop.wait(2)

        refresher = threading.Thread(target=refresh, daemon=True)
        refresher.start()
        time.sleep(3)
        server_fds = len(os.listdir(f"/proc/{process.pid}/fd"))
        started = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
                sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
                outcome = status_of(read_response(sock))
        except OSError as error:
            outcome = type(error).__name__
        elapsed = time.monotonic() - started
        stop.set()
        for sock in sockets:
            sock.close()
        time.sleep(0.5)
        alive = process.poll() is None
    print(f"held: {len(sockets)} sockets on /health (soft RLIMIT_NOFILE {soft_nofile}{', ' + ' '.join(flags) if flags else ''}):"
          f" server holds {server_fds} fds; authenticated request {outcome} after {elapsed:.2f} s;"
          f" server alive afterwards: {alive}")


def sigterm(tree: Path) -> None:
    with server(tree, "--shutdown-grace-seconds", "20") as (process, port, _timings):
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        read_response(idle)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            during = status_of(read_response(idle))
        except OSError as error:
            during = type(error).__name__
        process.wait(timeout=60)
        exited = time.monotonic() - signalled
    print(f"sigterm: one idle kept-alive connection: exit {process.returncode} after {exited:.2f} s;"
          f" a request on it 0.3 s after SIGTERM: {during}")


def startup(tree: Path, *flags: str) -> None:
    with server(tree, *flags) as (_, _port, timings):
        pass
    print(f"startup{' ' + ' '.join(flags) if flags else ''}: /health first answers after {timings['first_answer']:.2f} s,"
          f" 200 after {timings['ready']:.2f} s")


def warmup(tree: Path, model: str | None) -> None:
    label = model or "demo"
    for warm in ("true", "false"):
        flags = ["--device-warmup", warm] + (["-m", model] if model else [])
        with server(tree, *flags) as (_, port, timings):
            body = json.dumps({"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                               "temperature": 0}).encode()
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(body) + body)
                status = status_of(read_response(sock))
            first = time.monotonic() - started
        print(f"warmup {label} --device-warmup={warm}: ready after {timings['ready']:.2f} s, first chat reply"
              f" ({status}) {first:.2f} s, start to first answer {timings['ready'] + first:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=HERE)
    parser.add_argument("--held-sockets", type=int, default=1500)
    parser.add_argument("--bench-model", default=None, help="a float32 fixture folder for the warm-up figures")
    parser.add_argument("scenarios", nargs="*", default=["pairs", "held", "sigterm", "startup"])
    arguments = parser.parse_args()
    tree = arguments.tree.resolve()
    for scenario in arguments.scenarios:
        if scenario == "pairs":
            pairs(tree)
        elif scenario == "held":
            held(tree, arguments.held_sockets, 1024)
            if tree == HERE:  # the flag is new
                held(tree, arguments.held_sockets, 1024, "--max-connections", "256")
        elif scenario == "sigterm":
            sigterm(tree)
        elif scenario == "startup":
            startup(tree)
        elif scenario == "warmup":
            warmup(tree, None)
            if arguments.bench_model:
                warmup(tree, arguments.bench_model)
        else:
            parser.error(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
