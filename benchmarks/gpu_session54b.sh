#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): where the 64-stream round's time goes between the per-token interval (the
# median gap) and the aggregate rate (the mean): each stream's token times (decode_speed --keep-token-times, read
# by token_timeline.py) and the device's own step records (serve_under_timers.py); then the 1B shape's floor,
# server and executor alone (executor_decode.py) on one machine.
# usage: bash benchmarks/gpu_session54b.sh OUT   (about 300 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
timeline() {  # SHAPE STREAMS FLOOR_FLAG
  local shape=$1 streams=$2 floor=$3
  model $shape
  echo "== $shape, streams $streams"
  timeout 200 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams $streams \
    --reply-tokens 256 --skip-wave --skip-conversations $floor --deadline-s 180 --keep-token-times \
    --mlxcel-args "--api-processes 2" --out $out/timeline-$shape.json \
    --server-timers $out/timers-$shape.jsonl 2>&1 | show
  for level in ${streams//,/ }; do
    echo "-- $level streams"
    python3 benchmarks/token_timeline.py $out/timeline-$shape.json --level $level --shown 14
  done
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$shape.jsonl $out/timeline-$shape.json 2>&1 \
    | head -60 | cut -c1-220
}
timeline llama-3.1-8b 16,64 --skip-floor
timeline llama-3.2-1b 1,64 "--floor-runs 1"
echo "== executor alone, llama-3.2-1b"
timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.2-1b --batches 1,64 2>&1 | grep "^|"
