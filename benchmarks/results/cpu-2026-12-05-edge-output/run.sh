# Issue 28, fifteenth pass, CPU box: N = 1 with the output processed in the API process (this tree) against
# c2931d0 (output processed in the engine), alternating, two rounds.
M=$(cd /work/main && .venv/bin/python -c 'from mlxcel.fixtures import fixture_path; print(fixture_path("llama"))')
for round in 1 2; do
for tree in before now; do
  dir=/work/main; [ $tree = before ] && dir=/tmp/before50
  cd $dir
  echo "== $tree round $round"
  PYTHONPATH=$dir timeout 400 .venv/bin/python -m benchmarks.decode_speed --model-path $M --streams 1,16,64 --reply-tokens 64 --skip-conversations --skip-floor --wave-rounds 3 --mlxcel-args "--api-processes 1" --out /tmp/cpu50/$tree-$round.json --server-timers /tmp/cpu50/timers-$tree-$round.jsonl 2>&1 | grep "^|"
  PYTHONPATH=$dir .venv/bin/python benchmarks/serve_under_timers.py --summarize /tmp/cpu50/timers-$tree-$round.jsonl /tmp/cpu50/$tree-$round.json 2>&1 | grep "^64 streams\|^16 streams\|^1 streams\|^wave" | grep -o "^[0-9a-z]* *streams\|^wave\|[0-9.]* ms between device steps\|its CPU [0-9]* us a decoded token\|API processes' CPU [0-9]* us a decoded token"
done; done
