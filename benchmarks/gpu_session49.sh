#!/usr/bin/env bash
# GPU, 2026-12-05 (sixth session that day): issue 28 with the HTTP edge in processes of its own
# (--api-processes N) against the edge in the engine's process (N = 0), same tree, same machine session.
# usage: bash benchmarks/gpu_session49.sh OUT PART
#   check: a 1B server with --api-processes 2: which processes hold a CUDA context (only the engine's should)
#   eight: 8B floor; N = 0 at 1/16/64 streams (128 tokens) and three wave rounds with the phase timers;
#          N = 2 the same; then N = 4 and N = 0 again at 1 and 64 streams with the wave
#   one:   1B the same
set -uo pipefail
out=${1:-$OUT}; part=${2:-eight}
tokens=${REPLY_TOKENS:-128}  # gpu_session50.sh: 256, as issue 28 measures
source benchmarks/gpu_common.sh
run() {  # SHAPE STREAMS LABEL API_PROCESSES [more decode_speed flags]
  local shape=$1 streams=$2 label=$3 processes=$4; shift 4
  echo "== $shape --api-processes $processes ($label)"
  PYTHONPATH=$PWD timeout 200 python3 -m benchmarks.decode_speed --model-path /root/models/$shape \
    --streams $streams --reply-tokens $tokens --skip-conversations --wave-rounds 3 --deadline-s 170 \
    --mlxcel-args "--api-processes $processes" "$@" \
    --out $out/$label-$shape.json --server-timers $out/timers-$label-$shape.jsonl 2>&1 | show
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$label-$shape.jsonl $out/$label-$shape.json 2>&1 \
    | grep "^64 streams\|^16 streams\|^1 streams" | grep -o "^[0-9]* streams\|[0-9.]* ms between device steps\|its CPU [0-9]* us a decoded token\|API processes. CPU [0-9]* us"
}
all() {  # SHAPE
  s=$SECONDS; model $1; echo "== $1 model ready in $((SECONDS - s)) s"
  run $1 1,16,64 ap0 0 --floor-runs 1
  run $1 1,16,64 ap2 2 --skip-floor
  [ $SECONDS -lt 380 ] && run $1 1,64 ap4 4 --skip-floor
  [ $SECONDS -lt 470 ] && run $1 1,64 ap0b 0 --skip-floor
}
case $part in
eight) all llama-3.1-8b ;;
one) all llama-3.2-1b ;;
check) model llama-3.2-1b
  python3 -m mlxcel serve -m /root/models/llama-3.2-1b --port 8390 --api-processes 2 > $out/check.log 2>&1 &
  for i in $(seq 1 120); do curl -sf localhost:8390/health >/dev/null && break; sleep 1; done
  curl -s localhost:8390/v1/chat/completions -H 'content-type: application/json' \
    -d '{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}' | head -c 300; echo
  echo "== processes"; pgrep -af "mlxcel" | cut -c1-150
  echo "== CUDA contexts"; nvidia-smi --query-compute-apps=pid,used_memory --format=csv
  kill -TERM %1; wait; tail -3 $out/check.log ;;
*) echo "unknown part $part"; exit 2 ;;
esac
