cd /work/main
M=$(.venv/bin/python -c 'from mlxcel.fixtures import fixture_path; print(fixture_path("llama"))')
for round in 1 2; do
for v in 0 1; do
  echo "== api-processes $v round $round"
  PYTHONPATH=. timeout 400 .venv/bin/python -m benchmarks.decode_speed --model-path $M --streams 1,16,64 --reply-tokens 64 --skip-conversations --skip-floor --wave-rounds 3 --mlxcel-args "--api-processes $v" --out /tmp/cpu49/ap$v-$round.json --server-timers /tmp/cpu49/timers-ap$v-$round.jsonl 2>&1 | grep "^|"
  .venv/bin/python benchmarks/serve_under_timers.py --summarize /tmp/cpu49/timers-ap$v-$round.jsonl /tmp/cpu49/ap$v-$round.json 2>&1 | grep "^64 streams\|^16 streams\|^1 streams" | grep -o "^[0-9]* streams\|its CPU [0-9]* us a decoded token"
done; done
