"""Cold prefill time against the prefill step size, in-process, on this machine's default device.

usage: python benchmarks/prefill_step.py [MODEL_FOLDER] [PROMPT_TOKENS]
Prints one line per step size: the median of 3 cold prefills of the same prompt.
"""

import statistics
import sys
import time

from mlxcel.blas import reexec_with_optimized_blas

reexec_with_optimized_blas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxcel.fixtures import fixture_path  # noqa: E402
from mlxcel.model.loader import load_model  # noqa: E402


def cold_prefill(model, tokens: mx.array, step: int) -> float:
    cache = make_prompt_cache(model)
    started = time.perf_counter()
    for start in range(0, tokens.size, step):
        model(tokens[None, start:start + step], cache=cache)
        mx.eval([c.state for c in cache])
    return time.perf_counter() - started


def main() -> None:
    folder = sys.argv[1] if len(sys.argv) > 1 else str(fixture_path("llama"))
    num_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 1702
    model = load_model(folder).model
    tokens = mx.array([(7 * index) % 150000 + 100 for index in range(num_tokens)])
    cold_prefill(model, tokens[:300], 256)  # compile
    print(f"device {mx.default_device()}, {num_tokens} tokens, model {folder}")
    for step in (128, 256, 512, 1024, 2048):
        times = [cold_prefill(model, tokens, step) for _ in range(3)]
        print(f"step {step:5d}: {statistics.median(times):.3f} s")


if __name__ == "__main__":
    main()
