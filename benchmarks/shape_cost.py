"""First-use cost of new shapes: time a hit's forward pass (prefix P cached, S new tokens).

Each (P, S) is timed twice (and a cold prefill of each length in 2048-token chunks) on fresh caches: the first time pays whatever the
backend builds per shape (kernel compilation, attention plans), the second
shows the steady cost. Prints one JSON line per case.

    python benchmarks/shape_cost.py --model-path DIR
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    options = parser.parse_args()
    model, _tokenizer = load(options.model_path)
    cases = [(8141, 154), (8142, 154), (8300, 154), (8141, 155), (8141, 300), (4000, 154)]
    for prefix, suffix in cases:
        for attempt in (1, 2):
            cache = make_prompt_cache(model)
            model(mx.array([[7] * prefix]), cache=cache)
            mx.eval([c.state for c in cache])
            start = time.perf_counter()
            model(mx.array([[9] * (suffix - 1)]), cache=cache)
            logits = model(mx.array([[9]]), cache=cache)
            mx.eval(mx.argmax(logits[:, -1, :], axis=-1))
            hit = time.perf_counter() - start
            start = time.perf_counter()
            mx.eval(mx.argmax(model(mx.array([[9]]), cache=cache)[:, -1, :], axis=-1))
            decode = time.perf_counter() - start
            print(json.dumps({"prefix": prefix, "suffix": suffix, "attempt": attempt,
                              "hit_s": round(hit, 4), "decode_s": round(decode, 4)}), flush=True)
    for length in (8141, 8142, 8300):
        for attempt in (1, 2):
            cache = make_prompt_cache(model)
            tokens = mx.array([[7] * length])
            start = time.perf_counter()
            for offset in range(0, length - 1, 2048):
                model(tokens[:, offset:min(offset + 2048, length - 1)], cache=cache)
                mx.eval([c.state for c in cache])
            mx.eval(mx.argmax(model(tokens[:, -1:], cache=cache)[:, -1, :], axis=-1))
            print(json.dumps({"cold": length, "attempt": attempt,
                              "cold_s": round(time.perf_counter() - start, 4)}), flush=True)


if __name__ == "__main__":
    main()
