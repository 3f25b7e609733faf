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
