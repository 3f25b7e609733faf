"""A batch with no padding decoded without a mask (model/unpadded_decode.py) against the masked step, on a real backend.

Usage: python benchmarks/unpadded_decode_check.py --model-path DIR [--rows 1,4] [--steps 32]

B equal rows of a 24-token prompt in mlx-lm's ``BatchKVCache``, greedy, with the decode attention installed as the
executor installs it (the ragged kernel on CUDA): the patch's steps (MLX's fused attention, no mask) against
mlx-lm's (an all-true mask), fed the same tokens. Prints the largest logit difference, whether the greedy tokens
agree, and ms per step of each (pipelined, as the floor).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any


def run(model: Any, rows: int, steps: int) -> tuple[list[Any], float]:
    import mlx.core as mx
    from mlx_lm.models.cache import BatchKVCache

    prompt = mx.array([[10 + (7 * i) % 900 for i in range(24)]] * rows)
    caches = [BatchKVCache([0] * rows) for _ in model.layers]
    logits = model(prompt, cache=caches)[:, -1, :]
    seen = []
    started = 0.0
    for step in range(steps):
        if step == 8:
            mx.eval(logits)
            started = time.perf_counter()
        logits = model(mx.argmax(logits, axis=-1)[:, None], cache=caches)[:, -1, :]
        mx.async_eval(logits)
        seen.append(logits)
    mx.eval(seen)
    return seen, 1000 * (time.perf_counter() - started) / (steps - 8)


def main() -> None:
    from mlx_lm import load

    from mlxcel.model import ragged_attention, unpadded_decode

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", type=Path, required=True)
    parser.add_argument("--rows", default="1,4")
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    import mlx.core as mx

    model, _tokenizer = load(str(args.model_path))
    print("decode attention on", ragged_attention.install(model) or "MLX's path")
    print("| rows | largest logit difference | greedy tokens agree | ms a step, no mask | ms a step, masked |")
    print("|---|---|---|---|---|")
    for rows in (int(value) for value in args.rows.split(",")):
        unpadded_decode.install()
        ours, ours_ms = run(model, rows, args.steps)
        unpadded_decode.uninstall()
        theirs, theirs_ms = run(model, rows, args.steps)
        difference = max(float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())
                         for a, b in zip(ours, theirs, strict=True))
        agree = all(mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()
                    for a, b in zip(ours, theirs, strict=True))
        print(f"| {rows} | {difference:.3g} | {agree} | {ours_ms:.2f} | {theirs_ms:.2f} |", flush=True)


if __name__ == "__main__":
    main()
