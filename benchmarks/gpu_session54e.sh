#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): the steady state of 64 streams beside their floor, on both shapes, with each
# stream's token times, the device's step records and the GPU's utilization sampled (does the device wait for
# the host, and in which steps).
# usage: bash benchmarks/gpu_session54e.sh OUT   (about 250 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,clocks.mem,power.draw,temperature.gpu \
  --format=csv,noheader -lms 250 > $out/smi.csv 2>&1 &
smi=$!
for shape in llama-3.1-8b llama-3.2-1b; do
  model $shape
  echo "== $shape"
  timeout 200 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 64 \
    --reply-tokens 256 --skip-wave --skip-conversations --floor-runs 1 --deadline-s 180 --keep-token-times \
    --mlxcel-args "--api-processes 2" --out $out/steady-$shape.json --server-timers $out/timers-$shape.jsonl 2>&1 | show
  python3 benchmarks/token_timeline.py $out/steady-$shape.json --level 64 --shown 12
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$shape.jsonl $out/steady-$shape.json $out/smi.csv \
    2>&1 | cut -c1-1200
done
kill $smi
