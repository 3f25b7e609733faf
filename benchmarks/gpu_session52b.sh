#!/usr/bin/env bash
# GPU, 2026-12-06 (stop 52): after gpu_session52.sh, one or two streams of each 64-stream round still got their last
# token 0.31-0.32 s late. The engine alone (no HTTP), every device step of a round timed and profiled:
# benchmarks/finish_step_probe.py at 64 and 16 streams of 256 tokens, 8B.
# usage: bash benchmarks/gpu_session52b.sh OUT [SHAPE]   (about 120 s after the install)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
for streams in 64 16; do
  echo "== $streams streams"
  timeout 200 python3 benchmarks/finish_step_probe.py /root/models/$shape --streams $streams --reply-tokens 256 \
    --shown 3 > $out/probe-$streams.txt 2>&1
  grep -v "^| [0-9]* | [0-9.]* | 0 | [0-9]* | 0 | 0 | [1-9]" $out/probe-$streams.txt | head -150
done
