#!/usr/bin/env bash
# H200, 2026-12-04, second call: where the executor's step waits (executor_decode.py, ragged kernel on and off,
# async_eval's share), then decode_speed with the phase timers, the tree before the device mailbox (before/, a
# copy of HEAD~ with these benchmarks) and after. usage: bash benchmarks/gpu_session41b.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1
m=/root/models/llama-3.1-8b
(cd benchmarks && PYTHONPATH=$PWD/.. timeout 150 python3 executor_decode.py --model-path $m --batches 16,64 \
  --steps 48 --ragged on,off 2>&1 | grep "^|")
for tree in before after; do
  dir=$PWD; [ $tree = before ] && dir=$PWD/before
  echo "== $tree"
  (cd $dir && OUT=$out bash $PWD/benchmarks/gpu_session41.sh $out llama-3.1-8b 16,64 2>&1 | tail -14)
  mv $out/llama-3.1-8b.json $out/$tree.json; mv $out/timers-llama-3.1-8b.jsonl $out/timers-$tree.jsonl
  mv $out/gpu-llama-3.1-8b.csv $out/gpu-$tree.csv
done
