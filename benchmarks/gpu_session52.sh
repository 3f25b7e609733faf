#!/usr/bin/env bash
# GPU, 2026-12-06 (stop 52): the step where rows finish. gpu_session51.sh found every 64-stream round's last token
# 336 ms late (16 streams: 93 ms): a finished row's KV copy was queued on its own, which on CUDA waits for the step
# in flight, once a row, and the batch's filter read back a padding gathered behind that step. This tree (the copies
# ride with the next step, the padding kept on the host) against the tree before it (.before/: mkdir .before &&
# git archive 2b4f569 | tar -x -C .before; carried), alternating; 8B, --api-processes 2, 1/16/64 streams of 256
# tokens and two wave rounds each; then the floor once.
# usage: bash benchmarks/gpu_session52.sh OUT [SHAPE]   (about 350 s after the install; one call)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
for run in ". after-1" ".before before-1" ". after-2" ".before before-2"; do
  SERVE_TIMEOUT=130 serve_tree $run --streams 1,16,64 --wave-rounds 2 --deadline-s 110
done
echo "== floor"
timeout 90 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 1,16,64 --skip-mlxcel \
  --floor-runs 1 --out $out/floor.json 2>&1 | show
