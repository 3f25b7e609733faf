#!/usr/bin/env bash
# H200, 2026-12-05 (later session): issue 28's wave, stage by stage, one part per device call.
# usage: bash benchmarks/gpu_session44.sh OUT PART
#   intake: 1B and 8B, three wave rounds each with the phase timers; the summary's "wave round" lines say when
#           each round's requests reached the HTTP handler, the router and the scheduling core, and its start steps
#   ab:     the wave and 64 streams on 8B, the tree before this session (before/: mkdir before && git archive 6d2d395 | tar -x -C before; carried with .gpu2 and .tok; with
#           today's serve_under_timers.py copied in) and this one, alternating: start passes in powers of two,
#           the collector frozen after start-up
#   full:   8B and 1B floor and mlxcel at 1/16/64 streams (128 tokens) and three wave rounds; 8B conversations
set -uo pipefail
out=${1:-$OUT}; part=${2:-intake}
source benchmarks/gpu_common.sh
wave() {  # SHAPE TAG [more mlxcel args]
  model $1; echo "== $1 $2 ${3:-}"
  timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$1 --skip-floor --skip-streams \
    --skip-conversations --wave-rounds 3 --deadline-s 120 --out $out/wave-$1-$2.json --mlxcel-args "${3:-}" \
    --server-timers $out/timers-wave-$1-$2.jsonl 2>&1 | show
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-wave-$1-$2.jsonl $out/wave-$1-$2.json \
    2>&1 | grep "^wave round" | cut -c1-700
}
decode() {  # SHAPE
  model $1; echo "== $1"
  timeout 230 python3 -m benchmarks.decode_speed --model-path /root/models/$1 --streams 1,16,64 \
    --reply-tokens 128 --skip-conversations --floor-runs 1 --wave-rounds 3 --deadline-s 190 \
    --out $out/decode-$1.json --server-timers $out/timers-$1.jsonl 2>&1 | show
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$1.jsonl $out/decode-$1.json 2>&1 \
    | grep "^wave round\|^64 streams" | cut -c1-700
}
ab_run() {  # TREE TAG
  (cd $1 && PYTHONPATH=$PWD timeout 140 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b \
    --skip-floor --streams 64 --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 110 \
    --out $out/ab-$2.json --server-timers $out/timers-ab-$2.jsonl 2>&1 | show)
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-ab-$2.jsonl $out/ab-$2.json 2>&1 \
    | grep "^wave round\|^64 streams" | cut -c1-700
}
case $part in
ab)
  model llama-3.1-8b
  cp benchmarks/serve_under_timers.py before/benchmarks/serve_under_timers.py
  for round in 1 2; do
    echo "== before $round"; ab_run before before$round
    echo "== after $round"; ab_run . after$round
  done ;;
intake)
  wave llama-3.2-1b tree
  wave llama-3.1-8b tree ;;
full)
  decode llama-3.1-8b
  decode llama-3.2-1b
  echo "== 8B conversations"
  timeout 170 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b --skip-floor --skip-streams \
    --skip-wave --deadline-s 140 --out $out/conversations.json 2>&1 | show ;;
esac
