#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 53): the finished rows' copies spread over the next decode steps (batch_step's
# RIDER_BUDGET / RIDER_SPREAD_STEPS) against the tree before it (.before/: git archive fc56745), 64 streams, new,
# old, new, old; then the new tree with the GIL's switch interval at 0.5 ms (a sitecustomize on the server's path)
# at 16 and 64 streams; the finishing-step probe; the executor alone against the floor (pipelined, 16 and 64 rows).
# usage: bash benchmarks/gpu_session53c.sh OUT [SHAPE]   (about 420 s after the install; one call)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
for run in ". new-1" ".before old-1" ". new-2" ".before old-2"; do
  SERVE_TIMEOUT=75 serve_tree $run --streams 64 --skip-wave --deadline-s 60
done
mkdir -p /tmp/gil && echo 'import sys; sys.setswitchinterval(0.0005)' > /tmp/gil/sitecustomize.py
EXTRA_PATH=/tmp/gil SERVE_TIMEOUT=90 serve_tree . new-switch-0.5ms --streams 16,64 --skip-wave --deadline-s 75
finish_probe 64
echo "== executor alone, pipelined"
timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/$shape --batches 16,64 2>&1 \
  | tee $out/executor.txt | grep "^|"
