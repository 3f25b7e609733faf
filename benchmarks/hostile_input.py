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
  10 s timeout: the share that succeeded and their latency;
- ``image``: llava fixture, a base64 PNG of 1 x 7,000,000 pixels (36 KB of
  JSON) through chat: status, time, whether the server still answers;
- ``regex``: a string schema with ``pattern: "(a+)+$"`` decoding beside a
  normal chat: the normal chat's latency against the same chat alone;
- ``fetch``: llava fixture with ``--allow-image-urls``: 4 image URLs whose
  server drips a byte each 0.5 s, and text chats beside them (latency); a
  loopback URL without an allowance (status, time);
- ``memo``: the tools' grammar memo as a timing oracle across tenants: tenant
  A sends a strict tool, then tenant B (another ``cache_salt``) sends the same
  tool or a tool never sent; the AUC of telling the two apart by tenant B's
  latency (0.5: indistinguishable), over ``--memo-probes`` pairs.

    PYTHONPATH=. python3 -m benchmarks.hostile_input grammar tokenize reset slowbody
    PYTHONPATH=. python3 -m benchmarks.hostile_input --tree /tmp/before grammar --answer-timeout 30
    PYTHONPATH=. python3 -m benchmarks.hostile_input image regex fetch memo
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import signal
import socket
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


def strip_png() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (1, 7_000_000)).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def image_chat(url: str) -> dict[str, Any]:
    return {"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this?"}]}]}


def knows(tree: Path, text: str) -> bool:
    """Whether the tree's configuration has a flag (the older tree lacks the newer ones)."""
    return text in (tree / "mlxcel" / "config.py").read_text()


def image(tree: Path) -> None:
    from mlxcel.fixtures import vision_fixture_path

    with server(tree, "-m", str(vision_fixture_path("llava"))) as (process, base_url):
        body = image_chat(f"data:image/png;base64,{strip_png()}")
        status, seconds, text = post(base_url, "/v1/chat/completions", body, 120)
        after = post(base_url, "/v1/chat/completions", NORMAL, 30)[0]
        time.sleep(1.0)
        alive = process.poll() is None
        print(f"image 1 x 7,000,000 PNG ({len(json.dumps(body)) // 1024} KB body): {status} in {seconds:.2f} s "
              f"({one_line(text)}); server {'alive' if alive else f'exited with {process.returncode}'}, "
              f"a normal chat after it: {after}", flush=True)


def regex(tree: Path) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(a+)+$"}}, "required": ["s"]}
    hostile = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "temperature": 0,
               "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}}
    normal = {**NORMAL, "max_tokens": 16}
    with server(tree) as (_process, base_url):
        post(base_url, "/v1/chat/completions", normal, 60)
        alone = statistics.median(post(base_url, "/v1/chat/completions", normal, 60)[1] for _ in range(3))
        post(base_url, "/v1/chat/completions", {**hostile, "max_tokens": 1}, 120)  # its grammar compiled

        def next_to(other: dict[str, Any]) -> tuple[tuple[str, float, str], tuple[str, float, str]]:
            result: list[tuple[str, float, str]] = []
            thread = threading.Thread(target=lambda: result.append(post(base_url, "/v1/chat/completions", other, 120)))
            thread.start()
            time.sleep(0.3)
            beside_it = post(base_url, "/v1/chat/completions", normal, 120)
            thread.join()
            return result[0], beside_it

        (_, free_seconds, _), beside_free = next_to({**NORMAL, "max_tokens": 64, "ignore_eos": True})
        own, beside_it = next_to(hostile)
    print(f"regex (a+)+$: its own request {own[0]} in {own[1]:.2f} s; a 16-token normal chat beside it "
          f"{beside_it[0]} in {beside_it[1]:.2f} s: {beside_it[1] / alone:.2f}x of the chat alone ({alone:.2f} s), "
          f"{beside_it[1] / beside_free[1]:.2f}x of the chat beside an unconstrained 64-token request "
          f"({beside_free[1]:.2f} s)", flush=True)


class DripServer:
    """An HTTP server on loopback that sends its reply a byte each ``interval`` seconds."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                connection, _ = self.listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._drip, args=(connection,), daemon=True).start()

    def _drip(self, connection: socket.socket) -> None:
        reply = b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: 100000\r\n\r\n" + bytes(100_000)
        with connection:
            for byte in reply:
                if self._stop.wait(self.interval):
                    return
                try:
                    connection.sendall(bytes([byte]))
                except OSError:
                    return

    def close(self) -> None:
        self._stop.set()
        self.listener.close()


def fetch(tree: Path) -> None:
    from mlxcel.fixtures import vision_fixture_path

    drip = DripServer()
    flags = ["-m", str(vision_fixture_path("llava")), "--allow-image-urls", "--image-fetch-timeout", "5"]
    try:
        if knows(tree, "image_fetch_allow"):
            with server(tree, *flags) as (_process, base_url):
                post(base_url, "/v1/chat/completions", NORMAL, 60)
                status, seconds, text = post(base_url, "/v1/chat/completions",
                                             image_chat(f"http://127.0.0.1:{drip.port}/a.png"), 60)
                print(f"fetch a loopback URL, no allowance: {status} in {seconds:.2f} s ({one_line(text)})",
                      flush=True)
            flags += ["--image-fetch-allow", "127.0.0.1"]
        with server(tree, *flags) as (_process, base_url):
            post(base_url, "/v1/chat/completions", NORMAL, 60)
            results: list[tuple[str, float, str]] = []
            threads = [threading.Thread(target=lambda index=index: results.append(post(
                base_url, "/v1/chat/completions", image_chat(f"http://127.0.0.1:{drip.port}/{index}.png"), 120)))
                for index in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            normals = [post(base_url, "/v1/chat/completions", NORMAL, 90) for _ in range(5)]
            for thread in threads:
                thread.join()
        statuses = sorted({status for status, _, _ in results})
        print(f"fetch 4 dripping image URLs (--image-fetch-timeout 5): statuses {statuses}, slowest "
              f"{max(seconds for _, seconds, _ in results):.2f} s; 5 text chats beside them: "
              f"{[status for status, _, _ in normals]}, slowest {max(seconds for _, seconds, _ in normals):.2f} s",
              flush=True)
    finally:
        drip.close()


def memo(tree: Path, probes: int) -> None:
    import tempfile

    from tests.http.test_tool_loop_and_logprobs import fixture_copy
    from tests.integration.test_tool_calls import TOOL_TEMPLATE

    def tool_body(name: str, salt: str) -> dict[str, Any]:
        # Short to render (so prefill noise stays small), slow to compile: bounded repetitions.
        properties = {f"{name}_{i}": {"type": "string", "pattern": f"^[a-z]{{1,{40 + i}}}(-[0-9]{{1,24}}){{0,6}}$"}
                      for i in range(16)}
        tool = {"type": "function", "function": {"name": name, "strict": True, "parameters": {
            "type": "object", "properties": properties, "required": list(properties)}}}
        return {**NORMAL, "tools": [tool], "cache_salt": salt}

    with tempfile.TemporaryDirectory() as scratch:
        folder = fixture_copy(Path(scratch) / "tools", template=TOOL_TEMPLATE)
        with server(tree, "-m", str(folder)) as (_process, base_url):
            post(base_url, "/v1/chat/completions", tool_body("warm", "w"), 120)  # the grammar engine's tables
            used, unused = [], []
            for index in range(probes):
                post(base_url, "/v1/chat/completions", tool_body(f"used{index}", "tenant-a"), 60)
                pair = [(used, f"used{index}"), (unused, f"new{index}")]
                for into, name in pair if index % 2 else reversed(pair):  # neither always goes first
                    into.append(post(base_url, "/v1/chat/completions", tool_body(name, "tenant-b"), 60)[1])
    # AUC: the chance that a tool never sent takes longer than one another tenant sent (ties count half).
    auc = sum((u > s) + 0.5 * (u == s) for u in unused for s in used) / (len(used) * len(unused))
    print(f"tools memo across tenants, {probes} probe pairs: tenant B's latency for a tool tenant A sent "
          f"median {1000 * statistics.median(used):.0f} ms, for a tool never sent "
          f"{1000 * statistics.median(unused):.0f} ms; AUC {auc:.2f} (0.5: indistinguishable)", flush=True)


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
    parser.add_argument("--memo-probes", type=int, default=16)
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
        elif scenario == "image":
            image(tree)
        elif scenario == "regex":
            regex(tree)
        elif scenario == "fetch":
            fetch(tree)
        elif scenario == "memo":
            memo(tree, arguments.memo_probes)
        else:
            parser.error(f"unknown scenario {scenario!r}")


if __name__ == "__main__":
    main()
