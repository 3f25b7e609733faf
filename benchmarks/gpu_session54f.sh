#!/usr/bin/env bash
# GPU (written 2026-12-06, stop 54): issue 28 before and after on one machine, 8B shape: this tree (with its
# floor, --api-processes 2) and the tree the issue was measured on (b7b1a92, decode_speed.py's first commit,
# carried in .before/: `rm -rf .before && mkdir .before && git archive b7b1a92 | tar -x -C .before`), each at
# 1/16/64 streams of 256 tokens and the wave of 64.
# usage: bash benchmarks/gpu_session54f.sh OUT   (about 250 s after the install)
set -uo pipefail
out=${1:-$OUT}
source benchmarks/gpu_common.sh
shape=llama-3.1-8b; model $shape
# Whether the hypervisor (steal time, /proc/stat) or a CPU quota throttles the run (cgroup v2; v1's cpu.cfs_* where that is what there is).
throttle() { echo "-- $(head -1 /proc/stat) (steal: the 8th number); cpu quota ($1): $(cat /sys/fs/cgroup/cpu.max 2>/dev/null || cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us 2>/dev/null); $(tr '\n' ' ' < /sys/fs/cgroup/cpu.stat 2>/dev/null || tr '\n' ' ' < /sys/fs/cgroup/cpu/cpu.stat 2>/dev/null)"; }
throttle start
(vmstat -n 1 > $out/vmstat.txt 2>&1 || true) &  # us/sy/id/wa/st each second
vm=$!
echo "== after (this tree)"
timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams 1,16,64 --reply-tokens 256 \
  --skip-conversations --floor-runs 1 --deadline-s 135 --mlxcel-args "--api-processes 2" --out $out/after.json 2>&1 | show
throttle "after the tree's run"
echo "== before (b7b1a92)"
(cd .before && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.decode_speed --model-path /root/models/$shape \
  --streams 1,16,64 --reply-tokens 256 --skip-conversations --skip-floor --deadline-s 140 --out $out/before.json 2>&1 \
  | show)
throttle "after the old tree's run"
kill $vm 2>/dev/null; pkill vmstat 2>/dev/null
echo "-- vmstat: seconds with steal > 0: $(awk 'NR>2 && $17>0' $out/vmstat.txt | wc -l) of $(($(wc -l < $out/vmstat.txt) - 2)); largest st $(awk 'NR>2{print $17}' $out/vmstat.txt | sort -n | tail -1) %"
