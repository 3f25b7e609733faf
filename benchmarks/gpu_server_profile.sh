#!/usr/bin/env bash
# Where the server's time goes on the H200: decode_speed at 1 and 64 streams and the wave, mlxcel under the
# sampling profiler (mlxcel/bench/stacks.py). usage: bash benchmarks/gpu_server_profile.sh OUT [SHAPE]
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
python3 benchmarks/make_bf16_model.py /root/models/$shape $shape >/dev/null 2>&1
timeout 400 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 1,64 --reply-tokens 128 \
  --skip-conversations --floor-runs 1 --deadline-s 330 --out $out/profile-$shape.json \
  --server-stacks $out/stacks-$shape.txt 2>&1 | grep -v "^\s*$" | tail -25
grep -A 60 "thread mlxcel-device" $out/stacks-$shape.txt | head -70
grep -A 70 "thread MainThread" $out/stacks-$shape.txt | head -75
