"""Speculative decoding's rejection rule and the verify step's output distribution.

The rule alone (a numpy function) against the exact distribution; then the
whole verify step of ``SpeculativeBatch`` on a Markov-chain "model" of five
tokens through mlx-lm's own BatchGenerator: the distribution of sampled
replies with speculation must be the chain's, which is known exactly.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from mlxcel.model.sampling import make_sampler
from mlxcel.model.speculation import SpeculationStats, accept_drafts, install, sampling_probs
from mlxcel.types import SamplingParams


def chi_square_p_value(observed: np.ndarray, expected: np.ndarray) -> float:
    """Pearson's test, cells with expected count under 5 pooled (Wilson-Hilferty approximation)."""
    small = expected < 5
    observed = np.append(observed[~small], observed[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = float(((observed - expected) ** 2 / expected).sum())
    dof = len(observed) - 1
    z = ((statistic / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("drafts", [[0], [2, 1], [3, 3, 0]])
def test_the_rule_keeps_the_target_distribution(drafts: list[int]) -> None:
    rng = np.random.default_rng(0)
    vocabulary = 4
    probs = rng.dirichlet(np.ones(vocabulary), size=len(drafts) + 1)
    trials = 20000
    # The first emitted token after the row: the draft if accepted at position 0, else the correction.
    counts = np.zeros(vocabulary)
    accepted_counts = np.zeros(len(drafts) + 1)
    for _ in range(trials):
        accepted, token = accept_drafts(probs, drafts, rng)
        accepted_counts[accepted] += 1
        counts[drafts[0] if accepted else token] += 1
    assert chi_square_p_value(counts, probs[0] * trials) > 1e-3
    # How far acceptance runs: each draft is accepted with its own probability, in order.
    expected = []
    run = 1.0
    for position, draft in enumerate(drafts):
        expected.append(run * (1 - probs[position, draft]))
        run *= probs[position, draft]
    expected.append(run)
    assert chi_square_p_value(accepted_counts, np.array(expected) * trials) > 1e-3


def test_a_certain_draft_is_always_accepted_and_an_impossible_one_never() -> None:
    rng = np.random.default_rng(1)
    probs = np.array([[0.0, 1.0, 0.0], [0.2, 0.0, 0.8], [1.0, 0.0, 0.0]])
    for _ in range(200):
        accepted, token = accept_drafts(probs, [1, 1], rng)
        # Draft 1 then draft 1 again: the second has probability 0, so the correction is 0 or 2.
        assert accepted == 1
        assert token in (0, 2)


def test_sampling_probs_follow_the_sampler() -> None:
    logprobs = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    probs = np.asarray(sampling_probs(logprobs, SamplingParams(temperature=1.0, top_k=2)))[0]
    np.testing.assert_allclose(probs, [0.625, 0.375, 0.0, 0.0], atol=1e-6)
    probs = np.asarray(sampling_probs(logprobs, SamplingParams(temperature=0.5, top_p=0.7)))[0]
    np.testing.assert_allclose(probs, np.array([25, 9, 0, 0]) / 34, atol=1e-6)


# --- the verify step on a known chain ---------------------------------------------------------

VOCABULARY = 5
# Each token's successor logits: a chain that repeats itself (proposals abound) but not always.
TABLE = np.log(np.array([
    [0.05, 0.45, 0.25, 0.15, 0.10],
    [0.10, 0.05, 0.40, 0.35, 0.10],
    [0.45, 0.10, 0.05, 0.25, 0.15],
    [0.30, 0.30, 0.20, 0.10, 0.10],
    [0.25, 0.25, 0.25, 0.15, 0.10],
]))


class MarkovModel:
    """Logits that depend on the input token only; one cache layer, so the batch's KV bookkeeping is real."""

    def __init__(self) -> None:
        self.table = mx.array(TABLE, dtype=mx.float32)
        self.widths: list[int] = []

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, inputs: Any, cache: list[Any], **kwargs: Any) -> Any:
        batch, length = inputs.shape
        self.widths.append(length)
        # Keys record each position's token, so a test can read back what the KV holds.
        keys = inputs.astype(mx.float32)[:, None, :, None]
        for layer in cache:
            layer.update_and_fetch(keys, keys)
        return self.table[inputs]


def assert_kv_holds_the_tokens(batch: Any) -> None:
    """Each row's KV (its keys are its tokens) is exactly the row's tokens: nothing rejected stays."""
    if not batch.uids:
        return
    (cache,) = batch.prompt_cache
    padding = cache.left_padding.tolist()
    keys = np.asarray(cache.keys[:, 0, :cache._idx, 0]).astype(int)
    for row, tokens in enumerate(batch.tokens):
        assert keys[row, padding[row]:].tolist() == tokens[-(cache._idx - padding[row]):]
        assert int(cache.offset[row].item()) == cache._idx - padding[row]


def chain_probabilities(sampling: SamplingParams) -> np.ndarray:
    return np.asarray(sampling_probs(mx.array(TABLE, dtype=mx.float32), sampling))


def run_chain(sampling: SamplingParams, *, rows: int, length: int, speculate: bool,
              stats: SpeculationStats) -> tuple[list[tuple[int, ...]], MarkovModel]:
    model = MarkovModel()
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows,
                               prefill_step_size=64)
    if speculate:
        install(generator, num_tokens=4, policy=lambda uid: sampling, stats=stats)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]
    uids = generator.insert([prompt] * rows, max_tokens=[length] * rows,
                            samplers=[make_sampler(sampling) for _ in range(rows)])
    replies: dict[int, list[int]] = {uid: [] for uid in uids}
    while len(replies) > sum(1 for reply in replies.values() if len(reply) == length) or not any(replies.values()):
        _prompt_responses, responses = generator.next()
        for response in responses:
            replies[response.uid].append(response.token)
        assert_kv_holds_the_tokens(generator._generation_batch)
        if all(len(reply) == length for reply in replies.values()):
            break
    generator.close()
    return [tuple(replies[uid]) for uid in uids], model


@pytest.mark.slow  # about a minute: 6,000 replies through mlx-lm's batch
@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8),
])
def test_sampled_replies_with_speculation_follow_the_chain(sampling: SamplingParams) -> None:
    mx.random.seed(0)
    length, joint = 8, 3
    stats = SpeculationStats()
    replies: list[tuple[int, ...]] = []
    for _ in range(4):
        batch, model = run_chain(sampling, rows=500, length=length, speculate=True, stats=stats)
        replies.extend(batch)
    assert stats.verify_steps > 0
    assert 0 < stats.accepted_tokens < stats.proposed_tokens  # accepted and rejected both happened
    assert max(model.widths) > 1
    probs = chain_probabilities(sampling)
    # The joint distribution of the first tokens, then every transition.
    outcomes = list(itertools.product(range(VOCABULARY), repeat=joint))
    expected = []
    for outcome in outcomes:
        # The prompt ends with 1 and its last token is the first input; the reply's first token follows it.
        previous, p = 1, 1.0
        for token in outcome:
            p *= probs[previous, token]
            previous = token
        expected.append(p)
    index = {outcome: position for position, outcome in enumerate(outcomes)}
    observed = np.zeros(len(outcomes))
    for reply in replies:
        observed[index[reply[:joint]]] += 1
    assert chi_square_p_value(observed, np.array(expected) * len(replies)) > 1e-3
    # More power on each step: every transition, given the token before it, follows the chain's row.
    transitions = np.zeros((VOCABULARY, VOCABULARY))
    for reply in replies:
        for previous, token in itertools.pairwise((1, *reply)):
            transitions[previous, token] += 1
    expected_transitions = transitions.sum(axis=1, keepdims=True) * probs
    assert chi_square_p_value(transitions.ravel(), expected_transitions.ravel()) > 1e-3


def test_greedy_replies_and_kv_with_speculation_equal_plain_decoding() -> None:
    greedy = SamplingParams(temperature=0.0)
    stats = SpeculationStats()
    plain, _ = run_chain(greedy, rows=3, length=12, speculate=False, stats=stats)
    spoken, model = run_chain(greedy, rows=3, length=12, speculate=True, stats=stats)
    assert spoken == plain
    assert stats.verify_steps > 0
    assert stats.accepted_tokens > 0
    assert len(model.widths) < 12  # fewer passes than tokens
