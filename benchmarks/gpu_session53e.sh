#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 53): a batch with no padding and no gaps decodes without a mask
# (model/unpadded_decode.py). 1B shape: the check (logits against the masked step, 1/4/16 equal rows), then the
# server at 1 and 16 streams, this tree against .before/ (git archive fc56745), new, old, new, old; then the
# executor alone at 1 and 16 rows in both trees. About 250 s after the install.
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.2-1b}
source benchmarks/gpu_common.sh
model $shape
timeout 60 python3 benchmarks/unpadded_decode_check.py --model-path /root/models/$shape --rows 1,4,16 2>&1 \
  | tee $out/check.txt | grep "^|\|decode attention"
for run in ". new-1" ".before old-1" ". new-2" ".before old-2"; do
  SERVE_TIMEOUT=60 serve_tree $run --streams 1,16 --skip-wave --deadline-s 45
done
for tree in . .before; do
  echo "== executor alone, $tree"
  (cd $tree && PYTHONPATH=$PWD timeout 60 python3 benchmarks/executor_decode.py --model-path /root/models/$shape \
    --batches 1,16 2>&1 | grep "^|")
done
