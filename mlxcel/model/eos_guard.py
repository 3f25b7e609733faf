"""`min_tokens` and `ignore_eos`: a logits processor that keeps the reply from ending too soon.

Built from a request's sampling settings (``SamplingParams.min_tokens``,
``ignore_eos``) and run with its other logits processors, before sampling: the
model's end-of-sequence tokens get a logit of -inf until ``min_tokens`` tokens
have been generated (with ``ignore_eos``, for the whole reply), as vLLM's
``min_tokens`` and llama.cpp's ``ignore_eos`` do. Stop strings and
``max_tokens`` still end the reply.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from mlxcel.types import SamplingParams


def eos_guard(sampling: SamplingParams, eos_token_ids: Collection[int]) -> Callable[[Any, Any], Any] | None:
    """The processor for ``sampling``, or None when it lets the reply end at any time."""
    if not eos_token_ids or not (sampling.ignore_eos or sampling.min_tokens):
        return None
    import mlx.core as mx

    ids = mx.array(sorted(eos_token_ids), dtype=mx.int32)
    # A processor runs once per token sampled, the first token included.
    num_sampled = [0]

    def guard(_tokens: Any, logits: Any) -> Any:
        num_sampled[0] += 1
        if not sampling.ignore_eos and num_sampled[0] > sampling.min_tokens:
            return logits
        logits[..., ids] = -mx.inf
        return logits

    return guard
