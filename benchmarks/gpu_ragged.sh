#!/usr/bin/env bash
# The ragged decode attention on the H200: its CUDA tests, its agreement and per-layer time against MLX's
# masked and unmasked attention, and the decode step of the 1B and 8B shapes with and without it.
# usage (on the GPU machine, from the repo root): bash benchmarks/gpu_ragged.sh [SHAPE...]
set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
python3 -m pytest -c /dev/null --rootdir . tests/test_ragged_attention.py -q -p no:cacheprovider 2>&1 | tail -15
python3 benchmarks/ragged_attention_check.py
for shape in ${*:-llama-3.2-1b llama-3.1-8b}; do
  python3 benchmarks/make_bf16_model.py /root/models/$shape $shape >/dev/null
  echo "## $shape"
  python3 benchmarks/decode_step_pieces.py --model-path /root/models/$shape --ragged
done
