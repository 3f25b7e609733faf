#!/usr/bin/env bash
# GPU, 2026-12-06: why the 8B step at 16 and 64 streams stays above the floor once the engine's loop is nearly
# idle (--api-processes 2: 13-30 us of loop CPU a token). One machine session, in order:
#   1. the server at 16 and 64 streams (256 tokens) under the sampling profiler (where the device thread spends
#      a step), nvidia-smi's utilization sampled beside it (is the GPU busy while the host builds a step?);
#   2. the executor alone against the floor, each step run to its end before the next (executor_decode.py
#      --serial: no actors, no HTTP), split into host, queueing and device time: is the executor's step longer
#      on the host or on the GPU?
#   3. the executor alone, pipelined as served, on the main thread and then on a thread of its own (as the
#      server's device thread): does the thread matter?
# usage: bash benchmarks/gpu_session51.sh OUT [SHAPE]   (about 250-500 s after the install; one call)
set -uo pipefail
out=${1:-$OUT}; shape=${2:-llama-3.1-8b}
source benchmarks/gpu_common.sh
s=$SECONDS; model $shape; echo "== $shape model ready in $((SECONDS - s)) s"
nvidia-smi --query-gpu=timestamp,utilization.gpu --format=csv,noheader -lms 100 > $out/gpu.csv &
smi=$!
echo "== server, --api-processes 2, sampled stacks"
timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 16,64 --reply-tokens 256 \
  --skip-floor --skip-wave --skip-conversations --deadline-s 120 --mlxcel-args "--api-processes 2" \
  --out $out/stacks.json --server-stacks $out/stacks.txt 2>&1 | show
kill $smi
python3 - $out/stacks.json $out/gpu.csv <<'PY'
import json, sys
from datetime import datetime
rounds = json.load(open(sys.argv[1]))["servers"]["mlxcel"]["streams"]
samples = []
for row in open(sys.argv[2]):
    stamp, _, value = row.partition(",")
    try:
        samples.append((datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(value.strip().rstrip(" %"))))
    except ValueError:
        pass
for level, row in rounds.items():
    opened, closed = row["wall_window"]
    inside = [value for moment, value in samples if opened <= moment <= closed]
    print(f"{level} streams: GPU utilization mean {sum(inside) / max(1, len(inside)):.0f}% over {len(inside)} samples")
    print(f"{level} streams: largest gaps (ms, token, s into the round):",
          ", ".join(f"{1000 * g['gap_s']:.0f} {g['token']} {g['at_s']:.2f}" for g in row.get("largest_gaps", [])))
PY
grep -A 48 "thread mlxcel-device" $out/stacks.txt | head -52
echo "== executor alone, serial steps"
[ $SECONDS -lt 300 ] && timeout 120 python3 benchmarks/executor_decode.py --model-path /root/models/$shape --batches 1,16,64 --steps 40 --serial 2>&1 \
  | grep "^|"
echo "== executor alone, pipelined: main thread, then a thread of its own"
for where in "" --in-thread; do
  [ $SECONDS -lt 420 ] && timeout 90 python3 benchmarks/executor_decode.py --model-path /root/models/$shape --batches 16,64 --steps 40 $where 2>&1 \
    | grep "^| on"
done
