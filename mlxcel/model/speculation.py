"""Speculative decoding inside mlx-lm's decode batch, per row: n-gram (prompt lookup) or a draft model.

``SpeculativeBatch`` is mlx-lm's ``GenerationBatch`` with one step more: when
a row's recent tokens occurred earlier in its prompt or reply
(``mlxcel/core/ngram.py``), or, with a draft model, whenever the row may
propose (``draft.py``: the draft's greedy or sampled next k tokens, its KV
per row kept beside the batch), the step feeds the batch ``1 + k`` tokens per
row (the token in flight, then the proposal, shorter rows padded) in one
forward pass and keeps, per row, the proposed tokens the target agrees
with plus one token of its own (the correction, or a bonus after a fully
accepted run). Greedy: a proposal is accepted while it equals the argmax.
Sampled: the standard rejection rule (``accept_drafts``: accept with
min(1, p/q), else sample max(p - q, 0); an n-gram proposal is a
deterministic draft, q one-hot), on the row's sampling distribution as
mlxcel's sampler forms it (top-p, min-p, top-k, temperature), so outputs
are distributed as without speculation. Each row's KV then holds exactly its kept tokens: the rows'
common rejected count is trimmed, the rest left where it lies as the row's gaps, masked out
(``gapped_cache.py``: no keys move), so ``tokens`` always equals what the KV holds.

Rows with logits processors (grammars, penalties, logit_bias, reasoning
budgets, min_tokens) never propose: they take the verify step's first
position exactly as a plain step. When no row proposes, the step is
mlx-lm's own, pipelined. A subclass, not a copy of mlx-lm's batch: the
prompt stage, joins and removals keep working on it unchanged.
Only the device thread uses it, and only for plain KV caches.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import BatchKVCache

from mlxcel.core.ngram import NgramIndex
from mlxcel.core.speculation_gate import SpeculationGate
from mlxcel.model.draft import DraftModel, DraftRequest, DraftRows
from mlxcel.model.gapped_cache import GappedBatchKVCache, keep_written
from mlxcel.model.sampling import sampling_probs
from mlxcel.types import SamplingParams

__all__ = ["SpeculationStats", "SpeculativeBatch", "accept_drafts", "install", "sampling_probs"]

# After a proposal with nothing accepted a row waits 1, 2, 4 .. up to this many steps before
# proposing again: a row whose text does not repeat stops paying for verify positions.
MAX_BACKOFF_STEPS = 16
# mlx-lm's batch cache, and the same with the gaps a verify step leaves (gapped_cache.py).
_PLAIN_BATCH_CACHES = (BatchKVCache, GappedBatchKVCache)


@attrs.define
class SpeculationStats:
    """Counters since start: what was proposed and accepted, and the verify steps run."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    # A draft model's catch-up: context tokens it prefilled for rows joining it, and the seconds that took.
    draft_prefill_tokens: int = 0
    draft_prefill_seconds: float = 0.0


def accept_drafts(probs: np.ndarray, drafts: Sequence[int], rng: np.random.Generator,
                  draft_probs: np.ndarray | None = None) -> tuple[int, int]:
    """The rejection rule: (how many of ``drafts`` are accepted, the next token).

    ``probs[j]`` is the target's sampling distribution p after the row and
    ``drafts[:j]`` (``len(drafts) + 1`` rows); ``draft_probs[j]`` the
    distribution q that ``drafts[j]`` was sampled from (None: a
    deterministic draft, q one-hot at the draft). Draft ``j`` is accepted
    with probability min(1, p(x) / q(x)); at the first rejection the next
    token is sampled from max(p - q, 0), renormalised (for a one-hot q: p
    without the rejected token); after all are accepted, from the last row
    of p (the bonus). Each emitted token is then distributed exactly as the
    target samples it.
    """
    for position, draft in enumerate(drafts):
        row = np.asarray(probs[position], dtype=np.float64)
        q = None if draft_probs is None else np.asarray(draft_probs[position], dtype=np.float64)
        if q is not None and len(q) != len(row):
            # A draft whose logits are wider or narrower: tokens past either end have probability 0 there.
            width = max(len(q), len(row))
            row, q = np.pad(row, (0, width - len(row))), np.pad(q, (0, width - len(q)))
        target = row[draft] if draft < len(row) else 0.0
        chance = target if q is None else min(1.0, target / q[draft]) if q[draft] > 0 else 1.0
        if rng.random() < chance:
            continue
        if q is None:
            residual = row.copy()
            residual[draft] = 0.0
        else:
            residual = np.maximum(row - q, 0.0)
            if residual.sum() <= 0:
                residual = row  # p == q up to rounding: a rejection had probability ~0
        return position, _sample(residual[:len(probs[position])], rng)
    return len(drafts), _sample(np.asarray(probs[len(drafts)], dtype=np.float64), rng)


def _sample(weights: np.ndarray, rng: np.random.Generator) -> int:
    cumulative = np.cumsum(weights)
    index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
    return min(index, len(weights) - 1)


@attrs.frozen(kw_only=True)
class _Plan:
    """A verify step's inputs: every row's token in flight, each row's proposal (empty: none)."""

    pending: list[int]
    proposals: list[list[int]]
    # When the tokens in flight were on the host (the plain pass in flight, if any, done).
    ready: float
    # Sampled rows of a draft model: the draft's distribution at each proposed token (row index: q).
    draft_probs: dict[int, Any] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class _Step:
    """A decode step, as the gate measures it (``SpeculativeBatch._measure``)."""

    rows: int
    verified: bool
    tokens: int
    # When its wall time starts: the step's start (plain), or when its inputs were ready (verify).
    began: float
    # A plain step right after a verify step (it returns the verify's last token, waiting for no pass).
    after_verify: bool = False


@attrs.define
class _Row:
    index: NgramIndex
    rng: np.random.Generator | None = None
    wait: int = 0
    failures: int = 0


class SpeculativeBatch(GenerationBatch):
    """mlx-lm's decode batch, verifying n-gram proposals per row (see the module's docstring)."""

    def configure(self, *, num_tokens: int, policy: Callable[[int], SamplingParams | None],
                  stats: SpeculationStats, draft: DraftModel | None = None) -> None:
        """``policy(uid)``: the row's sampling settings if it may speculate, else None.

        With ``draft`` the draft model proposes (``draft.py``), else the n-gram index.
        """
        self.num_speculative = num_tokens
        self.policy = policy
        self.stats = stats
        self._rows: dict[int, _Row] = {}
        self._draft = DraftRows(draft, stats) if draft is not None else None
        self._plan: _Plan | None = None
        self.gate = SpeculationGate()
        # The step before this one, for the gate's measurement.
        self._previous_step: _Step | None = None

    # --- mlx-lm's entry points -----------------------------------------------------------------

    def next(self) -> list[Any]:
        if not self.uids:
            self._previous_step = None
            return []
        began = time.perf_counter()
        self._measure(began)
        after_verify = self._previous_step is not None and self._previous_step.verified
        self._plan = self._proposals()
        if self._plan is None:
            responses = super().next()  # calls _step (model/batch_step.py), pipelined
            self._previous_step = _Step(rows=len(self.uids), verified=False, tokens=len(responses), began=began,
                                        after_verify=after_verify)
            return responses
        emitted, logprobs = self._verify(self._plan)
        self._previous_step = _Step(rows=len(self.uids), verified=True,
                                    tokens=sum(len(tokens) for tokens in emitted), began=self._plan.ready)
        self._plan = None
        return self._respond(emitted, logprobs)

    def _measure(self, now: float) -> None:
        """Give the gate the step before this one (``_Step``): its tokens over its pass's wall time.

        A plain step is pipelined: it returns the token the pass before it made, and its wall time (until
        this step) is about one pass. A verify step's pass makes ``1 + accepted`` tokens per row (the
        accepted ones, then the correction or bonus, which the next step returns); it is timed from when
        its inputs were ready (after waiting for the plain pass in flight, a plain step's cost) until this
        step. The plain step right after a verify step returns the verify's correction, not a token of its
        own pass: it is not counted (though on the CPU it took about a plain step's time, 109 against 136 ms
        at 8 rows, docs/benchmarks.md). Steps where rows joined or left are not counted.
        """
        previous = self._previous_step
        if previous is None or previous.rows != len(self.uids):
            return
        if not previous.verified and previous.after_verify:
            return
        self.gate.record(previous.rows, verified=previous.verified, tokens=previous.tokens,
                         seconds=now - previous.began)

    def filter(self, keep: list[int]) -> None:
        super().filter(keep)
        present = set(self.uids)
        for uid in [uid for uid in self._rows if uid not in present]:
            del self._rows[uid]
        if self._draft is not None:
            self._draft.retain(self.uids)

    # --- proposals -----------------------------------------------------------------------------

    def _row(self, uid: int, sampling: SamplingParams) -> _Row:
        row = self._rows.get(uid)
        if row is None:
            rng = None
            if sampling.temperature != 0:
                rng = np.random.default_rng(sampling.seed)
            row = self._rows[uid] = _Row(index=NgramIndex(), rng=rng)
        return row

    def _proposals(self) -> _Plan | None:
        """The token in flight of every row and each row's proposal, or None: no row proposes."""
        if self.num_speculative <= 0 or not all(type(cache) in _PLAIN_BATCH_CACHES for cache in self.prompt_cache):
            return None
        candidates: list[tuple[int, _Row, int, SamplingParams]] = []
        for e, uid in enumerate(self.uids):
            sampling = self.policy(uid)
            if sampling is None or (self.logits_processors and self.logits_processors[e]):
                continue
            # Tokens after the one in flight that this row may still emit.
            room = min(self.num_speculative, self.max_tokens[e] - self._num_tokens[e] - 1)
            if room <= 0:
                continue
            row = self._row(uid, sampling)
            if row.wait > 0:
                row.wait -= 1
                continue
            if self._draft is not None:
                candidates.append((e, row, room, sampling))
                continue
            row.index.catch_up(self.tokens[e])
            # Without the token in flight (not read yet, so the pipeline is kept): is a proposal likely?
            if row.index.propose(1):
                candidates.append((e, row, room, sampling))
        if not candidates:
            return None
        # A seeded sampled row's tokens depend on which steps verify: for its replies to repeat, that must
        # not depend on the gate's timings, so such a row verifies whenever it proposes.
        seeded = any(sampling.temperature != 0 and sampling.seed is not None for *_rest, sampling in candidates)
        if not seeded and not self.gate.should_verify(len(self.uids)):
            return None
        pending: list[int] = self._next_tokens.tolist()  # type: ignore[union-attr, assignment]
        ready = time.perf_counter()
        proposals: list[list[int]] = [[] for _ in self.uids]
        draft_probs: dict[int, Any] = {}
        if self._draft is not None:
            requests = [DraftRequest(uid=self.uids[e], room=room, sampling=sampling, rng=row.rng)
                        for e, row, room, sampling in candidates]
            drafted = self._draft.propose(self.uids, self.tokens, pending, requests)
            for e, _row, _room, _sampling in candidates:
                proposals[e], q = drafted[self.uids[e]]
                if q is not None:
                    draft_probs[e] = q
            return _Plan(pending=pending, proposals=proposals, ready=ready, draft_probs=draft_probs)
        for e, row, room, _sampling in candidates:
            proposals[e] = row.index.propose(room, pending[e])
        if not any(proposals):
            return None
        return _Plan(pending=pending, proposals=proposals, ready=ready)

    # --- the verify step -----------------------------------------------------------------------

    def _verify(self, plan: _Plan) -> tuple[list[list[int]], list[list[Any]]]:
        pending, proposals = plan.pending, plan.proposals
        width = 1 + max(len(proposal) for proposal in proposals)
        self._current_tokens = self._next_tokens  # type: ignore[assignment]
        self._current_logprobs = self._next_logprobs
        inputs: Any = self._current_tokens
        # mlx-lm annotates these as optional; a batch with rows has them.
        row_processors: Any = self.logits_processors
        # Shorter rows are padded with their own token: those positions are trimmed below.
        matrix = [[pending[e], *proposal] + [pending[e]] * (width - 1 - len(proposal))
                  for e, proposal in enumerate(proposals)]
        logits = self.model(mx.array(matrix, dtype=mx.uint32), cache=self.prompt_cache)

        # The first position of rows that did not propose: exactly mlx-lm's step.
        plain = [e for e, proposal in enumerate(proposals) if not proposal]
        token_context = []
        first_logprobs: Any = None
        sampled_first: dict[int, Any] = {}
        if plain:
            first = logits[:, 0, :]
            if any(row_processors):
                processed = []
                for e in range(len(self.uids)):
                    row_logits = first[e:e + 1]
                    processors = row_processors[e] or ()
                    if processors:
                        context = self._token_context[e].update_and_fetch(inputs[e:e + 1])  # type: ignore[no-untyped-call]
                        token_context.append(context)
                        for processor in processors:
                            row_logits = processor(context, row_logits)
                    processed.append(row_logits)
                first = mx.concatenate(processed, axis=0)
            first_logprobs = first - mx.logsumexp(first, axis=-1, keepdims=True)
            for e in plain:
                sampler = (self.samplers[e] if self.samplers else None) or self.fallback_sampler
                sampled_first[e] = sampler(first_logprobs[e:e + 1])

        # Greedy rows need only the argmax of each position (the logprobs of the tokens kept are formed
        # after, lazily); sampled rows their sampling distributions over the positions they proposed.
        greedy: dict[int, Any] = {}
        distributions: dict[int, Any] = {}
        row_logprobs: dict[int, Any] = {}
        for e, proposal in enumerate(proposals):
            if not proposal:
                continue
            sampling = self.policy(self.uids[e])
            assert sampling is not None, "a proposing row has a policy"
            if sampling.temperature == 0:
                greedy[e] = mx.argmax(logits[e, :len(proposal) + 1], axis=-1)
            else:
                positions = logits[e, :len(proposal) + 1]
                row_logprobs[e] = positions - mx.logsumexp(positions, axis=-1, keepdims=True)
                distributions[e] = sampling_probs(row_logprobs[e], sampling)
        # The rows' logprobs stay lazy (model/batch_step.py): evaluated where a request reads them.
        mx.eval(inputs, first_logprobs, list(sampled_first.values()),
                list(greedy.values()), list(distributions.values()), list(row_logprobs.values()), token_context)
        accepted_by_uid: dict[int, int] = {}

        emitted: list[list[int]] = []
        emitted_logprobs: list[list[Any]] = []
        next_tokens: list[int] = []
        next_logprobs: list[Any] = []
        kept: list[int] = []
        for e, proposal in enumerate(proposals):
            accepted = 0
            if not proposal:
                next_tokens.append(int(sampled_first[e].item()))
                next_logprobs.append(first_logprobs[e])
                emitted_logprobs.append([self._current_logprobs[e]])
            else:
                if e in greedy:
                    targets = greedy[e].tolist()
                    while accepted < len(proposal) and proposal[accepted] == targets[accepted]:
                        accepted += 1
                    token = targets[accepted]
                else:
                    row = self._rows[self.uids[e]]
                    assert row.rng is not None
                    q = plan.draft_probs.get(e)
                    accepted, token = accept_drafts(np.asarray(distributions[e]), proposal, row.rng,
                                                    None if q is None else np.asarray(q))
                next_tokens.append(token)
                kept_logprobs = row_logprobs.get(e)
                if kept_logprobs is None:
                    positions = logits[e, :accepted + 1]
                    kept_logprobs = positions - mx.logsumexp(positions, axis=-1, keepdims=True)
                next_logprobs.append(kept_logprobs[accepted])
                emitted_logprobs.append([self._current_logprobs[e], *(kept_logprobs[j] for j in range(accepted))])
                self._account(self.uids[e], len(proposal), accepted)
                accepted_by_uid[self.uids[e]] = accepted
            emitted.append([pending[e], *proposal[:accepted]])
            kept.append(1 + accepted)
        self.stats.verify_steps += 1
        self._keep(width, kept)
        if self._draft is not None:
            self._draft.settle(accepted_by_uid)
        for tokens, new in zip(self.tokens, emitted, strict=True):
            tokens.extend(new)
        self._next_tokens = mx.array(next_tokens, dtype=mx.uint32)
        # Not queued: a greedy row's kept positions are normalized over the vocabulary only if a request reads
        # them (5.6 ms for 5 positions of a 49k vocabulary on the CPU).
        self._next_logprobs = next_logprobs
        return emitted, emitted_logprobs

    def _account(self, uid: int, proposed: int, accepted: int) -> None:
        self.stats.proposed_tokens += proposed
        self.stats.accepted_tokens += accepted
        row = self._rows[uid]
        if accepted == 0:
            row.failures += 1
            row.wait = min(MAX_BACKOFF_STEPS, 1 << (row.failures - 1))
        else:
            row.failures = 0

    def _keep(self, width: int, kept: list[int]) -> None:
        """Each row's KV keeps its first ``kept`` of the ``width`` positions just written."""
        keep_written(self.prompt_cache, width, kept)

    def _respond(self, emitted: list[list[int]], logprobs: list[list[Any]]) -> list[Any]:
        """mlx-lm's ``next`` over several tokens per row: one response per token, none after a row's end."""
        keep = []
        responses = []
        for i, (tokens, row_logprobs) in enumerate(zip(emitted, logprobs, strict=True)):
            finish_reason = None
            for j, token in enumerate(tokens):
                self._num_tokens[i] += 1
                if self._num_tokens[i] >= self.max_tokens[i]:
                    finish_reason = "length"
                if self._matchers[i].advance(token):
                    finish_reason = "stop"
                if finish_reason is None:
                    responses.append(self.Response(uid=self.uids[i], token=token, logprobs=row_logprobs[j],
                                                   finish_reason=None, prompt_cache=None, all_tokens=None))
                    continue
                # The row ends here: its KV and tokens lose what came after this token.
                cut = len(tokens) - 1 - j
                caches = self.extract_cache(i)
                all_tokens = self.tokens[i]
                if cut:
                    for cache in caches:
                        cache.trim(cut)
                    all_tokens = all_tokens[:-cut]
                responses.append(self.Response(uid=self.uids[i], token=token, logprobs=row_logprobs[j],
                                               finish_reason=finish_reason, prompt_cache=caches,
                                               all_tokens=all_tokens))
                break
            if finish_reason is None:
                keep.append(i)
        if len(keep) < len(self.uids):
            self.filter(keep)
        return responses


def install(generator: Any, *, num_tokens: int, policy: Callable[[int], SamplingParams | None],
            stats: SpeculationStats, draft: DraftModel | None = None) -> SpeculativeBatch:
    """Give a fresh ``BatchGenerator`` a speculative decode batch (before any sequence enters it)."""
    current = generator._generation_batch
    if len(current):
        raise RuntimeError("install speculation before any sequence decodes")
    batch = SpeculativeBatch.empty(generator.model, generator.sampler)
    batch.configure(num_tokens=num_tokens, policy=policy, stats=stats, draft=draft)
    generator._generation_batch = batch
    return batch
