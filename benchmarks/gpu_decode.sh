#!/usr/bin/env bash
# Issue 28's decode benchmark on the H200 (mlx-cuda): the in-process floor, mlxcel and mlx_lm.server on a
# bf16 random-weight Llama shape: 1/16/64 streams of 256 tokens, a wave of 64 short requests, 64 conversations
# on an 8,000-token system prompt for 3 turns. One shape fits one 10-minute device call: from the shape's start,
# no part starts after DEADLINE seconds (default BUDGET - 120) and everything stops at BUDGET (default 570;
# lower it when the same call installs mlx-cuda first).
# usage (on the GPU machine, from the repo root): bash benchmarks/gpu_decode.sh OUT [SHAPE...]
#   SHAPE: llama-3.2-1b (default) | llama-3.1-8b; EXTRA="--flag ..." adds flags to decode_speed.
set -euo pipefail
out=${1:-${OUT:-/tmp/gpu-decode}}; shift || true
shapes=${*:-llama-3.2-1b}
budget=${BUDGET:-570}
deadline=${DEADLINE:-$((budget - 120))}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
mkdir -p "$out"
for shape in $shapes; do
  started=$SECONDS
  model=/root/models/$shape
  # Random init on the GPU and one safetensors write (~17 GB for 8B); skipped while the machine keeps the folder.
  python3 benchmarks/make_bf16_model.py "$model" "$shape"
  echo "model ready in $((SECONDS - started)) s" >&2
  # Four files per shape come back: the JSON, the progress and table, the two servers' logs.
  timeout -s TERM $((budget - (SECONDS - started))) python3 -m benchmarks.decode_speed --model-path "$model" \
    --peer mlx_lm --deadline-s $((deadline - (SECONDS - started))) --out "$out/decode-$shape.json" \
    --log-dir "$out/logs-$shape" ${EXTRA:-} 2>&1 | tee "$out/decode-$shape.txt" || true
done
