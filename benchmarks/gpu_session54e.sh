#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): the steady state of 64 streams beside their floor, on both shapes, with each
# stream's token times, the device's step records and the GPU's utilization sampled (does the device wait for
# the host, and in which steps).
# usage: bash benchmarks/gpu_session54e.sh OUT   (about 250 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
sample_gpu
for shape in llama-3.1-8b llama-3.2-1b; do
  model $shape
  echo "== $shape"
  timeline_round steady-$shape 64 200 --floor-runs 1
done
