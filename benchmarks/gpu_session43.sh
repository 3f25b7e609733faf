#!/usr/bin/env bash
# H200, 2026-12-05: issue 28's figures on the tree as it is (the arrival window that fills the first pass,
# a pass's rows joining in place), one part per device call. usage: bash benchmarks/gpu_session43.sh OUT PART
#   eight: 8B floor and mlxcel at 1/16/64 streams (128 tokens), three wave rounds, with the phase timers;
#          then 64 conversations x 3 turns with --max-step-hit-tokens doubled (65536)
#   rest:  1B floor and mlxcel as above; 8B conversations at the default bound; mlx_lm.server's 8B streams
#   grammar: structured_output at 16 streams on 1B, the tree before the per-row mask threads (before/, an
#          export of dc84101^1) and this one, to tell a regression from a different machine
#   wave:  after the finer start buckets, 8B (with the timers) and 1B: three wave rounds each, and 8B's 64 streams
set -uo pipefail
out=${1:-$OUT}; part=${2:-eight}
source benchmarks/gpu_common.sh
decode() {  # SHAPE [timers]
  s=$SECONDS; model $1; echo "== $1 (model ready in $((SECONDS - s)) s)"
  timers=(); [ -n "${2:-}" ] && timers=(--server-timers $out/timers-$1.jsonl)
  timeout 230 python3 -m benchmarks.decode_speed --model-path /root/models/$1 --streams 1,16,64 \
    --reply-tokens 128 --skip-conversations --floor-runs 1 --wave-rounds 3 --deadline-s 190 \
    --out $out/decode-$1.json "${timers[@]}" 2>&1 | show
}
conversations() {  # BOUND
  echo "== 8B conversations, --max-step-hit-tokens $1"
  timeout 170 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b --skip-floor --skip-streams \
    --skip-wave --mlxcel-args "--max-step-hit-tokens $1" --deadline-s 140 --out $out/conversations-$1.json 2>&1 | show
}
case $part in
eight)
  decode llama-3.1-8b timers
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-llama-3.1-8b.jsonl \
    $out/decode-llama-3.1-8b.json 2>&1 | cut -c1-2000 | tail -20
  conversations 65536 ;;
rest)
  decode llama-3.2-1b
  conversations 32768
  echo "== mlx_lm.server, 8B"
  timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b --skip-floor --skip-mlxcel \
    --skip-conversations --peer mlx_lm --streams 1,16,64 --reply-tokens 128 --deadline-s 120 \
    --out $out/peer-8b.json 2>&1 | show ;;
grammar)
  model llama-3.2-1b
  # That commit's own benchmark fails in its compile-cost part (memos had replaced the lru_caches it clears);
  # today's script runs against that package (checked on the CPU).
  cp benchmarks/structured_output.py before/benchmarks/structured_output.py
  for tree in before .; do
    echo "== $tree"
    (cd $tree && PYTHONPATH=$PWD timeout 140 python3 -m benchmarks.structured_output --model-path /root/models/llama-3.2-1b \
      --streams 16 --repeats 2 2>&1 | grep -A2 "^streams")
  done ;;
wave)
  for shape in llama-3.1-8b llama-3.2-1b; do
    model $shape; echo "== $shape"
    timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --skip-floor --streams 64 \
      --reply-tokens 128 --skip-conversations --wave-rounds 3 --deadline-s 120 --out $out/wave-$shape.json \
      --server-timers $out/timers-wave-$shape.jsonl 2>&1 | show
    python3 benchmarks/serve_under_timers.py --summarize $out/timers-wave-$shape.jsonl $out/wave-$shape.json \
      2>&1 | grep "^wave: steps" | cut -c1-400
  done ;;
esac
