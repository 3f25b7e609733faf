"""Per-sequence sampling on the device thread: mlx-lm's samplers and logits processors, and the tokens reported.

Greedy sequences share the batch's one sampler (None here), so the batch
samples in one call; a sampled sequence gets mlx-lm's chain (top-p, min-p,
top-k) with its own seed; penalties and logit_bias are mlx-lm's processors.
A grammar adds a processor and wraps the sampler (``grammar_masks.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from mlxcel.core.plan import SampledToken
from mlxcel.model.grammar_masks import Grammars
from mlxcel.types import SamplingParams


def sampled_token(sequence_id: int, sampling: SamplingParams, response: Any) -> SampledToken:
    token = int(response.token)
    if not sampling.logprobs:
        # Reading logprobs would queue behind the next step that mlx-lm has
        # already started (same stream), undoing its pipelining: skip it.
        return SampledToken(sequence_id=sequence_id, token=token, logprob=0.0,
                            finish_reason=response.finish_reason)
    import numpy as np

    # The vector is already evaluated: copying it to the host waits for nothing.
    logprobs = np.asarray(response.logprobs, dtype=np.float32)
    top: tuple[tuple[int, float], ...] = ()
    count = sampling.top_logprobs
    if count > 0:
        indices = np.argpartition(-logprobs, count - 1)[:count]
        indices = indices[np.argsort(-logprobs[indices], kind="stable")]
        top = tuple((int(index), float(logprobs[index])) for index in indices)
    return SampledToken(
        sequence_id=sequence_id,
        token=token,
        logprob=float(logprobs[token]),
        top_logprobs=top,
        finish_reason=response.finish_reason,
    )


def make_sampler(sampling: SamplingParams) -> Callable[[Any], Any] | None:
    """None means greedy: the generator's shared sampler, so the batch samples in one call."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if sampling.temperature == 0:
        return None
    temperature = sampling.temperature
    top_p, min_p, top_k = sampling.top_p, sampling.min_p, sampling.top_k
    key_state = [mx.random.key(sampling.seed)] if sampling.seed is not None else None

    def sample(logprobs: Any) -> Any:
        # mlx-lm's make_sampler chain (top-p, min-p, top-k), with a per-request seed.
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p > 0:
            logprobs = apply_min_p(logprobs, min_p)
        if 0 < top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, top_k)
        logits = logprobs * (1 / temperature)
        if key_state is None:
            return mx.random.categorical(logits)
        key_state[0], subkey = mx.random.split(key_state[0])
        return mx.random.categorical(logits, key=subkey)

    # Top-p keeps a share of the probability mass: it needs normalized logprobs (model/batch_step.py); min-p,
    # top-k and the draw give the same token for logits that all moved by one amount.
    sample.reads_logprobs = 0 < top_p < 1.0  # type: ignore[attr-defined]
    return sample


def greedy_reporting_logprobs(logprobs: Any) -> Any:
    """The greedy token of a row whose request reports logprobs (so its step normalizes them)."""
    import mlx.core as mx

    return mx.argmax(logprobs, axis=-1)


greedy_reporting_logprobs.reads_logprobs = True  # type: ignore[attr-defined]


def sampling_probs(logprobs: Any, sampling: SamplingParams) -> Any:
    """The distribution ``make_sampler`` draws from (filters, then temperature), for speculation's rejection rule."""
    import mlx.core as mx
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    if 0 < sampling.top_p < 1.0:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p > 0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    return mx.softmax(logprobs.astype(mx.float32) * (1 / sampling.temperature), axis=-1)


def make_sampling(
    sampling: SamplingParams, grammars: Grammars | None = None, sequence_id: int | None = None
) -> tuple[Callable[[Any], Any] | None, list[Callable[[Any, Any], Any]] | None]:
    """A sequence's sampler and logits processors (None: the batch's shared greedy sampler; no processors).

    A grammar takes a part in each: its processor feeds the matcher the token
    just sampled, its sampler masks what the grammar forbids (see Grammars);
    ``sequence_id`` names the sequence when its grammar gives up.
    """
    sampler = make_sampler(sampling)
    if sampling.logprobs:  # the reported logprobs are read from the step's normalized values
        if sampler is None:
            sampler = greedy_reporting_logprobs
        else:
            sampler.reads_logprobs = True  # type: ignore[attr-defined]
    processors = make_logits_processors(sampling, grammars.eos_token_ids if grammars is not None else ())
    if sampling.reasoning_budget is not None:
        from mlxcel.model.reasoning_budget import ReasoningBudgetProcessor

        processors = [*(processors or ()), ReasoningBudgetProcessor(sampling.reasoning_budget)]
    if sampling.grammar is None:
        return sampler, processors
    if grammars is None:
        raise ValueError("a grammar-constrained request needs the model's tokenizer")
    grammar = grammars.sequence(sampling.grammar, sequence_id)
    return grammar.sampler(sampler), [*(processors or ()), grammar.feed]


def make_logits_processors(
    sampling: SamplingParams, eos_token_ids: Collection[int] = ()
) -> list[Callable[[Any, Any], Any]] | None:
    """mlx-lm's processors for the request's penalties and logit_bias, and min_tokens / ignore_eos; None when none."""
    if not sampling.processes_logits:
        return None
    from mlx_lm.sample_utils import make_logits_processors as mlx_lm_processors

    from mlxcel.model.eos_guard import eos_guard

    processors: list[Callable[[Any, Any], Any]] = mlx_lm_processors(
        logit_bias=dict(sampling.logit_bias) or None,
        repetition_penalty=None if sampling.repetition_penalty == 1.0 else sampling.repetition_penalty,
        repetition_context_size=sampling.penalty_context,
        presence_penalty=sampling.presence_penalty or None,
        presence_context_size=sampling.penalty_context,
        frequency_penalty=sampling.frequency_penalty or None,
        frequency_context_size=sampling.penalty_context,
    )
    guard = eos_guard(sampling, eos_token_ids)
    return [*processors, guard] if guard is not None else processors
