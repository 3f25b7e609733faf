#!/usr/bin/env bash
# After the mlx-cuda install: rows leaving the batch by gather vs by slices, then the 64-conversation round
# (8B, 8k shared system prompt, 3 turns) on this tree. usage: bash benchmarks/gpu_rows38.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
timeout 70 python3 benchmarks/batch_join_cost.py --rows 16,32 --repeats 2 2>&1 | tail -2
timeout 200 python3 -m benchmarks.decode_speed --model-path $m --skip-floor --skip-streams --skip-wave \
  --out $out/conversations-8b-after.json 2>&1 | grep "^|\|mlxcel:"
