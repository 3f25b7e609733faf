#!/usr/bin/env bash
# Where issue 28's remaining per-token time goes on the H200 (8B shape): the executor alone, the engine
# (actors, no HTTP) and the server (HTTP), each at 1/16/64 streams; the engine and server under the stack
# sampler. usage: bash benchmarks/gpu_profile28.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
eight=/root/models/llama-3.1-8b
python3 benchmarks/make_bf16_model.py $eight llama-3.1-8b >/dev/null 2>&1
timeout 100 python3 benchmarks/executor_decode.py --model-path $eight 2>&1 | tail -8
(cd benchmarks && timeout 160 python3 engine_decode.py --model-path $eight --levels 1,16,64 --wave 0 \
  --steps-ahead 2 --profile --json $out/engine-8b.json > $out/engine-8b.txt 2>&1); grep -v "^\s*$" $out/engine-8b.txt | head -30
timeout 300 python3 -m benchmarks.decode_speed --model-path $eight --streams 16,64 --reply-tokens 128 \
  --skip-conversations --skip-wave --floor-runs 1 --deadline-s 250 --out $out/http-8b.json \
  --server-stacks $out/stacks-http-8b.txt 2>&1 | grep "^|\|mlxcel:" | head -20
