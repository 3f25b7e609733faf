#!/usr/bin/env bash
# GPU, 2026-12-05 (fifth session that day): issue 28 after the loop's per-token work was cut (streamed chunks
# framed and written without hypercorn and h11, SSE encoded with orjson, mlx-lm's stats window dropped from
# the step), against the tree before it on the same machine. One part per device call.
#   before4/ = e0aff51 (the tree before): mkdir before4 && git archive e0aff51 mlxcel benchmarks pyproject.toml \
#              | tar -x -C before4 && echo e0aff51 > before4/.commit
# usage: bash benchmarks/gpu_session48.sh OUT PART
#   eight: 8B floor, this tree at 1/16/64 streams (128 tokens) and three wave rounds with the phase timers;
#          then before4/ the same (no floor), then this tree's 1 and 64 streams again
#   one:   1B the same
#   prof:  executor_decode.py --profile on 8B at 1 and 64 rows (where the executor's host time goes)
set -uo pipefail
out=${1:-$OUT}; part=${2:-eight}
source benchmarks/gpu_common.sh
run() {  # TREE SHAPE STREAMS LABEL [more decode_speed flags]
  local tree=$1 shape=$2 streams=$3 label=$4; shift 4
  cp benchmarks/serve_under_timers.py $tree/benchmarks/serve_under_timers.py 2>/dev/null
  echo "== $shape $tree ($(cat $tree/.commit 2>/dev/null || echo this tree)) $label"
  (cd $tree && PYTHONPATH=$PWD timeout 200 python3 -m benchmarks.decode_speed --model-path /root/models/$shape \
    --streams $streams --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 170 "$@" \
    --out $out/$label-$shape.json --server-timers $out/timers-$label-$shape.jsonl 2>&1 | show)
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$label-$shape.jsonl $out/$label-$shape.json 2>&1 \
    | grep "^64 streams\|^16 streams\|^1 streams" | grep -o "^[0-9]* streams\|per batch step [0-9.]* ms wall\|its CPU [0-9]* us a decoded token"
}
both() {  # SHAPE
  s=$SECONDS; model $1; echo "== $1 model ready in $((SECONDS - s)) s"
  run . $1 1,16,64 tree --floor-runs 1
  run before4 $1 1,16,64 before --skip-floor
  [ $SECONDS -lt 420 ] && run . $1 1,64 tree2 --skip-floor --skip-wave
}
case $part in
eight) both llama-3.1-8b ;;
one) both llama-3.2-1b ;;
prof) model llama-3.1-8b
  timeout 300 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.1-8b --batches 1,64 --steps 48 --profile 32 ;;
ab|mask) ;;
*) echo "unknown part $part"; exit 2 ;;
esac
# ab:  8B at 16 and 64 streams, this tree and before4/ alternating, each against its own floor; then prof
if [ "$part" = ab ]; then
  for tree in . before4 . before4; do
    echo "== 16,64 streams $tree ($(cat $tree/.commit 2>/dev/null || echo this tree))"
    (cd $tree && PYTHONPATH=$PWD timeout 110 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b \
      --streams 16,64 --reply-tokens 128 --skip-wave --skip-conversations --floor-runs 1 --deadline-s 90 2>&1 \
      | grep "^| 16 streams: per\|^| 64 streams: per\|^| 64 streams: agg")
  done
  timeout 200 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.1-8b --batches 1,64 --steps 48 --profile 32
fi
# mask: 8B executor alone at 16 and 64 rows, the ragged kernel against MLX's kernel with no mask (an experiment:
#       the rows there have no padding); then the 1B executor alone at 1 and 64 rows, profiled
if [ "$part" = mask ]; then
  for variant in "" --unmasked-decode "" --unmasked-decode; do
    echo "== 8B executor $variant"
    timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.1-8b --batches 16,64 --steps 48 $variant 2>&1 | grep "^| on"
  done
  model llama-3.2-1b
  timeout 150 python3 benchmarks/executor_decode.py --model-path /root/models/llama-3.2-1b --batches 1,64 --steps 48 --profile 32 2>&1 | grep -v transformers
fi
