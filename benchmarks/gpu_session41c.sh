#!/usr/bin/env bash
# H200, 2026-12-04, last call: with the device mailbox, the 8B wave in three rounds and the 64-conversation
# round, grammars at 16 streams, and the 1B shape's table. usage: bash benchmarks/gpu_session41c.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
eight=/root/models/llama-3.1-8b; one=/root/models/llama-3.2-1b
timeout 130 python3 -m benchmarks.structured_output --model-path $eight --streams 16 --repeats 2 2>&1 | tail -8
timeout 230 python3 -m benchmarks.decode_speed --model-path $eight --skip-floor --skip-streams --wave-rounds 3 \
  --out $out/conversations-8b.json 2>&1 | grep "^|\|mlxcel:"
[ -f $one/model.safetensors ] || python3 benchmarks/make_bf16_model.py $one llama-3.2-1b >/dev/null 2>&1
timeout 170 python3 -m benchmarks.decode_speed --model-path $one --streams 1,16,64 --reply-tokens 128 \
  --skip-conversations --floor-runs 1 --wave-rounds 3 --out $out/decode-1b.json 2>&1 | grep "^|\|mlxcel:"
