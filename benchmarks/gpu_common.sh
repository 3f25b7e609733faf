# Sourced by the gpu_session*.sh scripts: the device's environment, the random-weight bf16 models
# (made once per machine from the tokenizer carried in .tok/), and the lines of a benchmark worth reading.
# Set up once per checkout, here: the wheels, `bash ../shared/gpu/prepare.sh trio quart-trio hypercorn blake3 attrs
# orjson` (the server imports orjson and the device has none), and .tok/ (excluded from git): the fixtures' tokenizer,
# `gzip -c $(python -c "from mlxcel.fixtures.tokenizer import tokenizer_json_path as p; print(p())")
# > .tok/tokenizer.json.gz`, and tokenizer_config.json written from mlxcel.fixtures.tokenizer.tokenizer_config().
export HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
tok=/root/tokenizer; mkdir -p $tok
[ -f $tok/tokenizer.json ] || { gunzip -c .tok/tokenizer.json.gz > $tok/tokenizer.json; cp .tok/tokenizer_config.json $tok/; }
model() { [ -f /root/models/$1/model.safetensors ] || python3 benchmarks/make_bf16_model.py /root/models/$1 $1 $tok >/dev/null; }
show() { grep "^|\|mlxcel:\|mlx_lm:\|every stream\|failed\|short"; }
# serve_tree TREE TAG DECODE_SPEED_ARGS...: decode_speed against the server of TREE (. is this checkout; .before/ an
# older one, carried), --api-processes 2, 256-token replies, $shape's model; its table, then each round's largest
# gaps. SERVE_TIMEOUT (default 130 s) bounds it; EXTRA_PATH goes first on the server's PYTHONPATH (a sitecustomize).
serve_tree() {
  local tree=$1 tag=$2; shift 2
  echo "== $tag"
  (cd $tree && PYTHONPATH=${EXTRA_PATH:+$EXTRA_PATH:}$PWD timeout ${SERVE_TIMEOUT:-130} python3 -m benchmarks.decode_speed \
    --model-path /root/models/$shape --skip-floor --reply-tokens 256 --skip-conversations \
    --mlxcel-args "--api-processes 2" --out $out/$tag.json "$@" 2>&1 | show)
  python3 - $out/$tag.json <<'PY'
import json, sys
rounds = json.load(open(sys.argv[1]))["servers"]["mlxcel"]["streams"]
for level, row in rounds.items():
    print(f"{level} streams: max gap {1000 * row['gap_max_s']:.0f} ms, p99 {1000 * row['gap_p99_s']:.1f} ms; largest "
          "(ms, token):", ", ".join(f"{1000 * g['gap_s']:.0f} {g['token']}" for g in row.get("largest_gaps", [])))
PY
}
# finish_probe STREAMS: benchmarks/finish_step_probe.py on $shape, its slow and donating steps and the slowest one's profile.
finish_probe() {
  echo "== finish_step_probe, $1 streams"
  timeout 100 python3 benchmarks/finish_step_probe.py /root/models/$shape --streams $1 --reply-tokens 256 --shown 1 \
    > $out/probe-$1.txt 2>&1
  grep -v "^\[trans\|llguidance\|^| [0-9]* | [0-9.]* | $1 | $1 | 0 | 0 | 0 |" $out/probe-$1.txt | head -30 | cut -c1-160
}
# sample_gpu: nvidia-smi's utilization, clocks and power every 250 ms into $out/smi.csv until the script ends.
sample_gpu() {
  nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm,clocks.mem,power.draw,temperature.gpu \
    --format=csv,noheader -lms 250 > $out/smi.csv 2>&1 &
  trap "kill $! 2>/dev/null" EXIT
}
# timeline_round TAG STREAMS TIMEOUT [decode_speed flags]: $shape's streams rounds (256 tokens, --api-processes 2)
# keeping each stream's token times and the device's step records, then each level's token timeline and the
# timers' summary (with $out/smi.csv's utilization when sample_gpu runs).
timeline_round() {
  local tag=$1 streams=$2 limit=$3; shift 3
  timeout $limit python3 -m benchmarks.decode_speed --model-path /root/models/$shape --streams $streams \
    --reply-tokens 256 --skip-wave --skip-conversations --deadline-s $((limit - 20)) --keep-token-times \
    --mlxcel-args "--api-processes 2" --out $out/$tag.json --server-timers $out/timers-$tag.jsonl "$@" 2>&1 | show
  for level in ${streams//,/ }; do
    echo "-- $level streams"
    python3 benchmarks/token_timeline.py $out/$tag.json --level $level --shown 12
  done
  python3 benchmarks/serve_under_timers.py --summarize $out/timers-$tag.jsonl $out/$tag.json \
    $([ -f $out/smi.csv ] && echo $out/smi.csv) 2>&1 | cut -c1-1200
}
