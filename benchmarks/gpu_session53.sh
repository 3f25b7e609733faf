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
for run in ". new-1" ".before old-1" ".before old-2" ". new-2"; do
  SERVE_TIMEOUT=100 serve_tree $run --streams 16,64 --skip-wave --deadline-s 90
done
finish_probe 64
