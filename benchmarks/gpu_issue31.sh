#!/usr/bin/env bash
# Issue 31's H200 figures in two device calls, after the mlx-cuda install.
# usage: bash benchmarks/gpu_issue31.sh OUT a|b
#   a: the disk read path: per-stage rates, the tier end to end (32k tokens of the 8B KV shape, exact and
#      8-bit pieces), and the 8B restart hit against cold prefill (exact pieces)
#   b: the restart hit with 8-bit pieces, then warm TTFT through HTTP, exact against --prompt-cache-kv-bits 8
set -uo pipefail
out=${1:-$OUT}; part=${2:-a}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
eight=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $eight llama-3.1-8b >/dev/null 2>&1
restart() {  # $1: label, then serve flags
  label=$1; shift
  flags=(); for flag in "$@"; do flags+=(--serve-flag="$flag"); done
  timeout 200 python3 benchmarks/disk_restart.py --model-path $eight --system-words 24000 --repeats 2 \
    --serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592 "${flags[@]}" \
    --json $out/restart-$label.json 2>&1 | grep -v "^disk_stats\|^start_up" | tail -16
}
if [ "$part" = a ]; then
  nproc; free -g | head -2
  timeout 90 python3 benchmarks/disk_load_profile.py --pieces 32 --piece-mib 32 2>&1 | tail -2
  for bits in 0 8; do
    timeout 120 python3 -m benchmarks.disk_load_profile --end-to-end --tokens 32768 --repeats 3 --kv-bits $bits 2>&1 | tail -2
  done
  restart exact
else
  restart kv8 --prompt-cache-kv-bits=8
  timeout 300 python3 -m mlxcel bench --compare --serial-servers --model-path $eight --peer none \
    --peer-command "python3 -m mlxcel serve -m {model} --port {port} --prompt-cache-kv-bits 8" \
    --conversations 16 --turns 3 --system-tokens 8000 --concurrency 1 --unseen 0 --no-floor \
    --out $out/bench-kv8 2>&1 | tail -30
fi
