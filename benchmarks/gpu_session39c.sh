#!/usr/bin/env bash
# H200, after the mlx-cuda install: the fused dequantize-and-rotate kernel for stored KV (mlxcel/model/kv_dequant.py).
# Its CUDA tests first (nothing else runs if they fail), then adoption with and without it at a warm hit's
# shape (8k tokens, 3 pieces) and a disk hit's (24k tokens, 96 pieces), then warm TTFT through HTTP exact
# against --prompt-cache-kv-bits 8, then the 8B restart hit with 8-bit pieces.
# usage: bash benchmarks/gpu_session39c.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
# The device has neither pytest-trio nor the SDKs tests/conftest.py imports: these plain tests run without it.
timeout 120 python3 -m pytest tests/model/test_kv_dequant.py tests/model/test_kv_quantized.py -q -p no:cacheprovider --noconftest \
  -o filterwarnings=ignore 2>&1 | tail -15 | tee $out/tests.txt
grep -q "failed\|error" $out/tests.txt && exit 1
for shape in "8192 3" "24576 96"; do
  set -- $shape
  timeout 60 python3 benchmarks/kv_quant_adopt.py --tokens $1 --pieces $2 --runs 5 2>&1 | grep rotated
done
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
timeout 200 python3 -m mlxcel bench --compare --serial-servers --model-path $m --peer none \
  --peer-command "python3 -m mlxcel serve -m {model} --port {port} --prompt-cache-kv-bits 8" \
  --conversations 16 --turns 3 --system-tokens 8000 --concurrency 1 --unseen 0 --no-floor \
  --out $out/bench-kv8 2>&1 | tail -6
timeout 150 python3 benchmarks/disk_restart.py --model-path $m --system-words 24000 --repeats 2 --warm-first \
  --serve-flag=--prompt-cache-disk-write-bytes-per-second=8589934592 --serve-flag=--prompt-cache-kv-bits=8 \
  --json $out/restart-kv8.json 2>&1 | grep -v "^disk_stats\|^start_up" | tail -16
