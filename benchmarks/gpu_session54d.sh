#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): what a batch cache's big copies cost in fresh against cached memory
# (alloc_probe.py, the 8B shape's KV at 64 rows), then issue 31's restart hit on this card (gpu_session54.sh disk:
# 8B, 24k tokens, exact and 8-bit pieces; the target's card is the H200, whose figures are from 2026-12-03).
# usage: bash benchmarks/gpu_session54d.sh OUT   (about 400 s after the install)
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
echo "== alloc_probe, 64 rows"
timeout 90 python3 benchmarks/alloc_probe.py --rows 64 --layers 32 --repeats 3 2>&1 | tail -8
echo "== alloc_probe, 16 rows"
timeout 60 python3 benchmarks/alloc_probe.py --rows 16 --layers 32 --repeats 2 2>&1 | tail -5
bash benchmarks/gpu_session54.sh $out disk
