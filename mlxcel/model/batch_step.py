"""The batched decode step: mlx-lm's ``GenerationBatch._step``, normalizing the logits only when a row reads them,
and evaluating a row's logprobs only when it is read.

mlx-lm normalizes every row's logits over the whole vocabulary each step
(``logits - logsumexp(logits)``) for the logprobs it hands back and for the
samplers. Most rows read neither: the executor reports logprobs only for a
request that asked (``model/sampling.py``), and argmax, min-p, top-k, a
grammar's mask and the categorical draw give the same token for logits that
all moved by one amount. On the CPU that normalization was most of a batch's
step beyond the model: 16 rows of a 151,646-token vocabulary, 40.5 ms against
2.8 ms for the argmax alone (docs/benchmarks.md). So a step normalizes only
when some row's sampler says it reads normalized values (``reads_logprobs``:
a request for logprobs, or top-p), or is one this module does not know;
otherwise the samplers get the logits as they are.

mlx-lm also evaluates every row's logprobs as an array of its own each
step (``list(logprobs)`` queued with the tokens). Here the step queues the
whole matrix, and the rows stay lazy views of it: a row read for a
request's logprobs is one small slice then; the others never reach the
graph. At 64 rows that took 128 nodes off each step (a slice and a reshape
a row), whose evaluation is host work at the point where the host queues
the next step (about 6 us a row on the CPU; not measured on a GPU).

Grammar rows (``model/grammar_masks.py``) are masked together: the step
reads the rows' input tokens back first (queued before its forward pass, so
that waits for them alone), starts each row's mask on its thread, queues the
forward pass while they compute, and applies all the masks in one operation
before the rows' own samplers. mlx-lm's way, each row's processor and masked
sampler on its own slice, cost a few operations a row, and had the masks
start only once the forward pass was queued.

Everything else is mlx-lm 0.32.2's step as it is (the pin in pyproject.toml).
``install`` points ``GenerationBatch._step`` at ``step`` (``patches.original``
gives mlx-lm's back, for comparing); only the device thread runs it.
"""

from __future__ import annotations

from typing import Any

from mlxcel.model import patches
from mlxcel.model.grammar_masks import GrammarSequence, apply_masks, unpack_masks

# Arrays evaluated with the next decode steps (the finished rows' KV copies): (the executor's step that queued
# them, the arrays, a step's share of them). Queued alone while a step is in flight, they wait for it (on CUDA
# ``async_eval`` returns once the kernels before it are done) and the device idles while the host then builds
# the next step.
_riders: list[tuple[int, list[Any], int]] = []
# A decode step takes RIDER_BUDGET riders, or more when the waiting groups' shares (each a RIDER_SPREAD_STEPS-th
# of its group) add up to more: a wave's finished rows (64 rows of a 32-layer model, about 8,000 copies, 0.3 s
# to queue on an H100) no longer all fall on the one step after them, which the rows still decoding wait for.
RIDER_BUDGET = 256
RIDER_SPREAD_STEPS = 8


def evaluate_with_next_step(arrays: list[Any], queued_at: int) -> None:
    """Evaluate ``arrays`` with the next decode steps' ``async_eval`` (``flush_older_than`` if none takes them)."""
    _riders.append((queued_at, arrays, -(-len(arrays) // RIDER_SPREAD_STEPS)))


def flush_older_than(step_number: int) -> None:
    """Queue the arrays that no decode step took since before ``step_number`` (or all, given a larger number)."""
    if not _riders:
        return  # every step but the few after rows finish
    import mlx.core as mx

    stale = [array for queued_at, arrays, _share in _riders if queued_at < step_number for array in arrays]
    _riders[:] = [rider for rider in _riders if rider[0] >= step_number]
    if stale:
        mx.async_eval(stale)


def _take_riders() -> list[Any]:
    """The oldest riders, as many as this step takes: each group is gone within ``RIDER_SPREAD_STEPS`` steps."""
    budget = max(RIDER_BUDGET, sum(share for _queued_at, _arrays, share in _riders))
    taken: list[Any] = []
    while _riders and len(taken) < budget:
        queued_at, arrays, share = _riders[0]
        room = budget - len(taken)
        taken.extend(arrays[:room])
        if len(arrays) > room:
            _riders[0] = (queued_at, arrays[room:], share)
        else:
            del _riders[0]
    return taken


def reads_logprobs(sampler: Any, fallback: Any) -> bool:
    """Whether ``sampler`` needs normalized logprobs: its own word for it, else yes unless it is the greedy fallback."""
    return bool(getattr(sampler, "reads_logprobs", sampler is not fallback))


def step(self: Any) -> tuple[list[int], list[Any]]:
    """``GenerationBatch._step`` of mlx-lm 0.32.2, the normalization skipped when no row reads it, and grammar
    rows masked together."""
    import mlx.core as mx
    import numpy as np

    self._current_tokens = self._next_tokens
    self._current_logprobs = self._next_logprobs
    inputs = self._current_tokens

    logits = self.model(inputs[:, None], cache=self.prompt_cache)
    logits = logits[:, -1, :]

    samplers = [self.fallback_sampler if s is None else s for s in (self.samplers or [None] * len(self.uids))]
    grammar_rows = [e for e, sampler in enumerate(samplers) if getattr(sampler, "grammar", None) is not None]
    masks = host_inputs = None
    if grammar_rows:
        # The rows' input tokens were queued before this step's forward pass, so this waits for them alone;
        # the masks they lead to compute on their threads while the forward pass is queued.
        mx.eval(inputs)
        host_inputs = inputs.tolist()
        sequences = [samplers[e].grammar for e in grammar_rows]
        grammars = sequences[0].grammars
        masks = grammars.start_masks(sequences, [sequence.next_token(host_inputs[e])
                                                 for e, sequence in zip(grammar_rows, sequences, strict=True)],
                                     logits.shape[-1])
        samplers = [getattr(s, "wrapped", s) or self.fallback_sampler for s in samplers]

    token_context = []
    # A grammar's feed is the masks above: it needs neither the row's token context nor a slice of its logits.
    row_processors = ([[p for p in processors or () if not isinstance(getattr(p, "__self__", None), GrammarSequence)]
                       for processors in self.logits_processors] if any(self.logits_processors) else [])
    if any(row_processors):
        processed_logits = []
        for e in range(len(self.uids)):
            sample_logits = logits[e : e + 1]
            processors = row_processors[e]
            if processors:
                context = self._token_context[e].update_and_fetch(inputs[e : e + 1])
                token_context.append(context)
                for processor in processors:
                    sample_logits = processor(context, sample_logits)
            processed_logits.append(sample_logits)
        logits = mx.concatenate(processed_logits, axis=0)

    if any(reads_logprobs(sampler, self.fallback_sampler) for sampler in samplers):
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    else:
        logprobs = logits  # no row reads them normalized; each row's token is the same either way

    sampled_from = logprobs
    if masks is not None:
        mx.async_eval(logprobs, token_context)  # the forward pass runs while the host waits for the masks
        packed = grammars.finish_masks(masks, logprobs)
        if len(grammar_rows) < len(samplers):
            # One mask a row: a free row's allows every token, so its values stay as they are.
            rows, packed = packed, np.full((len(samplers), packed.shape[1]), 0xFFFFFFFF, dtype=np.uint32)
            packed[grammar_rows] = rows
        sampled_from = apply_masks(logprobs, unpack_masks(packed, logprobs.shape[-1]))

    if not samplers or all(s is samplers[0] for s in samplers):
        sampled = (samplers[0] if samplers else self.fallback_sampler)(sampled_from)
    else:
        sampled = mx.concatenate([s(sampled_from[e : e + 1]) for e, s in enumerate(samplers)], axis=0)

    self._next_tokens = sampled
    # Each row's logprobs (the model's, before a grammar's mask) stay a lazy view of the step's matrix,
    # evaluated where a request reads them: queued as rows, they were a slice and a reshape per row in every
    # step's graph (128 more nodes at 64 rows).
    self._next_logprobs = list(logprobs)
    mx.async_eval(self._next_tokens, logprobs, token_context, _take_riders())

    if host_inputs is None:
        mx.eval(inputs)
        host_inputs = inputs.tolist()
    inputs = host_inputs
    for sti, ti in zip(self.tokens, inputs, strict=False):
        sti.append(ti)
    return inputs, self._current_logprobs


def install() -> bool:
    """Point ``GenerationBatch._step`` at ``step``; whether it changed."""
    from mlx_lm.generate import GenerationBatch

    return patches.point(GenerationBatch, "_step", step)

