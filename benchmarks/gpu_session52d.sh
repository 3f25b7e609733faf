#!/usr/bin/env bash
# GPU, 2026-12-06 (stop 52): the finishing step once the copies of rows that end with nothing left to decode are
# queued after the reply (StepExecutor.after_reply). finish_step_probe.py at 64 streams (the last step's ms and
# profile; gpu_session52b.sh: 344 ms, 200 of them queueing the copies), then the server (--api-processes 2) at 16
# and 64 streams of 256 tokens, this tree and the one at the session's start (.before/: git archive 2b4f569).
# usage: bash benchmarks/gpu_session52d.sh OUT [SHAPE]   (about 150 s after the install)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
model $shape
finish_probe 64
for run in ". after" ".before before"; do
  SERVE_TIMEOUT=100 serve_tree $run --streams 16,64 --skip-wave --deadline-s 90
done
