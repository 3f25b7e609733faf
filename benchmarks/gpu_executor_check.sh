#!/usr/bin/env bash
# Is the gap to the floor in the executor's step or around it (actors, HTTP)? On the H200:
# executor_decode.py (one thread, no actors) and the server at 64 streams with 2 and 3 steps ahead.
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
python3 benchmarks/make_bf16_model.py /root/models/$shape $shape >/dev/null 2>&1
(cd benchmarks && timeout 150 python3 executor_decode.py --model-path /root/models/$shape --steps 64 2>&1 | grep "^|")
for ahead in 2 3; do
  timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 16,64 --reply-tokens 128 \
    --skip-conversations --skip-wave --skip-floor --deadline-s 120 --mlxcel-args "--decode-steps-ahead $ahead" \
    --out $out/ahead-$ahead.json 2>&1 | grep "per-token\|aggregate"
done
