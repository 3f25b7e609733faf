#!/usr/bin/env bash
# Speculative decoding on the H200 (mlx-cuda), bf16 random-weight Llama shapes: off vs ngram vs draft.
# The 8B model as its own draft (every greedy proposal holds: the upper bound of acceptance at the full
# cost of a draft as large as the model), and the 1B shape as the 8B's draft (random weights disagree:
# almost nothing accepted, what a cheap draft's proposals cost). usage: bash benchmarks/gpu_speculative.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
for shape in llama-3.1-8b llama-3.2-1b; do
  python3 benchmarks/make_bf16_model.py /root/models/$shape $shape >/dev/null 2>&1
done
m=/root/models/llama-3.1-8b
timeout 300 python3 benchmarks/speculative.py --model-path $m --workloads repeat,fresh --streams 1,16 \
  --reply-tokens 128 --modes ngram,draft --draft-model $m --out $out/self.json 2>&1 | grep -v Warning
timeout 200 python3 benchmarks/speculative.py --model-path $m --workloads repeat,fresh --streams 1,16 \
  --reply-tokens 128 --modes draft --draft-model /root/models/llama-3.2-1b --out $out/small.json 2>&1 | grep -v Warning
