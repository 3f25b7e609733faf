#!/usr/bin/env bash
# H200, 2026-12-04: the 8B wave of 64, three rounds, the tree before the device mailbox (before/) and after,
# alternating, with the phase timers. usage: bash benchmarks/gpu_session41d.sh OUT
set -uo pipefail
out=${1:-$OUT}
export HF_HUB_OFFLINE=1
for tree in before after; do
  dir=$PWD; [ $tree = before ] && dir=$PWD/before
  echo "== $tree"
  rm -f $out/timers-wave.jsonl
  (cd $dir && PYTHONPATH=$dir timeout 100 python3 -m benchmarks.decode_speed --model-path /root/models/llama-3.1-8b \
    --skip-floor --skip-streams --skip-conversations --wave-rounds 3 --out $out/wave-$tree.json \
    --server-timers $out/timers-wave.jsonl 2>&1 | grep "TTFT")
  python3 -c "import json,sys; w=json.load(open('$out/wave-$tree.json'))['servers']['mlxcel']['wave']; t=sorted(x for r in w['rounds'] for x in r['ttfts_s']); print('ttfts', [round(x,3) for x in t[::8]], [round(r['ttft_median_s'],3) for r in w['rounds']])"
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-wave.jsonl $out/wave-$tree.json | cut -c1-400
done
