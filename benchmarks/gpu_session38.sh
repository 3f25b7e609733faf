#!/usr/bin/env bash
# One H200 session's runs (2026-12-03), after the mlx-cuda install. usage: bash benchmarks/gpu_session38.sh OUT spec|disk
#   spec: the ragged kernel's tests and check (verify passes of several queries), then speculation on the 8B
#         shape (off / ngram / the model as its own draft, repeat and fresh, 1 and 16 streams)
#   disk: the disk read path's stages, the tier end to end (32k tokens, exact and 8-bit), the 8B restart hit
set -uo pipefail
out=${1:-$OUT}; part=${2:-spec}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
if [ "$part" = spec ]; then
  nvidia-smi --query-gpu=name,utilization.gpu,memory.used --format=csv
  timeout 120 python3 -m pytest tests/model/test_ragged_attention.py -q -p no:cacheprovider 2>&1 | tail -3
  timeout 120 python3 benchmarks/ragged_attention_check.py 2>&1 | tee $out/ragged_check.txt
  timeout 270 python3 benchmarks/speculative.py --model-path $m --workloads repeat,fresh --streams 1,16 \
    --reply-tokens 128 --modes ngram,draft --draft-model $m --out $out/spec8b.json 2>&1 | grep -v Warning
  timeout 90 python3 benchmarks/disk_load_profile.py --pieces 32 --piece-mib 32 2>&1 | tail -1
  timeout 120 python3 benchmarks/disk_copy_options.py 2>&1 | tail -1
elif [ "$part" = disk ]; then
  nproc
  timeout 90 python3 benchmarks/disk_load_profile.py --pieces 32 --piece-mib 32 2>&1 | tail -2
  for bits in 0 8; do
    timeout 120 python3 -m benchmarks.disk_load_profile --end-to-end --tokens 32768 --repeats 3 --kv-bits $bits 2>&1 | tail -2
  done
  timeout 200 python3 benchmarks/disk_restart.py --model-path $m --system-words 24000 --repeats 2 \
    --serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592 --json $out/restart-exact.json 2>&1 \
    | grep -v "^disk_stats\|^start_up" | tail -16
fi
if [ "$part" = gil ]; then
  timeout 100 python3 benchmarks/batch_join_cost.py --rows 8,16,32 2>&1 | tail -3
  # The device thread's wait for the GIL behind the event loop: Python's 5 ms switch interval against 0.5 ms.
  timeout 280 python3 -m benchmarks.decode_speed --model-path $m --reply-tokens 128 --streams 1,16,64 \
    --skip-conversations --out $out/gil-default.json 2>&1 | grep "^|\|mlxcel:"
  MLXCEL_SWITCH_INTERVAL_S=0.0005 timeout 200 python3 -m benchmarks.decode_speed --model-path $m --reply-tokens 128 \
    --streams 1,16,64 --skip-floor --skip-conversations --out $out/gil-05ms.json 2>&1 | grep "^|\|mlxcel:"
fi
