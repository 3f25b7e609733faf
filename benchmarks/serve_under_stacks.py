"""Run ``mlxcel ARGS...`` (a server) under the sampling profiler (mlxcel/bench/stacks.py).

Usage: python benchmarks/serve_under_stacks.py REPORT -- ARGS...

REPORT is rewritten every two seconds: ``mlxcel serve`` ends with ``os._exit``, so nothing runs at exit.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path


def main() -> None:
    from mlxcel.bench.stacks import StackSampler
    from mlxcel.cli import main as mlxcel_main

    report, separator, *arguments = sys.argv[1:]
    if separator != "--":
        raise SystemExit("usage: python benchmarks/serve_under_stacks.py REPORT -- ARGS...")
    sampler = StackSampler()
    sampler.start()

    def write() -> None:
        while not threading.Event().wait(2.0):
            Path(report).write_text(sampler.report(top=30))

    threading.Thread(target=write, daemon=True, name="stack-report").start()
    raise SystemExit(mlxcel_main(arguments))


if __name__ == "__main__":
    main()
