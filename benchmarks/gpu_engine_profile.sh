set -uo pipefail
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
python3 benchmarks/make_bf16_model.py /root/models/llama-3.1-8b llama-3.1-8b >/dev/null 2>&1
cd benchmarks && timeout 400 python3 engine_decode.py --model-path /root/models/llama-3.1-8b --levels 1,16,64 --wave 64 --steps-ahead 2 --profile --json $OUT/engine-8b.json 2>&1 | grep -v "^\s*$" | tail -150
