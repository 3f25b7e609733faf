"""Speculative decoding's rejection rule and the verify step's output distribution.

The rule alone (a numpy function) against the exact distribution; then the
whole verify step of ``SpeculativeBatch`` on a Markov-chain "model" of five
tokens through mlx-lm's own BatchGenerator: the distribution of sampled
replies with speculation must be the chain's, which is known exactly.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache

from mlxcel.model.draft import DraftModel
from mlxcel.model.sampling import make_sampler
from mlxcel.model.speculation import SpeculationStats, accept_drafts, install, sampling_probs
from mlxcel.types import SamplingParams


@pytest.fixture(autouse=True)
def gate_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step with proposals verifies: these tests are about what a verify step gives, not about when
    the gate (mlxcel/core/speculation_gate.py, measured wall times) lets one run."""
    from mlxcel.core.speculation_gate import SpeculationGate

    monkeypatch.setattr(SpeculationGate, "should_verify", lambda gate, batch_size: True)


# Six checks draw afresh on every suite run (mlx-lm's batch is not bit-for-bit repeatable despite the seed): at 1e-3
# they fail about one run in 170 by chance (it happened once, p = 6e-4). A real bias over thousands of replies gives
# a p-value far below this.
SIGNIFICANCE = 1e-4


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
    assert chi_square_p_value(counts, probs[0] * trials) > SIGNIFICANCE
    # How far acceptance runs: each draft is accepted with its own probability, in order.
    expected = []
    run = 1.0
    for position, draft in enumerate(drafts):
        expected.append(run * (1 - probs[position, draft]))
        run *= probs[position, draft]
    expected.append(run)
    assert chi_square_p_value(accepted_counts, np.array(expected) * trials) > SIGNIFICANCE


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


# A draft that disagrees with the chain often: its proposals are sometimes rejected.
DRAFT_TABLE = np.log(np.array([
    [0.10, 0.30, 0.40, 0.10, 0.10],
    [0.05, 0.05, 0.30, 0.50, 0.10],
    [0.50, 0.20, 0.10, 0.10, 0.10],
    [0.60, 0.10, 0.10, 0.10, 0.10],
    [0.10, 0.50, 0.20, 0.10, 0.10],
]))


class MarkovModel:
    """Logits that depend on the input token only; one cache layer, so the batch's KV bookkeeping is real."""

    def __init__(self, table: np.ndarray = TABLE) -> None:
        self.table = mx.array(table, dtype=mx.float32)
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
    for row, tokens in enumerate(batch.tokens):
        held = np.asarray(cache.extract(row).keys[0, 0, :, 0]).astype(int).tolist()
        assert held == tokens[-len(held):]
        assert int(cache.offset[row].item()) == len(held)


def assert_draft_kv_holds_a_prefix(batch: Any) -> None:
    """The draft's KV of each member row is the first tokens of the row, as many as it says it holds."""
    draft = getattr(batch, "_draft", None)
    if draft is None or draft.cache is None:
        return
    (cache,) = draft.cache
    rows = dict(zip(batch.uids, batch.tokens, strict=True))
    assert set(draft.members) <= set(rows)
    for m, uid in enumerate(draft.members):
        held = draft.held[uid]
        keys = np.asarray(cache.extract(m).keys[0, 0, :, 0]).astype(int).tolist()
        assert len(keys) == held == int(cache.offset[m].item())
        assert keys == rows[uid][:held]


def chain_probabilities(sampling: SamplingParams, table: np.ndarray = TABLE) -> np.ndarray:
    return np.asarray(sampling_probs(mx.array(table, dtype=mx.float32), sampling))


def run_chain(sampling: SamplingParams, *, rows: int, length: int | list[int], speculate: bool,
              stats: SpeculationStats, draft: MarkovModel | None = None,
              later: int = 0) -> tuple[list[tuple[int, ...]], MarkovModel]:
    """``rows`` replies of ``length`` tokens each (or one length a row); ``later`` rows join after 3 steps."""
    model = MarkovModel()
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=rows, prefill_batch_size=rows,
                               prefill_step_size=64)
    if speculate:
        drafting = None if draft is None else DraftModel(model=draft, path=Path("draft"), prefill_step_size=3)
        install(generator, num_tokens=4, policy=lambda uid: sampling, stats=stats, draft=drafting)
    lengths = length if isinstance(length, list) else [length] * rows
    # Prompts of different lengths, all ending with 1 (the chain tests count on it).
    prompts = [[0, 1, 2, 0, 1, 2, 0, 1][3 * (row % 3):] for row in range(rows)]
    first = rows - later
    uids = generator.insert(prompts[:first], max_tokens=lengths[:first],
                            samplers=[make_sampler(sampling) for _ in range(first)])
    replies: dict[int, list[int]] = {uid: [] for uid in uids}
    steps = 0
    while True:
        _prompt_responses, responses = generator.next()
        steps += 1
        for response in responses:
            replies[response.uid].append(response.token)
        assert_kv_holds_the_tokens(generator._generation_batch)
        assert_draft_kv_holds_a_prefix(generator._generation_batch)
        if steps == 3 and later:
            joined = generator.insert(prompts[first:], max_tokens=lengths[first:],
                                      samplers=[make_sampler(sampling) for _ in range(later)])
            uids.extend(joined)
            replies.update({uid: [] for uid in joined})
        if len(uids) == rows and all(len(replies[uid]) == lengths[i] for i, uid in enumerate(uids)):
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
    assert chi_square_p_value(observed, np.array(expected) * len(replies)) > SIGNIFICANCE
    # More power on each step: every transition, given the token before it, follows the chain's row.
    transitions = np.zeros((VOCABULARY, VOCABULARY))
    for reply in replies:
        for previous, token in itertools.pairwise((1, *reply)):
            transitions[previous, token] += 1
    expected_transitions = transitions.sum(axis=1, keepdims=True) * probs
    assert chi_square_p_value(transitions.ravel(), expected_transitions.ravel()) > SIGNIFICANCE


def test_greedy_replies_and_kv_with_speculation_equal_plain_decoding() -> None:
    greedy = SamplingParams(temperature=0.0)
    stats = SpeculationStats()
    plain, _ = run_chain(greedy, rows=3, length=12, speculate=False, stats=stats)
    spoken, model = run_chain(greedy, rows=3, length=12, speculate=True, stats=stats)
    assert spoken == plain
    assert stats.verify_steps > 0
    assert stats.accepted_tokens > 0
    assert len(model.widths) < 12  # fewer passes than tokens


# --- a draft model ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("drafts", [[0], [2, 1], [3, 3, 0]])
def test_the_rule_with_a_stochastic_draft_keeps_the_target_distribution(drafts: list[int]) -> None:
    rng = np.random.default_rng(2)
    vocabulary = 4
    probs = rng.dirichlet(np.ones(vocabulary), size=len(drafts) + 1)
    draft_probs = rng.dirichlet(np.ones(vocabulary), size=len(drafts))
    trials = 20000
    counts = np.zeros(vocabulary)
    accepted_first = 0
    for _ in range(trials):
        # The draft samples its tokens from q, as a stochastic draft does; the fixed list only sets the length.
        sampled = [int(rng.choice(vocabulary, p=row)) for row in draft_probs]
        accepted, token = accept_drafts(probs, sampled, rng, draft_probs)
        counts[sampled[0] if accepted else token] += 1
        accepted_first += accepted > 0
    assert chi_square_p_value(counts, probs[0] * trials) > SIGNIFICANCE
    # The first draft is accepted with probability sum(min(p, q)).
    expected = np.minimum(probs[0], draft_probs[0]).sum()
    assert abs(accepted_first / trials - expected) < 4 * math.sqrt(expected * (1 - expected) / trials)


def test_the_rule_with_q_one_hot_is_the_deterministic_rule() -> None:
    probs = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    one_hot = np.array([[0.0, 1.0, 0.0]])
    for seed in range(50):
        assert (accept_drafts(probs, [1], np.random.default_rng(seed), one_hot)
                == accept_drafts(probs, [1], np.random.default_rng(seed)))


def test_the_rule_pads_a_draft_of_another_width() -> None:
    # A draft whose logits are one wider: its extra token has target probability 0 and is always rejected.
    probs = np.array([[0.5, 0.5], [0.5, 0.5]])
    draft_probs = np.array([[0.0, 0.0, 1.0]])
    rng = np.random.default_rng(0)
    for _ in range(100):
        accepted, token = accept_drafts(probs, [2], rng, draft_probs)
        assert accepted == 0
        assert token in (0, 1)


@pytest.mark.parametrize("draft_table", [TABLE, DRAFT_TABLE], ids=["itself", "another"])
def test_greedy_replies_with_a_draft_model_equal_plain_decoding(draft_table: np.ndarray) -> None:
    greedy = SamplingParams(temperature=0.0)
    stats = SpeculationStats()
    # Rows of different prompt and reply lengths, two joining mid-speculation: rows leave and join.
    lengths = [12, 7, 15, 9, 11]
    plain, _ = run_chain(greedy, rows=5, length=lengths, speculate=False, stats=stats, later=2)
    spoken, model = run_chain(greedy, rows=5, length=lengths, speculate=True, stats=stats,
                              draft=MarkovModel(draft_table), later=2)
    assert spoken == plain
    assert stats.verify_steps > 0
    if draft_table is TABLE:
        assert stats.accepted_tokens == stats.proposed_tokens  # its own draft: every proposal holds
    else:
        assert 0 < stats.accepted_tokens < stats.proposed_tokens


def test_sampled_self_draft_accepts_everything() -> None:
    # p == q: min(1, p / q) is 1, so every drafted token is accepted.
    sampling = SamplingParams(temperature=0.8, top_k=4)
    stats = SpeculationStats()
    run_chain(sampling, rows=4, length=10, speculate=True, stats=stats, draft=MarkovModel())
    assert stats.proposed_tokens > 0
    assert stats.accepted_tokens == stats.proposed_tokens


@pytest.mark.slow  # about a minute: 2,000 replies through mlx-lm's batch
@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=3),
])
def test_sampled_replies_with_a_stochastic_draft_follow_the_chain(sampling: SamplingParams) -> None:
    mx.random.seed(0)
    length = 6
    stats = SpeculationStats()
    replies: list[tuple[int, ...]] = []
    for _ in range(4):
        batch, _model = run_chain(sampling, rows=500, length=length, speculate=True, stats=stats,
                                  draft=MarkovModel(DRAFT_TABLE))
        replies.extend(batch)
    assert stats.verify_steps > 0
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    probs = chain_probabilities(sampling)
    transitions = np.zeros((VOCABULARY, VOCABULARY))
    for reply in replies:
        for previous, token in itertools.pairwise((1, *reply)):
            transitions[previous, token] += 1
    expected_transitions = transitions.sum(axis=1, keepdims=True) * probs
    assert chi_square_p_value(transitions.ravel(), expected_transitions.ravel()) > SIGNIFICANCE


def test_a_draft_never_proposes_ids_past_the_tokenizer() -> None:
    # The draft's table prefers token 4, which the "tokenizer" (ids below 4) does not have.
    table = np.log(np.full((VOCABULARY, VOCABULARY), 0.05))
    table[:, 4] = 0.0
    draft = DraftModel(model=MarkovModel(table), path=Path("draft"), prefill_step_size=3, id_limit=4)
    model = MarkovModel()
    generator = BatchGenerator(model, stop_tokens=[], completion_batch_size=2, prefill_batch_size=2,
                               prefill_step_size=64)
    stats = SpeculationStats()
    install(generator, num_tokens=3, policy=lambda uid: SamplingParams(temperature=0.0), stats=stats, draft=draft)
    generator.insert([[0, 1, 2], [2, 1]], max_tokens=[8, 8])
    proposed: list[list[int]] = []
    batch = generator._generation_batch
    original = batch._draft.propose

    def spy(*args: Any) -> Any:
        result = original(*args)
        proposed.extend(proposal for proposal, _q in result.values())
        return result

    batch._draft.propose = spy
    for _ in range(6):
        generator.next()
    generator.close()
    assert proposed
    assert all(token < 4 for proposal in proposed for token in proposal)


# --- what the gate is given -------------------------------------------------------------------


def test_the_gate_times_a_verify_pass_from_its_inputs_and_skips_the_plain_step_after_it() -> None:
    """A plain step right after a verify step returns the verify's correction without a pass of its own: were
    it counted (a token per row in a few milliseconds) plain decoding would look faster than it is."""
    from mlxcel.model.speculation import SpeculativeBatch, _Step

    records: list[tuple[int, bool, int, float]] = []

    class Recording:
        def record(self, rows: int, *, verified: bool, tokens: int, seconds: float) -> None:
            records.append((rows, verified, tokens, seconds))

    batch = SpeculativeBatch.__new__(SpeculativeBatch)
    batch.uids = [1, 2]
    batch.gate = Recording()  # type: ignore[assignment]
    steps = [
        (_Step(rows=2, verified=True, tokens=7, began=10.0), 10.5),  # began: when its inputs were ready
        (_Step(rows=2, verified=False, tokens=2, began=10.5, after_verify=True), 10.51),
        (_Step(rows=2, verified=False, tokens=2, began=10.51), 10.81),
        (_Step(rows=3, verified=False, tokens=3, began=10.81), 11.0),  # a row left since: not comparable
    ]
    for previous, now in steps:
        batch._previous_step = previous
        batch._measure(now)
    assert records == [(2, True, 7, 0.5), (2, False, 2, pytest.approx(0.3))]


def test_the_plain_step_after_a_verify_step_is_the_one_marked(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.core.speculation_gate import SpeculationGate
    from mlxcel.model.speculation import SpeculativeBatch

    seen = []
    measure = SpeculativeBatch._measure

    def spy(self: Any, now: float) -> None:
        seen.append(self._previous_step)
        measure(self, now)

    monkeypatch.setattr(SpeculativeBatch, "_measure", spy)
    # Verify every other step that has proposals.
    choices = itertools.cycle([True, False])
    monkeypatch.setattr(SpeculationGate, "should_verify", lambda gate, batch_size: next(choices))
    run_chain(SamplingParams(temperature=0.0), rows=2, length=24, speculate=True, stats=SpeculationStats())
    pairs = list(itertools.pairwise(step for step in seen if step is not None))
    assert any(before.verified and not after.verified for before, after in pairs)
    for before, after in pairs:
        if not after.verified:
            assert after.after_verify == before.verified
