#!/usr/bin/env bash
# H200, 2026-12-05: issue 28's figures on the tree as it is (the arrival window that fills the first pass,
# a pass's rows joining in place), one part per device call. usage: bash benchmarks/gpu_session43.sh OUT PART
#   decode: 1B and 8B, floor and mlxcel at 1/16/64 streams (128 tokens), three wave rounds (8B with the timers)
#   conversations: 8B, 64 conversations x 3 turns, --max-step-hit-tokens at its default and doubled; then
#                  mlx_lm.server's streams and wave on the same folder
set -uo pipefail
out=${1:-$OUT}; part=${2:-decode}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
tok=/root/tokenizer; mkdir -p $tok
[ -f $tok/tokenizer.json ] || { gunzip -c .tok/tokenizer.json.gz > $tok/tokenizer.json; cp .tok/tokenizer_config.json $tok/; }
model() { [ -f /root/models/$1/model.safetensors ] || python3 benchmarks/make_bf16_model.py /root/models/$1 $1 $tok >/dev/null; }
show() { grep "^|\|mlxcel:\|mlx_lm:\|every stream\|failed\|short"; }
case $part in
decode)
  for shape in llama-3.2-1b llama-3.1-8b; do
    s=$SECONDS; model $shape; echo "== $shape (model ready in $((SECONDS - s)) s)"
    timers=(); [ $shape = llama-3.1-8b ] && timers=(--server-timers $out/timers-8b.jsonl)
    timeout 240 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 1,16,64 \
      --reply-tokens 128 --skip-conversations --floor-runs 1 --wave-rounds 3 --deadline-s 200 \
      --out $out/decode-$shape.json "${timers[@]}" 2>&1 | show
  done
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-8b.jsonl $out/decode-llama-3.1-8b.json \
    2>&1 | cut -c1-2000 | tail -40 ;;
conversations)
  m=/root/models/llama-3.1-8b; model llama-3.1-8b
  for bound in 32768 65536; do
    echo "== --max-step-hit-tokens $bound"
    timeout 170 python3 -m benchmarks.decode_speed --model-path $m --skip-floor --skip-streams --skip-wave \
      --mlxcel-args "--max-step-hit-tokens $bound" --deadline-s 140 --out $out/conversations-$bound.json 2>&1 | show
  done
  echo "== mlx_lm.server"
  timeout 200 python3 -m benchmarks.decode_speed --model-path $m --skip-floor --skip-mlxcel --skip-conversations \
    --peer mlx_lm --streams 1,16,64 --reply-tokens 128 --deadline-s 170 --out $out/peer-8b.json 2>&1 | show ;;
esac
