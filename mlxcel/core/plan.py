"""The values that cross between the scheduling core and the device: plans, results, handles.

A ``StepPlan`` says exactly what the device runs in one step, in order; a
``StepResult`` says what came of it. Both are plain values: the core decides
everything the plan holds, and the device only carries it out.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs

from mlxcel.types import SamplingParams


class KVHandle(Protocol):
    """A stored prefix's KV as the core sees it: sizes, never arrays (model/kv.py's DetachedKV)."""

    @property
    def length(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def can_adopt(self, num_tokens: int) -> bool: ...


# The default of what one step's shared pass of hits may keep in all (tokens of stored prefix adopted;
# Capabilities.hit_kept_tokens, --max-step-hit-tokens): the device copies each hit's prefix into the pass's
# buffer, and joining a running batch gathers them once more, so a step's hits briefly hold two to three
# times their KV. At 16 hits of 8k tokens (8B) that ran the H200 out of memory beside 64 decoding 8k rows;
# 32k tokens is the four such hits a step held before hits shared a pass (65,536 ran there since).
SHARED_HIT_KEPT_TOKENS = 32768


@attrs.frozen(kw_only=True)
class Capabilities:
    """What the core must know of the device and the model's shape, given once at start-up.

    Device facts only: how the server caches is the ``CachePlan`` (core/cache_plan.py).
    """

    prefill_step_size: int
    context_size: int
    max_batch_size: int = 64
    # Starts run in bucketed shapes and long prompts are prefilled alone (CUDA, plain KV caches).
    bucket_starts: bool = False
    # Stored prefix tokens one step's cache hits may adopt in all (--max-step-hit-tokens).
    hit_kept_tokens: int = SHARED_HIT_KEPT_TOKENS


# --- the disk tier's part of a step (vLLM's KV-connector metadata rides its scheduler output the same way) ---


@attrs.frozen(kw_only=True)
class DiskRead:
    """KV the device reads from the disk tier before the step's starts, for the start that carries it.

    ``source`` is opaque here: the disk tier's description of the files (``disk/index.py``'s
    ``DiskPlan`` for a prefix, ``SnapshotName`` for a session snapshot).
    """

    source: Any = attrs.field(repr=False)
    # Tokens it covers when read whole: the start was placed as a hit of this length.
    num_tokens: int
    # A session snapshot (restored) rather than a KV prefix (adopted).
    snapshot: bool = False
    # Memory's match: a prefix read keeps its first rows; it stands if the read gives nothing (None: no match).
    memory: Any = attrs.field(default=None, repr=False)
    memory_tokens: int = 0
    # The prefix was retained when written: read back whole, it is pinned again for this long.
    retain_seconds: float = 0.0


@attrs.frozen(kw_only=True)
class DiskWrite:
    """A stored payload the device writes to the disk tier behind its steps: KV pieces or one snapshot."""

    payload: Any = attrs.field(repr=False)
    # disk/index.py's PieceSpec of each piece not on disk yet (a KV prefix).
    pieces: tuple[Any, ...] = attrs.field(default=(), repr=False)
    # disk/index.py's SnapshotName (a session snapshot); None for pieces.
    snapshot: Any = None
    # A retained prompt: ahead of the queue.
    urgent: bool = False


@attrs.frozen(kw_only=True)
class DiskReadDone:
    """What a start's disk read gave: the KV (None: nothing usable) and whether the start ran on it."""

    sequence_id: int
    payload: Any = attrs.field(default=None, repr=False)
    num_tokens: int = 0
    # False: the read gave less than the start was placed for (or nothing); the start did not run.
    started: bool = False


# --- what a step runs ----------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Admission:
    """What every start of a sequence carries: its tokens, where its cached part comes from, how to sample."""

    sequence_id: int
    # Tokens not yet in any cache; never empty.
    prompt_tokens: tuple[int, ...] = attrs.field(repr=False)
    # Tokens covered by ``adopted`` (or ``restore``).
    cached_tokens: tuple[int, ...] = attrs.field(repr=False)
    adopted: KVHandle | None = attrs.field(default=None, repr=False)
    # A session snapshot to resume from (snapshot families), instead of ``adopted``.
    restore: Any = attrs.field(default=None, repr=False)
    sampling: SamplingParams
    max_tokens: int
    # Detach the KV at a natural finish so it can be donated.
    donate_on_finish: bool = False
    # Also detach the prompt's KV as soon as its prefill ends, for requests waiting on the same prefix.
    donate_prompt: bool = False
    # The images whose features the prompt's image tokens take (mlxcel.vision.processing.VisionInputs):
    # set only on a cold start, which runs the vision tower over the whole prompt in one direct start.
    vision: Any = attrs.field(default=None, repr=False)
    # The cached tokens come from the disk tier: the device reads them first, into ``adopted`` or ``restore``.
    disk_read: DiskRead | None = attrs.field(default=None, repr=False)


@attrs.frozen(kw_only=True)
class StartDirect(Admission):
    """Prefill on the sequence's own cache and sample its first token in this step.

    The first ``kept`` of ``cached_tokens`` come from ``adopted`` (or, with
    ``from_alone``, from the sequence's own prefill alone); the rest run again
    with ``prompt_tokens``, followed by ``padding`` throwaway tokens.
    """

    kept: int = 0
    padding: int = 0
    from_alone: bool = False


@attrs.frozen(kw_only=True)
class SnapshotPoint:
    """Take a whole-state snapshot after ``after`` of a start's ``prompt_tokens``.

    ``checkpoint``: a branch point other conversations resume from (the end of
    the shared system prompt, a chunk boundary), kept when the conversation
    moves on; otherwise the conversation's tip (history boundary, warm-up).
    """

    after: int
    checkpoint: bool = False


@attrs.frozen(kw_only=True)
class InsertBatch(Admission):
    """Prefill in the batch, a chunk per step, then decode there."""

    # Whole-state snapshots to take on the way, ascending (snapshot families).
    snapshots: tuple[SnapshotPoint, ...] = ()
    # A background warm-up: prefill, snapshot at the end, never generate.
    warm: bool = False


@attrs.frozen(kw_only=True)
class StartAlone:
    """Begin a prompt prefilled outside the batch: its cache holds the first ``kept`` tokens of ``adopted``."""

    sequence_id: int
    tokens: tuple[int, ...] = attrs.field(repr=False)
    adopted: KVHandle | None = attrs.field(default=None, repr=False)
    kept: int = 0
    # The LoRA adapter scales its chunks run under (SamplingParams.adapter_scales).
    adapter_scales: tuple[float, ...] = ()
    # ``adopted`` comes from the disk tier: read before the step's starts.
    disk_read: DiskRead | None = attrs.field(default=None, repr=False)


@attrs.frozen(kw_only=True)
class AloneChunk:
    """Run tokens ``[start, end)`` of a prompt prefilled alone; ``last``: detach them for its direct start."""

    sequence_id: int
    start: int
    end: int
    last: bool


@attrs.frozen(kw_only=True)
class Removal:
    sequence_id: int
    # Detach its KV for donation (a healthy finish the device did not see, e.g. a stop string).
    donate: bool


Start = StartDirect | InsertBatch | StartAlone


@attrs.frozen(kw_only=True)
class StepPlan:
    """One device step, carried out in this order."""

    removals: tuple[Removal, ...] = ()
    starts: tuple[Start, ...] = ()
    alone_chunk: AloneChunk | None = None
    # The direct start of the prompt whose last chunk alone just ran.
    alone_rest: StartDirect | None = None
    # Run the batch's prefill chunk and decode step (False: held back for waiting starts, or empty).
    run_batch: bool = False
    # Stored payloads to write to the disk tier, behind this step's forward work.
    disk_writes: tuple[DiskWrite, ...] = attrs.field(default=(), repr=False)

    @property
    def only_writes(self) -> bool:
        """Nothing to run, only disk writes to queue: not a step (an idle device gets such plans)."""
        return bool(self.disk_writes) and not (self.removals or self.starts or self.alone_chunk
                                               or self.alone_rest or self.run_batch)

    @property
    def direct_starts(self) -> tuple[StartDirect, ...]:
        started = tuple(start for start in self.starts if isinstance(start, StartDirect))
        return started + ((self.alone_rest,) if self.alone_rest is not None else ())


# --- what came of it -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SampledToken:
    sequence_id: int
    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None


@attrs.frozen(kw_only=True)
class DetachedSequence:
    """A sequence's KV, detached from the device's caches, ready to donate."""

    sequence_id: int
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int
    # False: the prompt's KV, detached when its prefill ended; the sequence runs on.
    final: bool = True
    # A whole-state session snapshot (snapshot families) rather than a prefix KV set.
    snapshot: bool = False
    # The snapshot is a checkpoint (see SnapshotPoint).
    checkpoint: bool = False


@attrs.frozen(kw_only=True)
class GrammarFailure:
    """A constrained sequence whose grammar could not go on: the device ends it, the core fails its request."""

    sequence_id: int
    # True: its mask was not ready within the step's bound (--grammar-mask-timeout-ms); False: the
    # matcher failed (one of llguidance's limits, or a dead end).
    timed_out: bool
    reason: str


@attrs.frozen(kw_only=True)
class GrammarWork:
    """What grammar-constrained decoding cost the device in one step."""

    matchers_built: int = 0
    build_seconds: float = 0.0
    masks: int = 0
    mask_seconds: float = 0.0
    failures: tuple[GrammarFailure, ...] = ()


@attrs.frozen(kw_only=True)
class SpeculationWork:
    """What speculative decoding did in one step: verify passes, tokens proposed, tokens accepted."""

    verify_steps: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0


@attrs.frozen(kw_only=True)
class StepResult:
    step_number: int
    sampled: tuple[SampledToken, ...] = ()
    detached: tuple[DetachedSequence, ...] = ()
    decode_batch_size: int = 0
    prefill_tokens: int = 0
    # Sequences that were prefilling (not decoding) during this step.
    prefilling: tuple[int, ...] = ()
    # Sequences whose prompt prefill ended in this step.
    prompts_done: tuple[int, ...] = ()
    # A step that raised: every sequence on the device is lost and must be failed.
    error: str | None = None
    out_of_memory: bool = False
    failed_sequences: tuple[int, ...] = ()
    # Starts whose snapshot would not restore: (sequence id, reason); they ran cold.
    restore_failures: tuple[tuple[int, str], ...] = ()
    # Warm-up sequences that finished (their snapshot is in ``detached``).
    warmed: tuple[int, ...] = ()
    # None: no grammar work this step.
    grammar: GrammarWork | None = None
    # The disk reads of this step's starts, each start's outcome.
    disk_reads: tuple[DiskReadDone, ...] = ()
    # None: no verify step ran (mlxcel/model/speculation.py).
    speculation: SpeculationWork | None = None
