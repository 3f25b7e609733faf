#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): the 8B shape's 64-stream step on one machine, three ways: the floor, the
# server (twice, each stream's token times and the device's step records), and the executor alone with the
# replies' text made at the edge as the server's API processes do (executor_decode.py --edge-output); the GPU's
# clocks and power sampled all along (a throttled card would double every step).
# usage: bash benchmarks/gpu_session54c.sh OUT   (about 400 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
shape=llama-3.1-8b; model $shape
sample_gpu
for round in 1 2; do
  echo "== server round $round"
  floor=$([ $round = 1 ] && echo "--floor-runs 1" || echo "--skip-floor")
  timeline_round round$round 16,64 170 $floor
done
echo "== executor alone, edge output"
timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/$shape --batches 16,64 --edge-output 2>&1 \
  | grep "^|"
echo "== clocks: samples, SM MHz min/median/max, power W median"
python3 - $out/smi.csv <<'PY'
import statistics, sys
rows = [line.split(", ") for line in open(sys.argv[1]) if line.count(",") >= 5]
sm = [float(r[2].split()[0]) for r in rows if r[2].split()[0].replace(".", "").isdigit()]
power = [float(r[4].split()[0]) for r in rows if r[4].split()[0].replace(".", "").isdigit()]
print(len(rows), min(sm), statistics.median(sm), max(sm), statistics.median(power))
PY
