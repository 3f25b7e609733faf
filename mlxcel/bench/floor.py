"""The in-process floor: the least time a warm turn's first token can take.

For the workload's shapes (the stand-in replies take the place of the
server's), the model is loaded with mlx-lm, the previous turn's whole prompt
is prefilled into a fresh ``make_prompt_cache`` cache, and then the timed
part: prefilling only the rest of this turn's prompt (the previous reply,
the new user turn, the template's tokens) in one chunk and taking the first
greedy token (as mlx-lm generates: the chunk without its last token fills
the cache, then one step on the last token gives the logits). Median of a
few runs after a warm-up, the cache trimmed back between runs. A server's
warm-turn TTFT divided by this is its overhead over the model's own compute.
The cold figure is the same for a whole turn-0 prompt in
``--prefill-step-size`` chunks (by default the servers' own default chunk:
256 on the CPU, 2048 on a GPU).

Run as ``python -m mlxcel.bench.floor --model-path DIR [shape flags]``
(prints one JSON object); ``measure_floor`` runs that in a subprocess, which
inherits the caller's ``LD_PRELOAD`` and so the servers' BLAS.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from mlxcel.bench.workload import Shape, add_shape_arguments, build_workload

__all__ = ["measure_floor", "floor_main"]

FLOOR_TIMEOUT_S = 900.0


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def _floor(model_path: str, shape: Shape, *, runs: int, prefill_step_size: int, max_turns: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.blas import describe_blas

    model, tokenizer = load(model_path)[:2]
    workload = build_workload(shape, model_path=model_path)

    def prefill(cache: list[Any], tokens: list[int], step: int) -> int:
        """Prefill ``tokens`` in chunks of ``step``; returns the first greedy token.

        As mlx-lm's own generation does: all but the last token only fill the
        cache (their logits are never evaluated, so never computed), then the
        last token is one step whose logits give the first token.
        """
        body = tokens[:-1]
        for start in range(0, len(body), step):
            model(mx.array(body[start:start + step])[None], cache=cache)
            mx.eval([c.state for c in cache])
        logits = model(mx.array(tokens[-1:])[None], cache=cache)
        token = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(token)
        first = token.item()
        assert isinstance(first, int)
        return first

    def timed(function: Any) -> float:
        start = time.perf_counter()
        function()
        return time.perf_counter() - start

    conversation = 0
    replies = list(workload.stand_in_replies[conversation])
    per_turn = []
    for turn in range(1, min(shape.turns, max_turns + 1)):
        previous = _render(tokenizer, workload.messages(conversation, turn - 1, replies[: turn - 1]))
        current = _render(tokenizer, workload.messages(conversation, turn, replies[:turn]))
        if current[: len(previous)] != previous:
            raise RuntimeError("the template does not extend the previous turn's prompt; no prefix floor")
        suffix = current[len(previous):]
        cache = make_prompt_cache(model)
        prefill(cache, previous, prefill_step_size)
        times = []
        for run in range(runs + 1):
            elapsed = timed(functools.partial(prefill, cache, suffix, len(suffix)))
            for layer_cache in cache:
                layer_cache.trim(len(suffix))
            if run:
                times.append(elapsed)
        per_turn.append({"turn": turn, "prefix_tokens": len(previous), "suffix_tokens": len(suffix),
                         "median_s": statistics.median(times)})

    cold_prompt = _render(tokenizer, workload.messages(conversation, 0, []))
    cold_times = []
    for run in range(min(runs, 3) + 1):
        cache = make_prompt_cache(model)
        elapsed = timed(functools.partial(prefill, cache, cold_prompt, prefill_step_size))
        if run:
            cold_times.append(elapsed)
    return {
        "model_path": model_path,
        "blas": describe_blas(),
        "runs": runs,
        "prefill_step_size": prefill_step_size,
        "per_turn": per_turn,
        "warm_floor_s": statistics.median(row["median_s"] for row in per_turn) if per_turn else None,
        "suffix_tokens_median": statistics.median(row["suffix_tokens"] for row in per_turn) if per_turn else None,
        "cold_prompt_tokens": len(cold_prompt),
        "cold_floor_s": statistics.median(cold_times),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mlxcel.bench.floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    add_shape_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--prefill-step-size", type=int, default=None,
                        help="chunk of the cold prefill (default: mlxcel's, 256 on the CPU, 2048 on a GPU)")
    parser.add_argument("--max-turns", type=int, default=4, help="warm turns measured (of conversation 0)")
    return parser


def floor_main(argv: list[str] | None = None) -> int:
    namespace = build_parser().parse_args(argv)
    from mlxcel.blas import reexec_with_optimized_blas

    reexec_with_optimized_blas()
    shape = Shape(
        conversations=namespace.conversations, turns=namespace.turns, system_tokens=namespace.system_tokens,
        user_tokens=namespace.user_tokens, reply_tokens=namespace.reply_tokens, seed=namespace.seed,
    )
    from mlxcel.model.loader import default_prefill_step_size

    step = namespace.prefill_step_size
    result = _floor(namespace.model_path, shape, runs=namespace.runs,
                    prefill_step_size=default_prefill_step_size() if step is None else step,
                    max_turns=namespace.max_turns)
    print(json.dumps(result))
    return 0


def measure_floor(
    model_path: str, shape: Shape, *, runs: int = 5, prefill_step_size: int | None = None
) -> dict[str, Any]:
    """Run the floor measurement in a fresh process (same environment, so same BLAS).

    Without ``prefill_step_size`` the subprocess takes mlxcel's default for its device.
    """
    command = [
        sys.executable, "-m", "mlxcel.bench.floor", "--model-path", str(model_path),
        "--conversations", str(shape.conversations), "--turns", str(shape.turns),
        "--system-tokens", str(shape.system_tokens), "--user-tokens", str(shape.user_tokens),
        "--reply-tokens", str(shape.reply_tokens), "--seed", str(shape.seed), "--runs", str(runs),
    ]
    if prefill_step_size is not None:
        command += ["--prefill-step-size", str(prefill_step_size)]
    completed = subprocess.run(
        command, capture_output=True, text=True, timeout=FLOOR_TIMEOUT_S,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    if completed.returncode != 0:
        raise RuntimeError(f"the floor measurement failed ({completed.returncode}): {completed.stderr.strip()[-800:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    raise SystemExit(floor_main())
