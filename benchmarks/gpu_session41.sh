#!/usr/bin/env bash
# H200, 2026-12-04: decode_speed with phase timers on the server (benchmarks/serve_under_timers.py) and the GPU's
# utilization sampled beside it, to split the per-token interval into the device's work and its waits.
# usage: bash benchmarks/gpu_session41.sh OUT SHAPE STREAMS [EXTRA mlxcel ARGS]
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}; streams=${3:-1,16,64}; extra=${4:-}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
m=/root/models/$shape
tag=$shape${extra:+-$(echo "$extra" | tr -c 'a-z0-9' '_' | cut -c1-24)}
[ -f $m/config.json ] || python3 benchmarks/make_bf16_model.py $m $shape >/dev/null 2>&1
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > $out/gpu-$tag.csv &
smi=$!
timeout 400 python3 -m benchmarks.decode_speed --model-path $m --streams $streams --reply-tokens 128 \
  --skip-conversations --floor-runs 1 --deadline-s 330 --mlxcel-args "$extra" --out $out/$tag.json \
  --server-timers $out/timers-$tag.jsonl 2>&1 | grep "^|\|mlxcel:\|every stream"
kill $smi
python3 benchmarks/serve_under_timers.py --summarize $out/timers-$tag.jsonl $out/$tag.json $out/gpu-$tag.csv
