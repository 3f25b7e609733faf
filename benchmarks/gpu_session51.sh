#!/usr/bin/env bash
# GPU, 2026-12-06: why the 8B step at 16 and 64 streams stays above the floor once the engine's loop is nearly
# idle (--api-processes 2: 13-30 us of loop CPU a token). One machine session, in order:
#   1. the server at 16 and 64 streams (256 tokens) with the phase timers and nvidia-smi's utilization beside
#      them (is the GPU busy while the host builds the next step?);
#   2. the executor alone at 16 and 64 rows against the floor (executor_decode.py: no actors, no HTTP);
#   3. the server at 16 streams under the sampling profiler: where the device thread spends a step.
# usage: bash benchmarks/gpu_session51.sh OUT [SHAPE]
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
s=$SECONDS; model $shape; echo "== $shape model ready in $((SECONDS - s)) s"
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > $out/gpu.csv &
smi=$!
echo "== server, --api-processes 2, timers"
timeout 200 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 16,64 --reply-tokens 256 \
  --skip-wave --skip-conversations --floor-runs 1 --deadline-s 170 --mlxcel-args "--api-processes 2" \
  --out $out/timed.json --server-timers $out/timers.jsonl 2>&1 | show
kill $smi
python3 benchmarks/serve_under_timers.py --summarize $out/timers.jsonl $out/timed.json $out/gpu.csv 2>&1 \
  | grep "^64 streams\|^16 streams" | grep -o "^[0-9]* streams\|[0-9.]* ms between device steps\|[0-9.]* ms waiting in eval\|GPU utilization [^;]*"
echo "== executor alone"
timeout 150 python3 benchmarks/executor_decode.py --model-path /root/models/$shape --batches 16,64 --steps 64 2>&1 \
  | grep "^|"
echo "== server, --api-processes 2, 16 streams, sampled stacks"
timeout 120 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 16 --reply-tokens 256 \
  --skip-floor --skip-wave --skip-conversations --deadline-s 100 --mlxcel-args "--api-processes 2" \
  --out $out/stacks.json --server-stacks $out/stacks.txt 2>&1 | show
grep -A 45 "thread mlxcel-device" $out/stacks.txt | head -50
