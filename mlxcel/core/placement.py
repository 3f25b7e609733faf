"""Placement arithmetic: where a decided start runs and in which shapes, from the device's facts alone.

The scheduling core decides what starts and when; this module only computes,
for a start it has decided: whether it runs directly, alone or in the batch,
how much of an adopted prefix it keeps, how many throwaway tokens pad it,
what it costs of a step's token budget, where a long prompt's chunks end, and
where a snapshot family's prefill stops for snapshots. Pure: no state beyond
the one step's budget, no Trio, no MLX.
"""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.core.plan import SHARED_HIT_KEPT_TOKENS, Admission, Capabilities, InsertBatch, SnapshotPoint, StartDirect

# Shape buckets of starts with ``bucket_starts`` (CUDA): the adopted prefix is
# cut to a multiple of START_PREFIX_ALIGN tokens and the tokens run are padded
# to a multiple of START_QUERY_BUCKET, so key lengths are multiples of 128 too.
# A 256-token cut gave the same shapes with twice the tokens run again: 8B hits
# of random lengths, median 31.2 vs 23.0 ms once planned (benchmarks/start_shapes.py).
START_PREFIX_ALIGN = 128
START_QUERY_BUCKET = 128
# A cold start's rows (nothing kept before them) pad to the first of these that holds them, then to
# multiples of START_QUERY_BUCKET: a wave of 40-token prompts ran 128-position rows, 3x its tokens.
COLD_QUERY_BUCKETS = (32, 64)
# With bucket_starts (CUDA), what a direct start costs beyond its own tokens, in tokens of
# the per-step budget: each is a forward pass of its own (the weights are read again,
# attention runs over its whole adopted prefix). Counting only its tokens put 12 hits of
# 154 new tokens on an 8k prefix into one 0.49 s step on the H200 (8B), so the first
# tokens of all twelve waited for the slowest; at 256, four go per step.
DIRECT_START_TOKENS = 256


@attrs.frozen(kw_only=True)
class Pending(Admission):
    """A start decided but not yet placed; a direct start over a step's budget waits as this."""

    snapshots: tuple[SnapshotPoint, ...] = ()
    warm: bool = False
    from_alone: bool = False
    # Past the last image token of an adopted prefix: a bucketed start never cuts it back below this.
    image_end: int = 0


@attrs.define(kw_only=True)
class AlonePrefill:
    """A long prompt prefilled outside the batch: its whole tokens and how many are done."""

    pending: Pending
    tokens: tuple[int, ...]
    done: int


def admission_fields(pending: Pending) -> dict[str, Any]:
    return {field.name: getattr(pending, field.name) for field in attrs.fields(Admission)}


def starts_cold(start: StartDirect) -> bool:
    """A direct start from no stored state, of a text prompt: the device runs such starts in one pass."""
    return start.kept == 0 and shares_a_pass(start)


def shares_a_pass(start: StartDirect) -> bool:
    """A direct start of a text prompt from nothing stored or from a stored prefix in memory: the device runs
    such starts that keep the same prefix length in one forward pass (mlxcel/model/executor.py)."""
    return (start.restore is None and not start.from_alone and start.vision is None and start.disk_read is None
            and (start.kept == 0 or start.adopted is not None))


def adopts(pending: Pending) -> bool:
    """Its cached tokens come from a stored KV prefix (in memory, or read from disk first), which may be cut."""
    return pending.adopted is not None or (pending.disk_read is not None and not pending.disk_read.snapshot)


class Placement:
    """The shapes of starts on one device (its ``Capabilities``)."""

    def __init__(self, capabilities: Capabilities) -> None:
        self.capabilities = capabilities

    def starts_directly(self, pending: Pending) -> bool:
        # A prompt with images runs its vision tower and its prefill in one direct start, whatever its length.
        return (not pending.snapshots and not pending.warm
                and (len(pending.prompt_tokens) <= self.capabilities.prefill_step_size or pending.vision is not None))

    def prefills_alone(self, pending: Pending) -> bool:
        """Longer than one chunk, with buckets: prefilled outside the batch, a chunk per step.

        With CUDA (where starts are bucketed), an 8k-token prefill through the
        batch took 2.4-2.6x (8B) and 4-5x (1B) the time it takes on a plain
        cache (benchmarks/start_shapes.py --cold): the batch cache hands
        attention a mask array where a plain one gets the causal kernel. The
        chunks end on multiples of the chunk size and the last one on a
        multiple of START_PREFIX_ALIGN, so their shapes repeat; the last
        1-START_PREFIX_ALIGN tokens then start directly like a hit's new turn.
        """
        step = self.capabilities.prefill_step_size
        return (self.capabilities.bucket_starts and pending.restore is None and pending.vision is None
                and (pending.disk_read is None or not pending.disk_read.snapshot)
                and not pending.snapshots and not pending.warm
                and len(pending.prompt_tokens) > step >= START_PREFIX_ALIGN)

    def cut(self, cached: int) -> int:
        """The adopted prefix a bucketed start keeps (the cut tokens run again)."""
        return cached - cached % START_PREFIX_ALIGN if self.capabilities.bucket_starts else cached

    def kept(self, pending: Pending, cached: int) -> int:
        """``cut``, except that image rows never run again as text: such a start keeps its whole prefix."""
        cut = self.cut(cached)
        return cached if cut < pending.image_end else cut

    def padding(self, kept: int, length: int) -> int:
        """Throwaway tokens after a bucketed start's ``length`` tokens (0: none).

        MLX's CUDA backend builds a cuDNN attention plan for every new pair of
        query and key lengths, 0.06-0.16 s each on the H200 (docs/benchmarks.md),
        and a hit's lengths are nearly always new. Causal attention keeps the
        padding out of the real tokens' results, and the cache drops it after.
        """
        if not self.capabilities.bucket_starts:
            return 0
        fine = [bucket for bucket in COLD_QUERY_BUCKETS if kept == 0 and length <= bucket]
        padding = fine[0] - length if fine else -length % START_QUERY_BUCKET
        if kept + length + padding > self.capabilities.context_size:
            return 0
        return padding

    def direct(self, pending: Pending) -> StartDirect:
        cached = len(pending.cached_tokens)
        # A restored snapshot covers every cached token; an adopted prefix may be cut.
        kept = self.kept(pending, cached) if (adopts(pending) or pending.from_alone) else cached
        return StartDirect(
            **{**admission_fields(pending), "adopted": pending.adopted if kept else None},
            kept=kept, padding=self.padding(kept, cached - kept + len(pending.prompt_tokens)),
            from_alone=pending.from_alone,
        )

    def alone(self, pending: Pending) -> AlonePrefill:
        """A long prompt to prefill alone: it keeps the cut of an adopted prefix and runs the rest in chunks."""
        kept = self.kept(pending, len(pending.cached_tokens)) if adopts(pending) else 0
        return AlonePrefill(pending=pending, tokens=pending.cached_tokens + pending.prompt_tokens, done=kept)

    def alone_chunk_end(self, prefill: AlonePrefill) -> tuple[int, bool]:
        """Where the next chunk of a prompt prefilled alone ends, and whether it is the last.

        Chunks end on multiples of the chunk size, the last on a multiple of
        START_PREFIX_ALIGN at least one token short of the prompt's end.
        """
        step = self.capabilities.prefill_step_size
        body_end = (len(prefill.tokens) - 1) // START_PREFIX_ALIGN * START_PREFIX_ALIGN
        end = min((prefill.done // step + 1) * step, body_end)
        return end, end == body_end

    def alone_rest(self, prefill: AlonePrefill, end: int) -> Pending:
        """What is left of a prompt prefilled alone after its last chunk: a direct start from its own KV."""
        return attrs.evolve(prefill.pending, cached_tokens=prefill.tokens[:end], prompt_tokens=prefill.tokens[end:],
                            adopted=None, disk_read=None, from_alone=True)

    def insert(self, pending: Pending) -> InsertBatch:
        return InsertBatch(**admission_fields(pending), snapshots=pending.snapshots, warm=pending.warm)

    def rows_now(self, count: int) -> int:
        """How many of ``count`` direct starts that would share one forward pass run in this step.

        With bucket_starts the device pads a shared pass's rows to a power of
        two, and a wave's pass is bound by compute: 40-44 cold starts ran as
        64 rows in 134-157 ms on the H200 (8B), 20-26 as 32 rows in 59-75 ms.
        The largest power of two that fits runs now and the rest waits a
        step: no padded rows, and half the first tokens come in half the time.
        """
        if not self.capabilities.bucket_starts or count < 1:
            return count
        return 1 << (count.bit_length() - 1)

    def budget(self) -> DirectBudget:
        """One step's token budget of direct starts."""
        return DirectBudget(step=self.capabilities.prefill_step_size,
                            charge=DIRECT_START_TOKENS if self.capabilities.bucket_starts else 0,
                            kept_limit=self.capabilities.hit_kept_tokens)


@attrs.define(kw_only=True)
class DirectBudget:
    """What a step's direct starts cost: a chunk's worth of tokens, plus a charge per start on CUDA.

    The first direct start always fits; a later one that goes over waits.
    """

    step: int
    # Tokens a start costs beyond its own (bucket_starts only): its own forward pass.
    charge: int
    num_tokens: int = 0
    has_direct: bool = False
    # The kept prefix lengths whose shared pass is charged already (0: the cold starts' pass).
    charged: set[int] = attrs.Factory(set)
    kept_tokens: int = 0
    # Stored prefix tokens the step's hits may adopt in all (the first start always goes).
    kept_limit: int = SHARED_HIT_KEPT_TOKENS

    def take(self, start: StartDirect) -> bool:
        """Count ``start``; False: over the budget, it waits (its cost still counts against the step)."""
        shared = shares_a_pass(start)
        cost = len(start.cached_tokens) + len(start.prompt_tokens) if starts_cold(start) else len(start.prompt_tokens)
        # Starts that keep the same prefix length share one forward pass on the device: charged once.
        self.num_tokens += cost + (0 if shared and start.kept in self.charged else self.charge)
        self.kept_tokens += start.kept
        if self.has_direct and (self.num_tokens > self.step or self.kept_tokens > self.kept_limit):
            return False
        self.has_direct = True
        if shared:
            self.charged.add(start.kept)
        return True

    def take_rest(self, num_tokens: int) -> bool:
        """Count the rest of a prompt prefilled alone; False: over the budget, it waits (and costs nothing)."""
        if self.has_direct and self.num_tokens + num_tokens + self.charge > self.step:
            return False
        self.num_tokens += num_tokens + self.charge
        return True


def snapshot_points(
    *, prompt_len: int, matched: int, history_boundary: int | None, shared_prefix: int | None,
    checkpoint_spacing: int, max_chunk_checkpoints: int, sliding_window: int | None,
) -> tuple[SnapshotPoint, ...]:
    """Where a snapshot family's prefill stops for snapshots, past what it resumed from.

    - the end of the shared prefix (system prompt and tools): a checkpoint
      every conversation with that prefix resumes from;
    - the history boundary: the conversation's tip, which its next turn extends;
    - chunk boundaries of a long prompt, at multiples of the spacing, the
      last few before the boundary: checkpoints, so a prompt that diverges
      late re-prefills at most one chunk;
    - sliding-window families: a checkpoint at the window's length, taken
      before the sliding layers wrap, so it can be cut back (partial restore).
    Each point is a snapshot's bytes: recurrent state is a constant per
    layer, attention KV grows with the position (docs/prompt-cache.md).
    """
    points: dict[int, bool] = {}
    boundary = history_boundary
    if boundary is not None and matched < boundary < prompt_len:
        points[boundary] = False
    if shared_prefix is not None and matched < shared_prefix < prompt_len:
        points[shared_prefix] = True
    end = boundary if boundary is not None and boundary < prompt_len else prompt_len - 1
    spacing = checkpoint_spacing
    if spacing > 0 and max_chunk_checkpoints > 0:
        edges = range((matched // spacing + 1) * spacing, end, spacing)
        for edge in list(edges)[-max_chunk_checkpoints:]:
            points[edge] = True
    if sliding_window is not None and matched < sliding_window < end:
        points[sliding_window] = True
    return tuple(SnapshotPoint(after=position - matched, checkpoint=points[position])
                 for position in sorted(points))
