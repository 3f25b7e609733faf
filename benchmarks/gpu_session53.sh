#!/usr/bin/env bash
# GPU, next device session (written 2026-12-06, stop 52): first, the question stop 52 left open. On machine B the
# 16-stream per-token interval was slower with stop 52's changes in both pairs (11.05 against 9.24 ms, 12.79 against
# 8.57 ms), which machine A's pairs (7.69-7.71 against 7.64-7.76 ms) did not show. This runs the final tree (with
# RowView, not yet on a GPU) against the tree at stop 52's start (.before/: mkdir .before && git archive 2b4f569 |
# tar -x -C .before; carried) at 16 and 64 streams, four rounds in the order new, old, old, new; then
# finish_step_probe.py at 64 streams (the finishing steps' ms; stop 52 on A: 344 ms before the changes).
# usage: bash benchmarks/gpu_session53.sh OUT [SHAPE]   (about 330 s after the install; one call)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
serve() {  # TREE TAG
  echo "== $2"
  (cd $1 && PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.decode_speed --model-path /root/models/$shape \
    --skip-floor --streams 16,64 --reply-tokens 256 --skip-wave --skip-conversations --deadline-s 90 \
    --mlxcel-args "--api-processes 2" --out $out/$2.json 2>&1 | grep "^| [16]")
}
serve . new-1; serve .before old-1; serve .before old-2; serve . new-2
echo "== finish_step_probe, 64 streams"
timeout 100 python3 benchmarks/finish_step_probe.py /root/models/$shape --streams 64 --reply-tokens 256 --shown 1 \
  > $out/probe-64.txt 2>&1
grep -v "^\[trans\|llguidance\|^| [0-9]* | [0-9.]* | 64 | 64 | 0 | 0 | 0 |" $out/probe-64.txt | head -30 | cut -c1-160
