"""A sampling profiler for benchmarks: every thread's stack every few milliseconds, no ptrace.

``benchmarks/serve_under_stacks.py`` runs a server under it.
"""

from __future__ import annotations

import collections
import sys
import threading
from pathlib import Path
from types import FrameType


class StackSampler:
    """Counts each thread's innermost frames every ``interval`` seconds (a sampling profiler, no ptrace)."""

    def __init__(self, interval: float = 0.005, depth: int = 3) -> None:
        self._interval, self._depth = interval, depth
        self.counts: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        # Per thread: samples in which each function was anywhere on the stack.
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> StackSampler:
        self._thread.start()
        return self

    def start(self) -> None:
        self._thread.start()

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        own = threading.get_ident()
        while not self._stop.wait(self._interval):
            for ident, frame in sys._current_frames().items():
                if ident == own or names.get(ident) == "stack-report":
                    continue
                if ident not in names:
                    names = {thread.ident: thread.name for thread in threading.enumerate()}
                parts: list[str] = []
                current: FrameType | None = frame
                while current is not None and len(parts) < self._depth:
                    code = current.f_code
                    parts.append(f"{code.co_name} ({Path(code.co_filename).name}:{current.f_lineno})")
                    current = current.f_back
                name = names.get(ident, str(ident))
                self.counts[name][" <- ".join(parts)] += 1
                seen: set[str] = set()
                while current is not None:
                    code = current.f_code
                    seen.add(f"{code.co_name} ({Path(code.co_filename).name})")
                    current = current.f_back
                seen.update(part.rsplit(":", 1)[0] + ")" for part in parts)
                self.inclusive[name].update(seen)

    def report(self, top: int = 20) -> str:
        lines = []
        for name, counter in sorted(self.counts.items(), key=lambda item: -sum(item[1].values())):
            total = sum(counter.values())
            lines.append(f"thread {name}: {total} samples")
            lines.extend(f"  {100 * count / total:5.1f}%  {where}" for where, count in counter.most_common(top))
            lines.append("  inclusive (anywhere on the stack):")
            lines.extend(f"    {100 * count / total:5.1f}%  {where}"
                         for where, count in self.inclusive[name].most_common(top))
        return "\n".join(lines)
