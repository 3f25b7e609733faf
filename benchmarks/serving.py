"""Starting and stopping `mlxcel serve` for the benchmark scripts that drive real servers.

    process, base_url = start_mlxcel(model, ["--prompt-cache-dir", "/tmp/cache"], log=path)
    wait_healthy(process, base_url)
    ...
    status, seconds = stop_server(process)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mlxcel.bench.launcher import free_port  # noqa: E402

# Common one-token words, for prompts of a known length.
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper", "music", "garden", "window",
         "silver", "orange", "planet", "market", "signal", "bridge", "forest", "engine", "letter", "castle",
         "winter", "summer", "number", "method"]


def start_mlxcel(model: Path | str, flags: list[str], *, log: Path | None = None,
                 log_level: str = "info", stacks: Path | None = None,
                 timers: Path | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`mlxcel serve -m MODEL FLAGS...` on a free loopback port (not waited for); its log appended to ``log``."""
    port = free_port()
    command = [sys.executable, "-m", "mlxcel", "serve", "-m", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--log-level", log_level, *flags]
    if stacks is not None:
        # The server under the sampling profiler: its report rewritten every 2 s.
        command[1:3] = [str(REPO / "benchmarks" / "serve_under_stacks.py"), str(stacks), "--"]
    elif timers is not None:
        # Phase timers on the device thread and the loop, a line of counters every 0.2 s.
        command[1:3] = [str(REPO / "benchmarks" / "serve_under_timers.py"), str(timers), "--"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    output: IO[bytes] | int = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=output, stderr=output)
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen[bytes], base_url: str, seconds: float = 180) -> None:
    """Until /health answers 200; exits the script if the server dies or takes longer than ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with status {process.returncode} during start-up")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise SystemExit(f"the server did not answer /health within {seconds:g} s")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen[bytes], seconds: float = 120) -> tuple[int, float]:
    """SIGTERM, then SIGKILL after ``seconds``; the exit status and how long it took."""
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        status = process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        process.kill()
        status = process.wait(timeout=10)
    return status, time.monotonic() - started
