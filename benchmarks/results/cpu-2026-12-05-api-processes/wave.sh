cd /work/main
M=$(.venv/bin/python -c 'from mlxcel.fixtures import fixture_path; print(fixture_path("llama"))')
for round in 1 2; do
for v in 0 1; do
  echo "== api-processes $v round $round"
  PYTHONPATH=. timeout 400 .venv/bin/python -m benchmarks.decode_speed --model-path $M --streams 16 --reply-tokens 64 --skip-conversations --skip-floor --wave-rounds 3 --mlxcel-args "--api-processes $v" --out /tmp/cpu49/w$v-$round.json --server-timers /tmp/cpu49/timers-w$v-$round.jsonl 2>&1 | grep "^| 64 short\|^| 16 streams: per"
  .venv/bin/python benchmarks/serve_under_timers.py --summarize /tmp/cpu49/timers-w$v-$round.jsonl /tmp/cpu49/w$v-$round.json 2>&1 | grep "^wave:\|^16 streams" | grep -o "^[0-9a-z]* *streams\|^wave\|its CPU [0-9]* us a decoded token\|the API processes' CPU [0-9]* us a decoded token\|renders here [0-9]*, [0-9]* ms of CPU"
done; done
