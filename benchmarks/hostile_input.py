"""Hostile input on the newer surfaces (issue 33): grammar bombs, tokenizer-route bodies, slow bodies.

Each scenario starts ``python -m mlxcel serve`` (the random-weight demo model)
from ``--tree`` (default: this checkout, so an older commit can be measured
from a copy of its tree) and prints one line per measurement:

- ``grammar``: each bomb alone (800 patternProperties, 100k properties, a
  20,000-rule GBNF, 100k GBNF branches): status, time to answer, whether the
  answer is one line without a backtrace, the server's RSS before/peak/after,
  and a normal chat's latency sent beside it; then ``--grammar-flood`` bombs
  at once with a normal chat and /health beside them, and SIGTERM's time to exit;
- ``tokenize``: a ``--tokenize-mb`` MB `/tokenize` (and with_pieces): status,
  time, RSS before/peak/after, a normal chat beside it;
- ``reset``: a ``--reset-mb`` MB body to `/v1/cache/reset`: status, time, RSS;
- ``slowbody``: ``--slow-clients`` connections trickling their bodies (a byte
  each 0.5 s, reconnecting when closed) against ``--max-connections``, and
  ``--normal`` normal chats beside them, each on a fresh connection with a
  10 s timeout: the share that succeeded and their latency.

    PYTHONPATH=. python3 -m benchmarks.hostile_input grammar tokenize reset slowbody
    PYTHONPATH=. python3 -m benchmarks.hostile_input --tree /tmp/before grammar --answer-timeout 30
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

from benchmarks.hostile_prompts import free_port, rss_mib, start_server  # noqa: E402
from tests.reliability.test_rel_slow_bodies import flood_and_measure  # noqa: E402

NORMAL = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}


def bombs() -> list[tuple[str, str, dict[str, Any]]]:
    patterns = {"type": "object", "patternProperties": {
        f"^a{i}[a-z]+{i}$": {"type": "string"} for i in range(800)}}
    properties = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100_000)}}
    rules = "root ::= r0\n" + "\n".join(f'r{i} ::= "x{i}" r{i + 1} | "y"' for i in range(20_000)) + '\nr20000 ::= "z"'
    branches = "root ::= " + " | ".join(f'"a{i}"' for i in range(100_000))
    return [
        ("800 patternProperties (response_format)", "/v1/chat/completions",
         {**NORMAL, "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": patterns}}}),
        ("100k properties (json_schema)", "/completion", {"prompt": "hi", "n_predict": 1, "json_schema": properties}),
        ("20,000-rule GBNF", "/completion", {"prompt": "hi", "n_predict": 1, "grammar": rules}),
        ("100k-branch GBNF", "/completion", {"prompt": "hi", "n_predict": 1, "grammar": branches}),
    ]


class RssSampler:
    """The server's RSS every 50 ms while a measurement runs: before, peak, after."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.before = rss_mib(pid)
        self.peak = self.before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return

    def done(self) -> str:
        self._stop.set()
        self._thread.join()
        time.sleep(1.0)
        return f"RSS {self.before:.0f} / peak {self.peak:.0f} / after {rss_mib(self.pid):.0f} MiB"


def post(base_url: str, path: str, body: dict[str, Any] | bytes, timeout: float) -> tuple[str, float, str]:
    """Status (or what went wrong), seconds, and the response text."""
    started = time.monotonic()
    try:
        with httpx.Client(base_url=base_url, timeout=timeout) as client:
            if isinstance(body, bytes):
                response = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                response = client.post(path, json=body)
        return str(response.status_code), time.monotonic() - started, response.text
    except httpx.TimeoutException:
        return f"no answer within {timeout:g} s", time.monotonic() - started, ""
    except httpx.HTTPError as error:
        return type(error).__name__, time.monotonic() - started, ""


def beside(base_url: str, attack: Callable[[], tuple[str, float, str]], delay: float = 0.5,
           timeout: float = 60) -> tuple[tuple[str, float, str], tuple[str, float, str]]:
    """The attack, and a normal chat sent ``delay`` s after it starts."""
    result: list[tuple[str, float, str]] = []
    thread = threading.Thread(target=lambda: result.append(attack()))
    thread.start()
    time.sleep(delay)
    normal = post(base_url, "/v1/chat/completions", NORMAL, timeout)
    thread.join()
    return result[0], normal


@contextmanager
def server(tree: Path, *flags: str) -> Iterator[tuple[Any, str]]:
    port = free_port()
    process = start_server(tree, port, list(flags))
    try:
        yield process, f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()


def one_line(text: str) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return "no error body"
    lines = "one line" if "\n" not in message else f"{message.count(chr(10)) + 1} lines"
    return f"{lines}, {'backtrace' if 'backtrace' in message else 'no backtrace'}: {message[:90]!r}"


def grammar(tree: Path, answer_timeout: float, flood: int) -> None:
    with server(tree) as (process, base_url):
        post(base_url, "/v1/chat/completions", NORMAL, 60)
        for label, path, body in bombs():
            sampler = RssSampler(process.pid)
            (status, seconds, text), normal = beside(
                base_url, lambda path=path, body=body: post(base_url, path, body, answer_timeout))
            print(f"grammar {label}: {status} in {seconds:.2f} s ({one_line(text)}); normal chat beside it "
                  f"{normal[0]} in {normal[1]:.2f} s; {sampler.done()}", flush=True)
            if process.poll() is not None:
                print(f"  the server exited with {process.returncode}")
                return
        label, path, body = bombs()[0]
        results: list[tuple[str, float, str]] = []
        threads = [threading.Thread(target=lambda index=index: results.append(post(base_url, path, {
            **body, "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": {
                **body["response_format"]["json_schema"]["schema"], "title": f"t{index}"}}}}, answer_timeout)))
            for index in range(flood)]
        for thread in threads:
            thread.start()
        time.sleep(1.0)
        normal = post(base_url, "/v1/chat/completions", NORMAL, 30)
        started = time.monotonic()
        try:
            health_status = str(httpx.get(f"{base_url}/health", timeout=30).status_code)
        except httpx.HTTPError as error:
            health_status = type(error).__name__
        health_seconds = time.monotonic() - started
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
            exited = f"exit {process.returncode} after {time.monotonic() - signalled:.2f} s"
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: report, then kill
            exited = "still running 60 s after SIGTERM (killed)"
        for thread in threads:
            thread.join()
        statuses = sorted({status for status, _, _ in results})
        print(f"grammar flood of {flood} bombs: statuses {statuses}, slowest {max(s for _, s, _ in results):.2f} s; "
              f"normal chat beside them {normal[0]} in {normal[1]:.2f} s; /health {health_status} in "
              f"{health_seconds:.2f} s; SIGTERM during the flood: {exited}", flush=True)


def tokenize(tree: Path, megabytes: float, answer_timeout: float) -> None:
    content = "lorem ipsum " * int(megabytes * 1e6 / 12)
    with server(tree) as (process, base_url):
        post(base_url, "/v1/chat/completions", NORMAL, 60)
        for label, body in (("/tokenize", {"content": content}),
                            ("/tokenize with_pieces", {"content": content, "with_pieces": True})):
            sampler = RssSampler(process.pid)
            (status, seconds, _), normal = beside(
                base_url, lambda body=body: post(base_url, "/tokenize", body, answer_timeout), delay=1.0)
            print(f"{label} {megabytes:g} MB: {status} in {seconds:.2f} s; normal chat beside it {normal[0]} in "
                  f"{normal[1]:.2f} s; {sampler.done()}", flush=True)


def reset(tree: Path, megabytes: float) -> None:
    body = json.dumps({"disk": False, "pad": "x" * int(megabytes * (1 << 20))}).encode()
    with server(tree) as (process, base_url):
        sampler = RssSampler(process.pid)
        status, seconds, _ = post(base_url, "/v1/cache/reset", body, 300)
        print(f"/v1/cache/reset with a {megabytes:g} MiB body: {status} in {seconds:.2f} s; {sampler.done()}",
              flush=True)


def slowbody(tree: Path, num_slow: int, num_normal: int, max_connections: int) -> None:
    with server(tree, "--max-connections", str(max_connections)) as (_process, base_url):
        post(base_url, "/v1/chat/completions", NORMAL, 60)
        outcomes, tally = trio.run(lambda: flood_and_measure(base_url, num_slow=num_slow, num_normal=num_normal,
                                                             request_timeout=10.0))
    succeeded = sorted(seconds for seconds in outcomes if seconds is not None)
    latency = (f"median {statistics.median(succeeded):.2f} s, slowest {succeeded[-1]:.2f} s"
               if succeeded else "none answered")
    print(f"slow-body flood: {num_slow} trickling clients against --max-connections {max_connections} "
          f"({tally.num_opened} connections opened, {tally.num_closed_by_server} closed by the server): "
          f"{len(succeeded)}/{len(outcomes)} normal chats succeeded "
          f"({100 * len(succeeded) / len(outcomes):.0f}%), {latency}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=HERE)
    parser.add_argument("--answer-timeout", type=float, default=120.0)
    parser.add_argument("--grammar-flood", type=int, default=41)
    parser.add_argument("--tokenize-mb", type=float, default=15.0)
    parser.add_argument("--reset-mb", type=float, default=1024.0)
    parser.add_argument("--slow-clients", type=int, default=400)
    parser.add_argument("--normal", type=int, default=40)
    parser.add_argument("--max-connections", type=int, default=256)
    parser.add_argument("scenarios", nargs="*", default=["grammar", "tokenize", "reset", "slowbody"])
    arguments = parser.parse_args()
    tree = arguments.tree.resolve()
    for scenario in arguments.scenarios:
        if scenario == "grammar":
            grammar(tree, arguments.answer_timeout, arguments.grammar_flood)
        elif scenario == "tokenize":
            tokenize(tree, arguments.tokenize_mb, arguments.answer_timeout)
        elif scenario == "reset":
            reset(tree, arguments.reset_mb)
        elif scenario == "slowbody":
            slowbody(tree, arguments.slow_clients, arguments.normal, arguments.max_connections)
        else:
            parser.error(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
