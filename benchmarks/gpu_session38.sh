#!/usr/bin/env bash
# The last H200 call of 2026-12-03 (after the mlx-cuda install): the disk read path before/after, n-gram
# speculation with warm-up, decode_speed (16/64 streams, the wave), and the batch join cost. (That run also
# served with a 0.5 ms GIL switch interval, a server change measured and dropped: docs/benchmarks.md.)
# usage: bash benchmarks/gpu_session38.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $m llama-3.1-8b >/dev/null 2>&1
for via in mx-load mapped-copy; do
  timeout 70 python3 -m benchmarks.disk_load_profile --end-to-end --tokens 16384 --repeats 2 --via $via 2>&1 | tail -1
done
timeout 150 python3 benchmarks/speculative.py --model-path $m --workloads repeat,fresh --streams 1,16 \
  --reply-tokens 128 --warmup-tokens 24 --modes ngram --out $out/spec8b-warm.json 2>&1 | grep -v "Warning\|tokenizer"
timeout 150 python3 -m benchmarks.decode_speed --model-path $m --reply-tokens 128 --streams 16,64 \
  --skip-conversations --out $out/gil-default.json 2>&1 | grep "^|\|mlxcel:"
timeout 60 python3 benchmarks/batch_join_cost.py --rows 8,16,32 --repeats 2 2>&1 | tail -3
