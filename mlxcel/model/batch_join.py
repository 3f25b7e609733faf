"""Sequences whose first token is already sampled join mlx-lm's decode batch without a pass of their own.

A direct start (``mlxcel/actors/device.py``) prefills its prompt on its own
cache and samples the first token. Handed to ``BatchGenerator.insert`` as a
one-token prompt, it would go through mlx-lm's prompt stage: a deep copy of
the prompt batch's caches, a forward pass of its own for the joining rows (at
most ``prefill_batch_size`` of them per step), then the join. Here the rows go
straight into the generation batch with their first token as the next input,
so the batch's next decode step computes their second token with everyone
else's: however many start in a step, they cost one cache merge. Rows of
one batched start pass skip even that: they join as they lie in the pass's
buffer, the filler after each row masked as its gap (``gapped_cache``).

mlx-lm's generation batch returns each row's input as that step's token, so a
joined row's first reported token is the one its start already reported: the
caller drops it, and gives the generator ``max_tokens`` counting it.
Only the device thread calls this, and only for plain KV caches (those that
merge into mlx-lm's batch cache).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs


@attrs.frozen(kw_only=True, eq=False)
class SharedPass:
    """The per-layer caches of one batched start pass: each row's tokens from position 0, filler after them."""

    caches: list[Any]


@attrs.frozen(kw_only=True)
class Joiner:
    """One sequence joining the batch: its first token (an MLX array of shape (1,)) and its prefilled caches."""

    first_token: Any
    first_logprobs: Any
    caches: list[Any]
    # Every token in ``caches`` (the first token is not yet).
    all_tokens: list[int]
    max_tokens: int
    sampler: Callable[[Any], Any] | None
    processors: Sequence[Callable[[Any, Any], Any]] | None
    # The batched start pass whose row ``shared_row`` ``caches`` are views of (None: a start of its own).
    shared: SharedPass | None = None
    shared_row: int = 0


def joinable(caches: Sequence[Any]) -> bool:
    """Whether these caches merge into mlx-lm's batch cache (plain KV caches only)."""
    from mlx_lm.models.cache import KVCache

    return all(type(cache) is KVCache for cache in caches)


def join_decoding(generator: Any, joiners: Sequence[Joiner]) -> list[int]:
    """Add ``joiners`` to ``generator``'s decode batch; returns their uids there, in order."""
    import mlx.core as mx
    from mlx_lm.generate import GenerationBatch, _merge_caches
    from mlx_lm.models.cache import BatchKVCache, TokenBuffer

    from mlxcel.model.gapped_cache import GappedBatchKVCache, from_shared_pass

    count = len(joiners)
    uids = list(range(generator._uid_count, generator._uid_count + count))
    generator._uid_count += count
    stop = generator._default_stop_sequences
    batch = GenerationBatch.empty(generator.model, generator.sampler)
    batch.uids = uids
    shared = joiners[0].shared
    if any(joiner.shared is not shared for joiner in joiners):
        shared = None  # rows of several passes, or starts of their own: merged
    if shared is not None:
        # Rows of one pass join as they lie in its buffer, their filler masked (gapped_cache.from_shared_pass).
        batch.prompt_cache = from_shared_pass(shared.caches, [joiner.shared_row for joiner in joiners],
                                              [len(joiner.all_tokens) for joiner in joiners])
    else:
        batch.prompt_cache = _merge_caches([joiner.caches for joiner in joiners])
    batch.tokens = [list(joiner.all_tokens) for joiner in joiners]
    batch.samplers = [joiner.sampler or generator.sampler for joiner in joiners]
    batch.logits_processors = [tuple(joiner.processors or ()) for joiner in joiners]
    batch.stop_sequences = [stop] * count
    batch.max_tokens = [joiner.max_tokens for joiner in joiners]
    # The next step feeds the first tokens (and returns them, as every step returns its inputs).
    batch._next_tokens = mx.concatenate([joiner.first_token.reshape(1) for joiner in joiners]).astype(mx.uint32)
    batch._next_logprobs = [joiner.first_logprobs for joiner in joiners]
    batch._token_context = [TokenBuffer(tokens) for tokens in batch.tokens]
    batch._num_tokens = [0] * count
    batch._matchers = [sequences.matcher() for sequences in batch.stop_sequences]
    main = generator._generation_batch
    if len(main) == 0:
        # An empty batch's placeholders (an empty token array, no caches) are not extended: replaced.
        main.uids, main.prompt_cache, main.tokens = [], [], []
        main.samplers, main.logits_processors, main.max_tokens, main.stop_sequences = [], [], [], []
        main._next_tokens, main._next_logprobs = None, []
        main._token_context, main._num_tokens, main._matchers = [], [], []
    elif shared is not None:
        # mlx-lm's extend would drop the joining rows' gaps: the batch's caches keep gaps from here.
        main.prompt_cache = [GappedBatchKVCache.adopt(cache) if isinstance(cache, BatchKVCache) else cache
                             for cache in main.prompt_cache]
    main.extend(batch)
    return uids
