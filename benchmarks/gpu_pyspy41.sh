#!/usr/bin/env bash
# H200: py-spy on the server while 64 streams decode (decode_speed.py, one long round): who holds the GIL
# (--gil), and every thread's stacks with idle frames (--idle). usage: bash benchmarks/gpu_pyspy41.sh OUT [SHAPE]
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 64 --reply-tokens 2048 \
  --warmup-tokens 0 --skip-floor --skip-wave --skip-conversations --out $out/pyspy-run.json 2>&1 | grep "^|" &
for _ in $(seq 60); do sleep 1; pid=$(pgrep -f "mlxcel serve" | head -1); [ -n "$pid" ] && curl -sf \
  "$(tr '\0' ' ' < /proc/$pid/cmdline | sed 's/.*--port \([0-9]*\).*/http:\/\/127.0.0.1:\1/')/health" >/dev/null && break; done
sleep 6  # the 64 streams start and decode
py-spy record --pid $pid --gil --threads --rate 200 --duration 6 --format raw --nonblocking -o $out/gil.txt 2>&1 | tail -1
py-spy record --pid $pid --idle --threads --rate 200 --duration 6 --format raw --nonblocking -o $out/idle.txt 2>&1 | tail -1
wait
