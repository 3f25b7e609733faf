#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): where the 64-stream round's time goes between the per-token interval (the
# median gap) and the aggregate rate (the mean): each stream's token times (decode_speed --keep-token-times, read
# by token_timeline.py) and the device's own step records (serve_under_timers.py); then the 1B shape's floor,
# server and executor alone (executor_decode.py) on one machine.
# usage: bash benchmarks/gpu_session54b.sh OUT   (about 300 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
for shape in llama-3.1-8b llama-3.2-1b; do
  model $shape
  echo "== $shape"
  if [ $shape = llama-3.1-8b ]; then timeline_round timeline-$shape 16,64 200 --skip-floor
  else timeline_round timeline-$shape 1,64 200 --floor-runs 1; fi
done
echo "== executor alone, llama-3.2-1b"
timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.2-1b --batches 1,64 2>&1 | grep "^|"
