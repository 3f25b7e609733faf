#!/usr/bin/env bash
# This session's H200 figures in two device calls, after the mlx-cuda install.
# usage: bash benchmarks/gpu_session37.sh OUT a|b
#   a: issue 28's decode_speed on the 8B shape (floor before and after, 1/16/64 streams, wave, 64 conversations)
#   c: the 64-conversation round (8B) after, then before (before28/), then n-gram speculation on the 8B shape
#   b: the 64-conversation round on the tree before shared hit passes (before28/, a copy of f9f0636), the 1B
#      shape's streams and wave, and n-gram speculation on the 8B shape (issue 29)
set -uo pipefail
out=${1:-$OUT}; part=${2:-a}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
eight=/root/models/llama-3.1-8b one=/root/models/llama-3.2-1b
python3 benchmarks/make_bf16_model.py $eight llama-3.1-8b >/dev/null 2>&1
if [ "$part" = a ]; then
  timeout 560 python3 -m benchmarks.decode_speed --model-path $eight --reply-tokens 128 --deadline-s 440 \
    --floor-runs 2 --out $out/decode-8b.json 2>&1 | grep "^|\|mlxcel:\|floor"
elif [ "$part" = c ]; then
  timeout 170 python3 -m benchmarks.decode_speed --model-path $eight --skip-floor --skip-streams --skip-wave \
    --out $out/conversations-8b-after.json 2>&1 | grep "^|\|mlxcel:"
  (cd before28 && PYTHONPATH=$PWD timeout 170 python3 -m benchmarks.decode_speed --model-path $eight \
    --skip-floor --skip-streams --skip-wave --out $out/conversations-8b-before.json 2>&1 | grep "^|\|mlxcel:")
  timeout 200 python3 benchmarks/speculative.py --model-path $eight --workloads repeat,fresh --streams 1,8 \
    --reply-tokens 128 --prefill-step-size 2048 --out $out/speculative-8b.json 2>&1 | tail -12
else
  (cd before28 && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.decode_speed --model-path $eight \
    --skip-floor --skip-streams --skip-wave --out $out/conversations-8b-before.json 2>&1 | grep "^|\|mlxcel:")
  python3 benchmarks/make_bf16_model.py $one llama-3.2-1b >/dev/null 2>&1
  timeout 200 python3 -m benchmarks.decode_speed --model-path $one --reply-tokens 128 --deadline-s 160 \
    --floor-runs 2 --skip-conversations --out $out/decode-1b.json 2>&1 | grep "^|\|mlxcel:"
  timeout 150 python3 benchmarks/speculative.py --model-path $eight --workloads repeat,fresh --streams 1,8 \
    --reply-tokens 128 --prefill-step-size 2048 --out $out/speculative-8b.json 2>&1 | tail -12
fi
