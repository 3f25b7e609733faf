"""Where a streams round's time went, from its token times: the steps the clients saw, and the slow ones.

Usage: python benchmarks/token_timeline.py DECODE_SPEED_JSON [--level 64] [--server mlxcel] [--shown 20]

Reads a round that ``decode_speed.py --keep-token-times`` wrote. Every stream gets one token a device step, so
the round's token times, pooled and sorted, fall into bursts, one a step (a new burst starts after a pause of
``--burst-gap-ms``). Prints the median and the mean gap between a stream's tokens (the mean is what the
aggregate rate sees; the median is the per-token interval), the bursts' count and their spacing, and the slowest
spacings with when they came and how many streams had a token in the burst: a start pass, a hold, a slow step.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def bursts(times: list[float], burst_gap_s: float) -> list[tuple[float, int]]:
    """(start, tokens) of each burst of the pooled token times."""
    found: list[tuple[float, int]] = []
    previous = None
    for moment in sorted(times):
        if previous is None or moment - previous > burst_gap_s:
            found.append((moment, 0))
        start, count = found[-1]
        found[-1] = (start, count + 1)
        previous = moment
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("--level", default="64")
    parser.add_argument("--server", default="mlxcel")
    parser.add_argument("--burst-gap-ms", type=float, default=1.0)
    parser.add_argument("--shown", type=int, default=20)
    args = parser.parse_args()
    row = json.loads(args.report.read_text())["servers"][args.server]["streams"][args.level]
    streams = [times for times in row["token_times_s"] if len(times) > 1]
    gaps = [later - earlier for times in streams for earlier, later in zip(times, times[1:], strict=False)]
    means = [(times[-1] - times[0]) / (len(times) - 1) for times in streams]
    print(f"{len(streams)} streams: gap median {1000 * statistics.median(gaps):.2f} ms, mean "
          f"{1000 * statistics.fmean(gaps):.2f} ms (per stream, first to last token: "
          f"{1000 * min(means):.2f}-{1000 * max(means):.2f} ms)")
    first, last = max(times[0] for times in streams), min(times[-1] for times in streams)
    found = bursts([moment for times in streams for moment in times], args.burst_gap_ms / 1000)
    spacing = [(later[0] - earlier[0], earlier, later) for earlier, later in zip(found, found[1:], strict=False)]
    inside = [gap for gap, earlier, _later in spacing if first <= earlier[0] < last]
    print(f"{len(found)} bursts; while every stream decodes ({first:.3f}-{last:.3f} s): {len(inside)} spacings, "
          f"median {1000 * statistics.median(inside):.2f} ms, mean {1000 * statistics.fmean(inside):.2f} ms, "
          f"sum {sum(inside):.3f} s" if inside else f"{len(found)} bursts")
    if inside:
        typical = statistics.median(inside)
        slow = sum(gap - typical for gap in inside if gap > 1.5 * typical)
        print(f"  spacings over 1.5x the median: {sum(1 for gap in inside if gap > 1.5 * typical)}, "
              f"{slow:.3f} s beyond the median's")
    print(f"slowest {args.shown} spacings (ms, at s, tokens in the burst before / after):")
    for gap, earlier, later in sorted(spacing, reverse=True)[: args.shown]:
        print(f"  {1000 * gap:8.2f}  at {earlier[0]:.3f}  {earlier[1]:3d} / {later[1]:3d}"
              f"{'  (all decoding)' if first <= earlier[0] < last else ''}")


if __name__ == "__main__":
    main()
