#!/usr/bin/env bash
# H200, 2026-12-03 second session, after the mlx-cuda install, in two calls.
#   read: the disk read path's variants (pieces verified ahead, threads per checksum, a no-checksum ceiling;
#         the run of 2026-12-03 also had --load-window, MLX reading several pieces at once, taken out after
#         it), exact and 8-bit pieces; then the 8B restart hit with 8-bit pieces, the
#         new server warmed by one unrelated prompt first; then n-gram speculation after the gate fix.
#   http: warm TTFT through HTTP, exact against --prompt-cache-kv-bits 8; the exact restart hit warmed first.
# usage: bash benchmarks/gpu_session39b.sh OUT read|http
set -uo pipefail
out=${1:-$OUT}; part=${2:-read}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
restart() {  # $1: label, then serve flags
  label=$1; shift
  flags=(); for flag in "$@"; do flags+=(--serve-flag="$flag"); done
  timeout 200 python3 benchmarks/disk_restart.py --model-path $m --system-words 24000 --repeats 2 --warm-first \
    --serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592 "${flags[@]}" \
    --json $out/restart-$label.json 2>&1 | grep -v "^disk_stats\|^start_up" | tail -16
}
if [ "$part" = read ]; then
  timeout 100 python3 -m benchmarks.disk_load_profile --end-to-end --tokens 16384 --repeats 2 \
    --read-ahead 3,6 --hash-threads auto,1 --no-verify-ceiling 2>&1 | grep '^{'
  timeout 60 python3 -m benchmarks.disk_load_profile --end-to-end --tokens 16384 --repeats 2 --kv-bits 8 \
    --read-ahead 3 --hash-threads auto 2>&1 | grep '^{'
  restart kv8 --prompt-cache-kv-bits=8
  timeout 150 python3 benchmarks/speculative.py --model-path $m --workloads repeat,fresh --streams 1,16 \
    --reply-tokens 128 --warmup-tokens 24 --modes ngram --out $out/spec8b-gate.json 2>&1 | grep -v "Warning\|tokenizer"
else
  restart exact
  timeout 300 python3 -m mlxcel bench --compare --serial-servers --model-path $m --peer none \
    --peer-command "python3 -m mlxcel serve -m {model} --port {port} --prompt-cache-kv-bits 8" \
    --conversations 16 --turns 3 --system-tokens 8000 --concurrency 1 --unseen 0 --no-floor \
    --out $out/bench-kv8 2>&1 | tail -30
fi
