#!/usr/bin/env bash
# After the mlx-cuda install: rows leaving the batch by mlx-lm's gather against mlxcel's slices (8B KV shape,
# 8k tokens a row). With more device time, the 64-conversation round after it (--conversations).
# usage: bash benchmarks/gpu_rows38.sh OUT [--conversations]
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
# pytest-trio is not on the device: the config's trio_mode warning is ignored for these plain tests.
timeout 90 python3 -m pytest tests/model/test_ragged_attention.py tests/model/test_gapped_cache.py tests/model/test_batch_rows.py \
  -q -p no:cacheprovider -o filterwarnings=ignore 2>&1 | tail -3
timeout 80 python3 benchmarks/batch_join_cost.py --rows 16,32 --repeats 2 2>&1 | tail -2
if [ "${2:-}" = --conversations ]; then
  m=/root/models/llama-3.1-8b
  python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
  timeout 200 python3 -m benchmarks.decode_speed --model-path $m --skip-floor --skip-streams --skip-wave \
    --out $out/conversations-8b-after.json 2>&1 | grep "^|\|mlxcel:"
fi
