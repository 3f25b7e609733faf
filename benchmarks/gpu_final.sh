#!/usr/bin/env bash
# The wave's H200 figures in two device calls (each under 10 minutes), after the mlx-cuda install.
# usage: bash benchmarks/gpu_final.sh OUT a|b
#   a: issue 28's decode_speed on the 8B shape (floor, 1/16/64 streams, wave, 64 conversations on 8k tokens)
#   b: LoRA configurations and bounded-string grammars at 16 streams (8B), then decode_speed on the 1B shape
set -uo pipefail
out=${1:-$OUT}; part=${2:-a}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
eight=/root/models/llama-3.1-8b one=/root/models/llama-3.2-1b
python3 benchmarks/make_bf16_model.py $eight llama-3.1-8b >/dev/null 2>&1
if [ "$part" = a ]; then
  timeout 520 python3 -m benchmarks.decode_speed --model-path $eight --reply-tokens 128 --deadline-s 470 \
    --floor-runs 1 --out $out/decode-8b.json 2>&1 | grep "^|\|mlxcel:"
else
  timeout 170 python3 -m benchmarks.lora_configs --model-path $eight --repeats 2 2>&1 | tail -12
  timeout 120 python3 -m benchmarks.structured_output --model-path $eight --streams 16 --repeats 2 2>&1 | tail -14
  python3 benchmarks/make_bf16_model.py $one llama-3.2-1b >/dev/null 2>&1
  timeout 200 python3 -m benchmarks.decode_speed --model-path $one --reply-tokens 128 --deadline-s 170 \
    --floor-runs 1 --skip-conversations --out $out/decode-1b.json 2>&1 | grep "^|\|mlxcel:"
fi
