#!/usr/bin/env bash
# H200 (written 2026-12-05, a session without a device): issue 28's wave across the last two sessions' changes,
# one part per device call. Three trees, each run once, in the order given (carry before/ and before2/ with
# .gpu2 and .tok; about 5 MB each):
#   before2/ = 6d2d395 (before the powers-of-two start passes):  mkdir before2 && git archive 6d2d395 | tar -x -C before2
#   before/  = ccc9ea4 (powers of two, no start passes planned ahead): mkdir before && git archive ccc9ea4 | tar -x -C before
#   .        = this tree (start passes planned ahead, arrivals looked up while a start pass runs)
# usage: bash benchmarks/gpu_session45.sh OUT PART
#   ab8: 8B, three wave rounds and 64 streams x 128 tokens per tree, with the phase timers (the wave's step timeline)
#   ab1: 1B, the same
set -uo pipefail
out=${1:-$OUT}; part=${2:-ab8}
source benchmarks/gpu_common.sh
run_tree() {  # SHAPE TREE TAG
  [ -d $2 ] || { echo "== $3: no tree $2"; return; }
  cp benchmarks/serve_under_timers.py $2/benchmarks/serve_under_timers.py 2>/dev/null
  echo "== $1 $3"
  (cd $2 && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$1 \
    --skip-floor --streams 64 --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 120 \
    --out $out/ab-$1-$3.json --server-timers $out/timers-ab-$1-$3.jsonl 2>&1 | show)
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-ab-$1-$3.jsonl $out/ab-$1-$3.json 2>&1 \
    | grep "^wave round\|^64 streams\|^wave: steps" | cut -c1-900
}
case $part in
ab8) shape=llama-3.1-8b ;;
ab1) shape=llama-3.2-1b ;;
*) echo "unknown part $part"; exit 2 ;;
esac
model $shape
run_tree $shape before2 6d2d395
run_tree $shape before ccc9ea4
run_tree $shape . tree
