#!/usr/bin/env bash
# H200 probe: mx.load's cost per tensor (64 tensors a file against 2 of the same bytes), and quantized
# adoption from 96 pieces before (prev39/: the tree before joining quantized pieces) and after.
set -uo pipefail
export HF_HUB_OFFLINE=1
python3 - <<'PY'
import mlx.core as mx, time, tempfile
d = tempfile.mkdtemp()
many = {f"k{i}": mx.random.normal((1, 8, 256, 128)).astype(mx.bfloat16) for i in range(64)}
few = {"k": mx.random.normal((32, 8, 256, 128)).astype(mx.bfloat16), "v": mx.random.normal((32, 8, 256, 128)).astype(mx.bfloat16)}
for n in range(64):
    mx.save_safetensors(f"{d}/many{n}.safetensors", many); mx.save_safetensors(f"{d}/few{n}.safetensors", few)
for rep in range(3):
    for kind in ("many", "few"):
        t = time.perf_counter()
        arrays = []
        for n in range(64):
            a = mx.load(f"{d}/{kind}{n}.safetensors"); mx.eval(list(a.values())); arrays.append(a)
        dt = time.perf_counter() - t
        print(kind, "64 files", round(dt, 3), "s", round(64 * 33.5e6 / dt / 1e9, 2), "GB/s", flush=True)
        del arrays
PY
for tree in prev39 .; do
  echo "== $tree"
  PYTHONPATH=$tree timeout 100 python3 $tree/benchmarks/kv_quant_adopt.py --tokens 24576 --pieces 96 --runs 3 2>&1 | grep -v '"plain"'
done
