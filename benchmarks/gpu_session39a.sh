#!/usr/bin/env bash
# First H200 call of 2026-12-03's second session (after the mlx-cuda install): the figures the last session's
# device time did not reach. Rows leaving by slices (batch_join_cost), the 64-conversation round after it, and
# the 8B restart hit against cold prefill (exact pieces).
# usage: bash benchmarks/gpu_session39a.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
nproc; free -g | head -2
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
timeout 70 python3 benchmarks/batch_join_cost.py --rows 16,32 --repeats 2 2>&1 | tail -3
timeout 200 python3 -m benchmarks.decode_speed --model-path $m --skip-floor --skip-streams --skip-wave \
  --out $out/conversations-8b.json 2>&1 | grep "^|\|mlxcel:"
timeout 190 python3 benchmarks/disk_restart.py --model-path $m --system-words 24000 --repeats 2 \
  --serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592 \
  --json $out/restart-exact.json 2>&1 | grep -v "^disk_stats\|^start_up" | tail -16
