M=$(cd /work/main && .venv/bin/python -c 'from mlxcel.fixtures import fixture_path; print(fixture_path("llama"))')
for round in 1 2 3; do
for tree in before now; do
  dir=/work/main; [ $tree = before ] && dir=/tmp/before50
  cd $dir
  PYTHONPATH=$dir timeout 300 .venv/bin/python -m benchmarks.decode_speed --model-path $M --streams 1 --reply-tokens 256 --skip-conversations --skip-floor --skip-wave --mlxcel-args "--api-processes 1" --out /tmp/cpu50/one-$tree-$round.json 2>&1 | grep "1 stream: per-token" | sed "s/^/$tree $round /"
done; done
