#!/usr/bin/env bash
# H200, 2026-12-05 (third session that day): issue 28's figures on this tree, and its wave against the tree
# before the last two sessions' scheduling changes, on one machine. One part per device call.
#   before2/ = 6d2d395 (before the powers-of-two start passes and the start passes planned ahead; carried with
#              .gpu2 and .tok): mkdir before2 && git archive 6d2d395 | tar -x -C before2
#   before/  = 18a8a04 (before this session's step that queues the logprobs matrix, not a row each):
#              mkdir before && git archive 18a8a04 | tar -x -C before
# usage: bash benchmarks/gpu_session46.sh OUT PART
#   eight: 8B floor and mlxcel at 1/16/64 streams (128 tokens) and three wave rounds, with the phase timers;
#          then before/'s 16 and 64 streams and three wave rounds
#   one:   1B as in eight (this tree, then before/); then before2/'s 8B wave and 64 streams
set -uo pipefail
out=${1:-$OUT}; part=${2:-eight}
source benchmarks/gpu_common.sh
decode() {  # SHAPE
  s=$SECONDS; model $1; echo "== $1 tree (model ready in $((SECONDS - s)) s)"
  timeout 230 python3 -m benchmarks.decode_speed --model-path /root/models/$1 --streams 1,16,64 \
    --reply-tokens 128 --skip-conversations --floor-runs 1 --wave-rounds 3 --deadline-s 190 \
    --out $out/decode-$1.json --server-timers $out/timers-$1.jsonl 2>&1 | show
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$1.jsonl $out/decode-$1.json 2>&1 \
    | grep "^wave round\|^64 streams\|^16 streams\|^1 streams\|^wave: steps" | cut -c1-900
}
other() {  # TREE SHAPE STREAMS
  [ -d $1 ] || { echo "== no $1/"; return; }
  cp benchmarks/serve_under_timers.py $1/benchmarks/serve_under_timers.py
  echo "== $2 $1 ($(cat $1/.commit 2>/dev/null))"
  (cd $1 && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$2 \
    --skip-floor --streams $3 --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 120 \
    --out $out/$1-$2.json --server-timers $out/timers-$1-$2.jsonl 2>&1 | show)
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$1-$2.jsonl $out/$1-$2.json 2>&1 \
    | grep "^wave round\|^64 streams\|^16 streams\|^wave: steps" | cut -c1-900
}
case $part in
eight) decode llama-3.1-8b; other before llama-3.1-8b 16,64 ;;
one) decode llama-3.2-1b; other before llama-3.2-1b 16,64; model llama-3.1-8b; other before2 llama-3.1-8b 64 ;;
*) echo "unknown part $part"; exit 2 ;;
esac
