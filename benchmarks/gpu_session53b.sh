#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 53): does the pipelined decode step copy each layer's KV buffer
# (benchmarks/kv_copy_probe.py)? 8B shape, 64 and 16 rows, contexts 32 / 480 / 1,500. About 150 s after the install.
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
timeout 200 python3 benchmarks/kv_copy_probe.py --model-path /root/models/$shape --batch 64 --contexts 32,480,1500 \
  2>&1 | tee $out/kv-copy-64.txt | grep -v "^\[trans"
timeout 100 python3 benchmarks/kv_copy_probe.py --model-path /root/models/$shape --batch 16 --contexts 32,1500 \
  2>&1 | tee $out/kv-copy-16.txt | grep -v "^\[trans"
