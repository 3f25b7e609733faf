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
echo "== finish_step_probe, 64 streams"
timeout 100 python3 benchmarks/finish_step_probe.py /root/models/$shape --streams 64 --reply-tokens 256 --shown 1 \
  > $out/probe-64.txt 2>&1
grep -v "^\[trans\|llguidance\|^| [0-9]* | [0-9.]* | 64 | 64 | 0 | 0 | 0 |" $out/probe-64.txt | head -30 | cut -c1-160
serve() {  # TREE TAG
  echo "== $2"
  (cd $1 && PYTHONPATH=$PWD timeout 100 python3 -m benchmarks.decode_speed --model-path /root/models/$shape \
    --skip-floor --streams 16,64 --reply-tokens 256 --skip-wave --skip-conversations --deadline-s 90 \
    --mlxcel-args "--api-processes 2" --out $out/$2.json 2>&1 | grep "^| [16]")
  python3 - $out/$2.json <<'PY'
import json, sys
rounds = json.load(open(sys.argv[1]))["servers"]["mlxcel"]["streams"]
for level, row in rounds.items():
    print(f"{level} streams: max gap {1000 * row['gap_max_s']:.0f} ms, p99 {1000 * row['gap_p99_s']:.1f} ms; largest "
          "(ms, token):", ", ".join(f"{1000 * g['gap_s']:.0f} {g['token']}" for g in row.get("largest_gaps", [])))
PY
}
serve . after; serve .before before
