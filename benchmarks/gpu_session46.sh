#!/usr/bin/env bash
# H200, 2026-12-05 (third session that day): issue 28's figures on this tree, and its wave against the tree
# before the last two sessions' scheduling changes, on one machine. One part per device call.
#   before2/ = 6d2d395 (before the powers-of-two start passes and the start passes planned ahead; carried with
#              .gpu2 and .tok): mkdir before2 && git archive 6d2d395 | tar -x -C before2
# usage: bash benchmarks/gpu_session46.sh OUT PART
#   eight: 8B floor and mlxcel at 1/16/64 streams (128 tokens) and three wave rounds, with the phase timers;
#          then before2's three wave rounds and 64 streams
#   one:   the same on 1B; then 8B's 64 conversations x 3 turns
set -uo pipefail
out=${1:-$OUT}; part=${2:-eight}
source benchmarks/gpu_common.sh
decode() {  # SHAPE
  s=$SECONDS; model $1; echo "== $1 tree (model ready in $((SECONDS - s)) s)"
  timeout 230 python3 -m benchmarks.decode_speed --model-path /root/models/$1 --streams 1,16,64 \
    --reply-tokens 128 --skip-conversations --floor-runs 1 --wave-rounds 3 --deadline-s 190 \
    --out $out/decode-$1.json --server-timers $out/timers-$1.jsonl 2>&1 | show
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$1.jsonl $out/decode-$1.json 2>&1 \
    | grep "^wave round\|^64 streams\|^wave: steps" | cut -c1-900
}
before2() {  # SHAPE
  [ -d before2 ] || { echo "== no before2/"; return; }
  cp benchmarks/serve_under_timers.py before2/benchmarks/serve_under_timers.py
  echo "== $1 before2 (6d2d395)"
  (cd before2 && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$1 \
    --skip-floor --streams 64 --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 120 \
    --out $out/before2-$1.json --server-timers $out/timers-before2-$1.jsonl 2>&1 | show)
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-before2-$1.jsonl $out/before2-$1.json 2>&1 \
    | grep "^wave round\|^64 streams\|^wave: steps" | cut -c1-900
}
case $part in
eight) decode llama-3.1-8b; before2 llama-3.1-8b ;;
one)
  decode llama-3.2-1b; before2 llama-3.2-1b
  echo "== 8B conversations"; model llama-3.1-8b
  timeout 170 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b --skip-floor --skip-streams \
    --skip-wave --deadline-s 140 --out $out/conversations.json 2>&1 | show ;;
*) echo "unknown part $part"; exit 2 ;;
esac
