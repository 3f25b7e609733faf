"""Run ``mlxcel ARGS...`` (a server) with timers on the device thread and the Trio loop, for a profile on the GPU.

Usage: python benchmarks/serve_under_timers.py REPORT -- ARGS...
       python benchmarks/serve_under_timers.py --summarize REPORT DECODE_SPEED_JSON [NVIDIA_SMI_CSV]

Where a decode step's wall time goes, without a sampler taking the GIL: the
device thread's time waiting for its next message, in the executor's step,
in the batch's decode step (``model/batch_step.step``) building its graph and
waiting in ``mx.eval`` for the step before it; and the loop's time outside
its I/O wait (a Trio instrument). Each device step is also recorded (when it
began, its seconds, its starts and their prompt tokens): the summary lists a
wave's steps with starts, its admission timeline. Every 0.2 s one JSON line of cumulative
counters is appended to REPORT (``mlxcel serve`` ends with ``os._exit``, so
nothing runs at exit); differences between lines give each phase's share of
a window, to set beside ``nvidia-smi``'s utilization samples.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

_counters: dict[str, float] = {"receive_s": 0.0, "receives": 0, "receive_decoding_s": 0.0, "run_step_s": 0.0, "steps": 0,
                               "batch_step_s": 0.0, "batch_steps": 0, "batch_rows": 0, "step_eval_wait_s": 0.0,
                               "loop_io_wait_s": 0.0, "loop_io_waits": 0, "loop_cpu_s": 0.0,
                               "gc_s": 0.0, "gc_full_s": 0.0, "gc_runs": 0, "gc_full_runs": 0,
                               "render_s": 0.0, "renders": 0}
_in_step = threading.local()
_last_rows = [0]  # the last batch step's rows: a wait for a plan after it is a hand-over
IDLE_GAP_S = 0.5
# Short next to decode_speed's rounds (a few seconds), which a summary's window is cut to.
REPORT_INTERVAL_S = 0.2
_decoding_waits: list[float] = []  # since the last line written
# Each device step since the last line written: (wall clock at its start, seconds, starts, their prompt tokens).
_step_records: list[tuple[float, float, int, int]] = []
# A wave's intake since the last line written, on time.monotonic() (the clock decode_speed's "sent" uses):
# (stage, moment[, seconds, starts]) for each HTTP request handled, each request routed, each request the
# scheduling core adds, and each device step that starts requests.
_intake: list[tuple[Any, ...]] = []


def _time_collections() -> None:
    """Python's cyclic collector: seconds in all its runs and in its full (oldest generation) runs."""
    import gc

    began = [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
            return
        seconds = time.perf_counter() - began[0]
        _counters["gc_s"] += seconds
        _counters["gc_runs"] += 1
        if info.get("generation") == 2:
            _counters["gc_full_s"] += seconds
            _counters["gc_full_runs"] += 1

    gc.callbacks.append(callback)


def install() -> None:
    import mlx.core as mx
    import trio
    from quart_trio import QuartTrio

    from mlxcel.actors.device import DeviceActor
    from mlxcel.actors.router import RouterActor
    from mlxcel.core.scheduler import SchedulerCore
    from mlxcel.model import batch_step
    from mlxcel.model.prompt import PromptRenderer

    def stamped(cls: Any, name: str, stage: str) -> None:
        original = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            _intake.append((stage, time.monotonic()))
            return original(*args, **kwargs)

        setattr(cls, name, wrapper)

    _time_collections()
    original_render = PromptRenderer.render

    def render(*args: Any, **kwargs: Any) -> Any:
        # This process's template and tokenizer work (with --api-processes, the API processes do most of it).
        started = time.thread_time()
        try:
            return original_render(*args, **kwargs)
        finally:
            _counters["render_s"] += time.thread_time() - started
            _counters["renders"] += 1

    PromptRenderer.render = render
    stamped(QuartTrio, "handle_request", "http")
    stamped(RouterActor, "_dispatch", "route")
    stamped(SchedulerCore, "add", "add")

    original_receive = DeviceActor._receive

    def receive(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return original_receive(*args, **kwargs)
        finally:
            waited = time.perf_counter() - started
            _counters["receive_s"] += waited
            _counters["receives"] += 1
            if _last_rows[0] and waited < IDLE_GAP_S:  # waits between rounds are idle, not hand-over
                _counters["receive_decoding_s"] += waited
                _decoding_waits.append(waited)

    DeviceActor._receive = receive
    original_run_step = DeviceActor._run_step

    def run_step(self: Any, worker: Any, disk: Any, plan: Any) -> Any:
        opened, started, moment = time.time(), time.perf_counter(), time.monotonic()
        try:
            return original_run_step(self, worker, disk, plan)
        finally:
            seconds = time.perf_counter() - started
            _counters["run_step_s"] += seconds
            _counters["steps"] += 1
            # A StartAlone carries no prompt tokens of its own (its chunks do): counted as none.
            _step_records.append((opened, seconds, len(plan.starts),
                                  sum(len(getattr(start, "prompt_tokens", ())) for start in plan.starts)))
            if plan.starts:
                _intake.append(("step", moment, seconds, len(plan.starts)))

    DeviceActor._run_step = run_step
    original_step, original_eval = batch_step.step, mx.eval

    def step(self: Any) -> Any:
        started = time.perf_counter()
        _in_step.active = True
        try:
            return original_step(self)
        finally:
            _in_step.active = False
            _counters["batch_step_s"] += time.perf_counter() - started
            _counters["batch_steps"] += 1
            _counters["batch_rows"] += len(self.uids)
            _last_rows[0] = len(self.uids)

    def timed_eval(*args: Any) -> Any:
        if not getattr(_in_step, "active", False):
            return original_eval(*args)
        started = time.perf_counter()
        try:
            return original_eval(*args)
        finally:
            _counters["step_eval_wait_s"] += time.perf_counter() - started

    batch_step.step = step  # install() reads the module's global when the executor starts
    mx.eval = timed_eval

    class LoopIdle(trio.abc.Instrument):
        _woke = time.thread_time()

        def before_io_wait(self, timeout: float) -> None:
            self._started = time.perf_counter()
            _counters["loop_cpu_s"] += time.thread_time() - self._woke  # the loop thread's own CPU, GIL waits not

        def after_io_wait(self, timeout: float) -> None:
            _counters["loop_io_wait_s"] += time.perf_counter() - self._started
            _counters["loop_io_waits"] += 1
            self._woke = time.thread_time()

    original_run = trio.run

    def run(*args: Any, **kwargs: Any) -> Any:
        kwargs["instruments"] = [*kwargs.get("instruments", ()), LoopIdle()]
        return original_run(*args, **kwargs)

    trio.run = run


def _children_cpu_seconds() -> float:
    """The CPU time of this process's children (the API processes of ``--api-processes``), from /proc."""
    me, total = os.getpid(), 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def _at(lines: list[dict[str, float]], moment: float) -> dict[str, float]:
    """The last counters written at or before ``moment`` (the first line if none)."""
    before = [line for line in lines if line["t"] <= moment]
    return before[-1] if before else lines[0]


def summarize(report: Path, decode_json: Path, gpu_csv: Path | None) -> None:
    """Each round's window of decode_speed.py: the phases' shares of its wall time, and the GPU's utilization."""
    lines = [json.loads(line) for line in report.read_text().splitlines() if line.strip()]
    figures = json.loads(decode_json.read_text())["servers"]["mlxcel"]
    windows = [(f"{level} streams", row["wall_window"]) for level, row in figures.get("streams", {}).items()
               if "wall_window" in row]
    if "wall_window" in figures.get("wave", {}):
        windows.append(("wave", figures["wave"]["wall_window"]))
    samples: list[tuple[float, float]] = []
    if gpu_csv is not None and gpu_csv.exists():
        from datetime import datetime

        for row in gpu_csv.read_text().splitlines():
            stamp, _, utilization = row.partition(",")
            with contextlib.suppress(ValueError):
                moment = datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
                samples.append((moment, float(utilization.split(",")[0].strip().rstrip(" %"))))
    for name, (opened, closed) in windows:
        first, last = _at(lines, opened), _at(lines, closed)
        wall = last["t"] - first["t"]
        if wall <= 0:
            print(f"{name}: no counters inside its window")
            continue
        delta = {key: last[key] - first[key] for key in last if key not in ("t", "waits", "step_records", "intake")}
        waits = sorted(wait for line in lines if first["t"] < line["t"] <= last["t"] for wait in line["waits"])
        median_wait = 1000 * waits[len(waits) // 2] if waits else 0.0
        p90_wait = 1000 * waits[int(0.9 * len(waits))] if waits else 0.0
        steps = max(1, delta["batch_steps"])
        shares = {key: f"{100 * delta[key] / wall:.0f}%" for key in
                  ("receive_s", "receive_decoding_s", "run_step_s", "batch_step_s", "step_eval_wait_s", "loop_io_wait_s")}
        inside = [value for moment, value in samples if opened <= moment <= closed]
        # The counters' lines come every REPORT_INTERVAL_S, so their window may hold idle time around a short
        # round: the median gap between the steps' own records is the interval between device steps.
        records = [record for line in lines for record in line.get("step_records", ())
                   if opened <= record[0] <= closed]
        began = sorted(record[0] for record in records)
        gaps = sorted(later - earlier for earlier, later in zip(began, began[1:], strict=False))
        between = (f"{1000 * gaps[len(gaps) // 2]:.2f} ms between device steps (median of {len(gaps)}); "
                   if gaps else "")
        gpu = f"{sum(inside) / len(inside):.0f}% over {len(inside)} samples" if inside else "-"
        print(f"{name}: {wall:.1f} s, {delta['steps']:.0f} device steps, {delta['batch_steps']:.0f} batch steps "
              f"of {delta['batch_rows'] / steps:.1f} rows; {between}per batch step {1000 * wall / steps:.2f} ms wall, "
              f"{1000 * (delta['batch_step_s'] - delta['step_eval_wait_s']) / steps:.2f} ms in the step outside mx.eval (building, queueing), "
              f"{1000 * delta['step_eval_wait_s'] / steps:.2f} ms waiting in eval, "
              f"{1000 * delta['receive_decoding_s'] / steps:.2f} ms waiting for a plan while decoding "
              f"(median {median_wait:.2f}, p90 {p90_wait:.2f} ms); "
              f"shares of the wall {shares}; loop busy {100 * (1 - delta['loop_io_wait_s'] / wall):.0f}%, "
              f"its CPU {1e6 * delta.get('loop_cpu_s', 0.0) / max(1, delta['batch_rows']):.0f} us a decoded token; "
              f"the API processes' CPU {1e6 * delta.get('api_cpu_s', 0.0) / max(1, delta['batch_rows']):.0f} us "
              f"a decoded token; "
              f"renders here {delta.get('renders', 0):.0f}, {1000 * delta.get('render_s', 0.0):.0f} ms of CPU; "
              f"GPU utilization {gpu}; Python's collector {1000 * delta.get('gc_s', 0.0):.0f} ms in "
              f"{delta.get('gc_runs', 0):.0f} runs, {1000 * delta.get('gc_full_s', 0.0):.0f} ms in "
              f"{delta.get('gc_full_runs', 0):.0f} full runs")
        if records and name != "wave":
            typical = sorted(record[1] for record in records)[len(records) // 2]
            slow = [record for record in records if record[1] > 1.5 * typical]
            print(f"{name}: device steps median {1000 * typical:.2f} ms; {len(slow)} over 1.5x, "
                  f"{sum(record[1] - typical for record in slow):.3f} s beyond the median; slowest (ms into the "
                  "window, step ms, starts): " + "; ".join(
                      f"{1000 * (at - opened):.0f}, {1000 * seconds:.1f}, {count}"
                      for at, seconds, count, _tokens in sorted(records, key=lambda r: -r[1])[:12]))
        if name == "wave":
            # The admission timeline: each device step that started requests, from the window's opening.
            print("wave: steps with starts (ms into the window, starts, their prompt tokens, the step's ms): "
                  + "; ".join(f"{1000 * (at - opened):.0f}: {count}, {tokens}, {1000 * seconds:.1f}"
                              for at, seconds, count, tokens in records if count))
    wave_intake(lines, figures)


def wave_intake(lines: list[dict[str, Any]], figures: dict[str, Any]) -> None:
    """Each wave round's intake: when its requests reached each stage, ms after the round's first send."""
    intake = [record for line in lines for record in line.get("intake", ())]
    for number, round_ in enumerate(figures.get("wave", {}).get("rounds", ())):
        sent = sorted(round_.get("sent", ()))
        if not sent:
            continue
        opened = sent[0]
        closed = max(sent) + max(round_.get("ttfts_s", ()) or [0.0]) + 0.05
        # ttfts_s has only the served requests': first tokens are placed only when every request was served.
        ttfts = round_.get("ttfts_s", ())
        first_tokens = sorted(moment + ttft for moment, ttft in zip(round_["sent"], ttfts, strict=True)) \
            if len(ttfts) == len(round_["sent"]) else []
        stages = {"sent": sent, **{stage: sorted(record[1] for record in intake
                                                 if record[0] == stage and opened - 0.01 <= record[1] <= closed)
                                   for stage in ("http", "route", "add")}, "first token": first_tokens}
        steps = [record for record in intake if record[0] == "step" and opened <= record[1] <= closed]
        print(f"wave round {number}: ms after the first send (first/25%/50%/75%/last): "
              + "; ".join(f"{stage} {_quartiles(moments, opened)} (n={len(moments)})"
                          for stage, moments in stages.items())
              + "; steps with starts (at, ms, starts): "
              + ", ".join(f"{1000 * (at - opened):.0f} {1000 * seconds:.0f} {count}"
                          for _, at, seconds, count in steps))


def _quartiles(moments: list[float], opened: float) -> str:
    """First, 25 %, 50 %, 75 % and last of sorted ``moments``, ms after ``opened``."""
    if not moments:
        return "-"
    picks = [moments[min(len(moments) - 1, int(share * len(moments)))] for share in (0.0, 0.25, 0.5, 0.75)]
    return "/".join(f"{1000 * (moment - opened):.0f}" for moment in [*picks, moments[-1]])


def main() -> None:
    from mlxcel.cli import main as mlxcel_main

    if sys.argv[1:2] == ["--summarize"]:
        report, decode_json, *gpu = sys.argv[2:]
        summarize(Path(report), Path(decode_json), Path(gpu[0]) if gpu else None)
        return
    report, separator, *arguments = sys.argv[1:]
    if separator != "--":
        raise SystemExit("usage: python benchmarks/serve_under_timers.py REPORT -- ARGS...")
    install()

    def write() -> None:
        with Path(report).open("a") as out:
            while not threading.Event().wait(REPORT_INTERVAL_S):
                _counters["api_cpu_s"] = _children_cpu_seconds()
                waits = _decoding_waits[:]
                del _decoding_waits[:len(waits)]
                steps = _step_records[:]
                del _step_records[:len(steps)]
                intake = _intake[:]
                del _intake[:len(intake)]
                out.write(json.dumps({"t": time.time(), **_counters, "waits": waits, "step_records": steps,
                                      "intake": intake}) + "\n")
                out.flush()

    threading.Thread(target=write, daemon=True, name="timer-report").start()
    raise SystemExit(mlxcel_main(arguments))


if __name__ == "__main__":
    main()
