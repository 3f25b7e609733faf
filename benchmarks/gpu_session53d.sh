#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 53): issue 28's table as it stands, both shapes, one call: decode_speed with its
# in-process floor, 1/16/64 streams of 256 tokens and the wave of 64, --api-processes 2 (no 8k conversations).
# usage: bash benchmarks/gpu_session53d.sh OUT   (about 450 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
for shape in llama-3.1-8b llama-3.2-1b; do
  model $shape
  echo "== $shape"
  timeout $([ $shape = llama-3.1-8b ] && echo 235 || echo 195) python3 -m benchmarks.decode_speed \
    --model-path /root/models/$shape --streams 1,16,64 --reply-tokens 256 --skip-conversations --floor-runs 1 \
    --deadline-s $([ $shape = llama-3.1-8b ] && echo 215 || echo 175) --mlxcel-args "--api-processes 2" \
    --out $out/decode-$shape.json 2>&1 | show
done
