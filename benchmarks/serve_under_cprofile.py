"""Run ``mlxcel ARGS...`` (a server) with cProfile on the event loop's thread, switched by signals.

Usage: python benchmarks/serve_under_cprofile.py REPORT -- ARGS...
SIGUSR1 starts profiling, SIGUSR2 stops it and writes pstats to REPORT. Python runs signal handlers on
the main thread, which is the Trio loop's, and cProfile profiles the thread that enables it. A
deterministic profile inflates code that makes many small calls; read its shares, not its seconds.
"""

from __future__ import annotations

import cProfile
import signal
import sys
from typing import Any


def main() -> None:
    from mlxcel.cli import main as mlxcel_main

    report, separator, *arguments = sys.argv[1:]
    if separator != "--":
        raise SystemExit("usage: python benchmarks/serve_under_cprofile.py REPORT -- ARGS...")
    profile = cProfile.Profile()

    def start(*_: Any) -> None:
        profile.enable()

    def stop(*_: Any) -> None:
        profile.disable()
        profile.dump_stats(report)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    raise SystemExit(mlxcel_main(arguments))


if __name__ == "__main__":
    main()
