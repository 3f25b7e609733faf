"""Start servers on loopback, wait until they serve, sample their memory, stop them.

Every server is a child process in its own session (so its process group is
its own); stopping is SIGINT, a grace period, then SIGKILL of that group.
The children inherit this process's environment, hence its ``LD_PRELOAD``
(``mlxcel bench`` re-executes itself with the optimized BLAS first), so
every server and the floor measurement run on the same BLAS.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import attrs
import httpx

__all__ = [
    "RssSampler",
    "RunningServer",
    "ServerSpec",
    "ServerStartError",
    "command_spec",
    "free_port",
    "launch",
    "mlx_lm_spec",
    "mlxcel_spec",
    "peer_spec",
    "process_tree_rss",
]

STOP_GRACE_S = 15.0
READY_TIMEOUT_S = 300.0


class ServerStartError(RuntimeError):
    pass


@attrs.frozen(kw_only=True)
class ServerSpec:
    """How to start one server: argv with ``{model}`` and ``{port}`` placeholders."""

    name: str
    argv: tuple[str, ...]
    # The "model" field to send; None asks the server's /v1/models.
    model_name: str | None = None

    def command(self, model_path: str, port: int) -> list[str]:
        return [part.replace("{model}", model_path).replace("{port}", str(port)) for part in self.argv]


def mlxcel_spec(extra_args: Sequence[str] = ()) -> ServerSpec:
    return ServerSpec(
        name="mlxcel",
        argv=(sys.executable, "-m", "mlxcel", "serve", "-m", "{model}", "--host", "127.0.0.1", "--port", "{port}",
              *extra_args),
    )


def mlx_lm_spec(extra_args: Sequence[str] = ()) -> ServerSpec:
    # mlx_lm.server loads whatever "model" names; "default_model" is the one it started with.
    return ServerSpec(
        name="mlx_lm",
        argv=(sys.executable, "-m", "mlx_lm", "server", "--model", "{model}", "--host", "127.0.0.1",
              "--port", "{port}", *extra_args),
        model_name="default_model",
    )


def command_spec(command: str, *, name: str | None = None) -> ServerSpec:
    """A peer given as a shell-like command line with ``{model}`` and ``{port}``."""
    argv = tuple(shlex.split(command))
    if not argv:
        raise ValueError("an empty --peer-command")
    if "{port}" not in command:
        raise ValueError(f"--peer-command needs a {{port}} placeholder: {command!r}")
    if name is None:
        name = Path(argv[0]).name
        if name.startswith("python") and "-m" in argv[:-1]:
            name = argv[argv.index("-m") + 1]
    return ServerSpec(name=name, argv=argv)


PEERS = {"mlx_lm": mlx_lm_spec}


def peer_spec(name: str) -> ServerSpec:
    try:
        return PEERS[name]()
    except KeyError:
        raise ValueError(f"unknown peer {name!r}; known: {', '.join(PEERS)} (or use --peer-command)") from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _status_field(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status in bytes (0 if gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat:
                # The command name may hold spaces; fields resume after the last ')'.
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    return children


def process_tree(pid: int) -> list[int]:
    children = _children_map()
    tree, pending = [], [pid]
    while pending:
        current = pending.pop()
        tree.append(current)
        pending.extend(children.get(current, []))
    return tree


def process_tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants, now."""
    return sum(_status_field(member, "VmRSS") for member in process_tree(pid))


class RssSampler:
    """Samples a process tree's resident memory in a thread; ``peak_bytes`` is the largest seen.

    The root's own high-water mark (VmHWM) is folded in, so a spike between
    two samples still counts for the main process.
    """

    def __init__(self, pid: int, interval_s: float = 0.1) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, process_tree_rss(self.pid), _status_field(self.pid, "VmHWM"))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def stop(self) -> int:
        self.sample()
        self._stop.set()
        self._thread.join()
        return self.peak_bytes


@attrs.define
class RunningServer:
    spec: ServerSpec
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    sampler: RssSampler
    startup_s: float = 0.0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGINT, then SIGKILL of the whole group after ``grace_s``; the exit status."""
        self.sampler.stop()
        if self.process.poll() is None:
            try:
                self.process.send_signal(signal.SIGINT)
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            # Anything of this server's own process group still alive (its children).
            os.killpg(self.process.pid, signal.SIGKILL)
        try:
            return self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            return None


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _wait_ready(server: RunningServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5.0) as client:
        while True:
            if server.process.poll() is not None:
                raise ServerStartError(
                    f"{server.name} exited with status {server.process.returncode} before serving; "
                    f"its log ({server.log_path}) ends:\n{_log_tail(server.log_path)}"
                )
            for path in ("/v1/models", "/health"):
                try:
                    if client.get(server.base_url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise ServerStartError(f"{server.name} did not serve within {timeout_s:.0f} s; see {server.log_path}")
            time.sleep(0.3)


def start_server(
    spec: ServerSpec, model_path: str, log_dir: Path, *, ready_timeout_s: float = READY_TIMEOUT_S
) -> RunningServer:
    """Start one server on a free loopback port and return once it answers."""
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{spec.name}.log"
    environment = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    command = spec.command(model_path, port)
    started = time.perf_counter()
    with open(log_path, "wb") as log:
        log.write(("$ " + shlex.join(command) + "\n").encode())
        log.flush()
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=environment, start_new_session=True,
        )
    server = RunningServer(spec, process, f"http://127.0.0.1:{port}", log_path, RssSampler(process.pid).start())
    try:
        _wait_ready(server, ready_timeout_s)
    except BaseException:
        server.stop(grace_s=5.0)
        raise
    server.startup_s = time.perf_counter() - started
    return server


@contextmanager
def launch(
    specs: Sequence[ServerSpec], model_path: str, log_dir: Path, *, ready_timeout_s: float = READY_TIMEOUT_S
) -> Iterator[list[RunningServer]]:
    """Start every server (one after another, so loads do not compete); always stop them all."""
    running: list[RunningServer] = []
    try:
        for spec in specs:
            print(f"starting {spec.name} ...", file=sys.stderr, flush=True)
            server = start_server(spec, model_path, log_dir, ready_timeout_s=ready_timeout_s)
            print(f"{spec.name} serves on {server.base_url} (pid {server.pid}, {server.startup_s:.1f} s to start)",
                  file=sys.stderr, flush=True)
            running.append(server)
        yield running
    finally:
        for server in reversed(running):
            status = server.stop()
            print(f"stopped {server.name} (exit status {status})", file=sys.stderr, flush=True)
