#!/usr/bin/env bash
# The GPU benchmark run (H200, mlx-cuda): mlxcel vs mlx_lm.server on bf16 random-weight
# Llama shapes, 8,000-token shared system prompt, 128-token turns, 16-token replies.
# usage (on the GPU machine, from the repo root): bash benchmarks/gpu_bench.sh SHAPE OUT [MODE...]
set -euo pipefail
shape=${1:-llama-3.2-1b}; out=${2:-/tmp/gpu-bench}; shift 2 || true
modes=${*:-seq all}
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
model=/root/models/$shape
python3 benchmarks/make_bf16_model.py "$model" "$shape"
common=(--compare --serial-servers --model-path "$model" --system-tokens 8000 --user-tokens 128 --reply-tokens 16 --unseen 6 --quiet)
unbucketed='python3 -m mlxcel serve -m {model} --host 127.0.0.1 --port {port} --start-buckets false'
# An older mlxcel (a package folder given as BEFORE=DIR/mlxcel's parent) as the peer, for side-by-side checks.
before="bash -c 'cd ${BEFORE:-/nonexistent} && exec python3 -m mlxcel serve -m {model} --host 127.0.0.1 --port {port}'"
for mode in $modes; do
  case $mode in
    seq) python3 -m mlxcel bench "${common[@]}" --conversations 4 --turns 4 --out "$out/$shape-seq" ;;
    seqcmp) python3 -m mlxcel bench "${common[@]}" --peer-command "$unbucketed" --conversations 4 --turns 4 --out "$out/$shape-seqcmp" ;;
    cold) python3 benchmarks/start_shapes.py --model-path "$model" --cold --requests 16 | tee "$out/$shape-cold.jsonl" ;;
    all) python3 -m mlxcel bench "${common[@]}" --conversations 16 --turns 2 --concurrency all --out "$out/$shape-all" ;;
    seqbefore) python3 -m mlxcel bench "${common[@]}" --peer none --peer-command "$before" --conversations 4 --turns 4 --out "$out/$shape-seqbefore" ;;
    allbefore) python3 -m mlxcel bench "${common[@]}" --peer none --peer-command "$before" --conversations 16 --turns 2 --concurrency all --out "$out/$shape-allbefore" ;;
    firstanswer) python3 benchmarks/first_answer.py --model "$model" --no-peer --repeats 1 --mlxcel-flags "" --mlxcel-flags "--device-warmup false" | tee "$out/$shape-firstanswer.txt" ;;
    all3) python3 -m mlxcel bench "${common[@]}" --conversations 16 --turns 3 --concurrency all --out "$out/$shape-all3" ;;
    all3before) python3 -m mlxcel bench "${common[@]}" --peer none --peer-command "$before" --conversations 16 --turns 3 --concurrency all --out "$out/$shape-all3before" ;;
    all64) python3 -m mlxcel bench "${common[@]}" --peer none --conversations 64 --turns 3 --concurrency all --out "$out/$shape-all64" ;;
    sharedkv) python3 benchmarks/shared_kv.py | tee "$out/$shape-sharedkv.jsonl" ;;
    lora) python3 benchmarks/lora_configs.py --model-path "$model" | tee "$out/$shape-lora.txt" ;;
    structured) python3 benchmarks/structured_output.py --model-path "$model" | tee "$out/$shape-structured.txt" ;;
    throughput) python3 benchmarks/scheduler_throughput.py --model-path "$model" --out "$out/$shape-throughput" ;;
  esac
done
