#!/usr/bin/env bash
# GPU, 2026-12-06 (stop 52): gpu_session52b.sh found one 64-stream step in five or six taking 17-26 ms against a
# median of 11.3 ms (16 streams: two such steps in 258), none starting or finishing a request. Is it the GIL (the
# device thread, its step done, waits up to Python's 5 ms switch interval while the Trio thread handles 64 tokens)
# or Python's garbage collector? finish_step_probe.py at 64 streams of 256 tokens, 8B: as it is, with a 0.5 ms
# switch interval, and with gc.freeze().
# usage: bash benchmarks/gpu_session52c.sh OUT [SHAPE]   (about 200 s after the install)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
for variant in "" "--switch-interval-ms 0.5" "--gc-freeze" "--switch-interval-ms 0.5"; do
  echo "== 64 streams $variant"
  timeout 150 python3 benchmarks/finish_step_probe.py /root/models/$shape --streams 64 --reply-tokens 256 --shown 0 \
    $variant > $out/probe.txt 2>&1
  grep "^{\|^garbage\|steps, median" $out/probe.txt | cut -c1-220
  echo "slow steps (over 1.5x the median): $(grep -c '^| [0-9]' $out/probe.txt)"
done
