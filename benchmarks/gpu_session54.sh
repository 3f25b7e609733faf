#!/usr/bin/env bash
# GPU, the next device session (written 2026-12-06, stop 53). After the mlx-cuda install (gpu_common.sh's header).
# usage: bash benchmarks/gpu_session54.sh OUT table|disk
#   table: issue 28's table on both shapes (gpu_session53d.sh, about 170 s): the first with the unpadded decode
#          (model/unpadded_decode.py) and the spread copies; the 1B one-stream figure is the one to read.
#   disk:  issue 31's restart target (H200 only, the target's machine): the 8B restart hit of a 24k-token prompt
#          against cold prefill, exact pieces and 8-bit pieces (about 300 s).
set -uo pipefail
out=${1:-$OUT}; part=${2:-table}
case $part in
table) exec bash "$(dirname "$0")/gpu_session53d.sh" "$out" ;;
disk)
  source benchmarks/gpu_common.sh
  shape=llama-3.1-8b; model $shape
  for bits in exact 8; do
    flags=(--serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592)
    [ $bits = 8 ] && flags+=(--serve-flag=--prompt-cache-kv-bits=8)
    echo "== restart, $bits"
    timeout 150 python3 benchmarks/disk_restart.py --model-path /root/models/$shape --system-words 24000 --repeats 2 \
      --warm-first "${flags[@]}" --json $out/restart-$bits.json 2>&1 | grep -v "^disk_stats\|^start_up" | tail -16
  done ;;
*) echo "unknown part $part"; exit 2 ;;
esac
