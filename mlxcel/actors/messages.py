"""Every message the actors exchange.

Commands are verbs, replies and events are nouns or past tense. A message
that wants an answer carries its own one-shot ``reply_to`` channel. MLX arrays
never travel here except inside opaque payload handles that only the device
actor opens.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from mlxcel.cache.key import CacheContext
from mlxcel.types import ChatRequest, CompletionRequest, Delta, InvalidRequest, SamplingParams

# --- engine handle -> router ---------------------------------------------------


@attrs.frozen(kw_only=True)
class RouteRequest:
    """A validated API request; the router answers on ``reply_to`` with stream events."""

    request: ChatRequest | CompletionRequest
    request_id: str
    events: trio.MemorySendChannel[StreamEvent] = attrs.field(repr=False)


# --- router -> scheduler ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class SubmitRequest:
    request_id: str
    prompt_tokens: tuple[int, ...] = attrs.field(repr=False)
    sampling: SamplingParams
    max_tokens: int
    # None: this request neither reads nor donates cache entries.
    cache_context: CacheContext | None
    events: trio.MemorySendChannel[StreamEvent] = attrs.field(repr=False)
    # Tokens of the rendered conversation history before the newest user message.
    history_boundary: int | None = None
    # The chat request itself, so the warmer can render the next turn's history.
    chat: ChatRequest | None = attrs.field(default=None, repr=False)
    # More requests were already queued at the router behind this one.
    more_pending: bool = False


@attrs.frozen(kw_only=True)
class WarmSession:
    """Extend the session's snapshot to cover ``tokens`` (the next turn's history), when idle."""

    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class ReleasePayloads:
    """Evicted or unstored payloads, to be freed on the device thread (cache store -> scheduler)."""

    payloads: tuple[Any, ...] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class CancelRequest:
    """The client went away or gave up: free the sequence, donate nothing."""

    request_id: str


@attrs.frozen(kw_only=True)
class GetSchedulerStats:
    reply_to: trio.MemorySendChannel[SchedulerStats] = attrs.field(repr=False)


# --- scheduler -> client stream ----------------------------------------------------


@attrs.frozen(kw_only=True)
class RequestFailed:
    """The request ended with an error; ``error`` is what the client sees."""

    error: InvalidRequest


StreamEvent = Delta | RequestFailed


# --- scheduler <-> device -----------------------------------------------------------


@attrs.frozen(kw_only=True)
class AdmitSequence:
    sequence_id: int
    # Tokens not yet in the KV cache; never empty.
    prompt_tokens: tuple[int, ...] = attrs.field(repr=False)
    # Tokens already covered by the adopted payload.
    cached_tokens: tuple[int, ...] = attrs.field(repr=False)
    adopted: Any = attrs.field(default=None, repr=False)
    sampling: SamplingParams
    max_tokens: int
    # Detach the KV at a natural finish so the scheduler can donate it.
    donate_on_finish: bool = False
    # Also detach the prompt's KV as soon as its prefill ends, so requests
    # waiting on the same prefix can adopt it before this one finishes.
    donate_prompt: bool = False
    # A session snapshot to resume from (snapshot families), instead of ``adopted``.
    restore: Any = attrs.field(default=None, repr=False)
    # Take a whole-state snapshot after this many of ``prompt_tokens`` (the history boundary).
    snapshot_after: int | None = None
    # A background warm-up: prefill only, snapshot at the end, never generate.
    warm: bool = False


@attrs.frozen(kw_only=True)
class RemoveSequence:
    sequence_id: int
    donate: bool


@attrs.frozen(kw_only=True)
class RunStep:
    admit: tuple[AdmitSequence, ...] = ()
    remove: tuple[RemoveSequence, ...] = ()
    # Payloads the cache stores let go of: dropped with this message, on the device thread.
    release: tuple[Any, ...] = attrs.field(default=(), repr=False)
    reply_to: trio.MemorySendChannel[StepDone] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class SampledToken:
    sequence_id: int
    token: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: str | None = None


@attrs.frozen(kw_only=True)
class DetachedSequence:
    """A finished sequence's KV, detached from the batch, ready to donate."""

    sequence_id: int
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int
    # False: the prompt's KV, detached when its prefill ended; the sequence runs on.
    final: bool = True
    # A whole-state session snapshot (snapshot families) rather than a prefix KV set.
    snapshot: bool = False


@attrs.frozen(kw_only=True)
class StepDone:
    step_number: int
    sampled: tuple[SampledToken, ...] = ()
    detached: tuple[DetachedSequence, ...] = ()
    decode_batch_size: int = 0
    prefill_tokens: int = 0
    # Sequences that were prefilling (not decoding) during this step.
    prefilling: tuple[int, ...] = ()
    # Sequences whose prompt prefill ended in this step.
    prompts_done: tuple[int, ...] = ()
    # A step that raised: every sequence in it is lost and must be failed.
    error: str | None = None
    out_of_memory: bool = False
    failed_sequences: tuple[int, ...] = ()
    # Admissions whose snapshot would not restore: (sequence id, reason); they ran cold.
    restore_failures: tuple[tuple[int, str], ...] = ()
    # Warm-up sequences that finished (their snapshot is in ``detached``).
    warmed: tuple[int, ...] = ()


DeviceMsg = RunStep


# --- scheduler <-> cache store ---------------------------------------------------------


@attrs.frozen(kw_only=True)
class LookupPrefix:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    max_len: int
    # False: a peek that neither counts as a hit or miss nor refreshes recency.
    record: bool = True
    reply_to: trio.MemorySendChannel[PrefixFound | PrefixMissing] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class PrefixFound:
    matched_len: int
    payload: Any = attrs.field(repr=False)
    cross_session: bool
    partial: bool


@attrs.frozen(kw_only=True)
class PrefixMissing:
    pass


@attrs.frozen(kw_only=True)
class DonateSequence:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int
    # Leading tokens that were the request's prompt (the rest it generated).
    prompt_len: int | None = None


@attrs.frozen(kw_only=True)
class LookupSnapshot:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    # False: a peek for the warmer that counts nothing.
    record: bool = True
    reply_to: trio.MemorySendChannel[SnapshotFound | SnapshotMissing] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class SnapshotFound:
    num_tokens: int
    payload: Any = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class SnapshotMissing:
    # None: no snapshot for the session; else why the stored one was refused.
    refusal: str | None = None


@attrs.frozen(kw_only=True)
class DonateSnapshot:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int


@attrs.frozen(kw_only=True)
class SnapshotRestoreFailed:
    """The device could not restore a found snapshot; counted as an incompatible refusal."""

    reason: str


@attrs.frozen(kw_only=True)
class ShedCache:
    """The device ran out of memory: drop the least recently used half of both stores."""


@attrs.frozen(kw_only=True)
class GetCacheStats:
    reply_to: trio.MemorySendChannel[dict[str, Any]] = attrs.field(repr=False)


@attrs.frozen(kw_only=True)
class ResetCache:
    reply_to: trio.MemorySendChannel[dict[str, int]] = attrs.field(repr=False)


CacheStoreMsg = (
    LookupPrefix | DonateSequence | LookupSnapshot | DonateSnapshot | SnapshotRestoreFailed | ShedCache
    | GetCacheStats | ResetCache
)


# --- anyone -> metrics ------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CacheLookedUp:
    hit: bool
    tokens_reused: int = 0


@attrs.frozen(kw_only=True)
class CacheStoreChanged:
    nbytes: int
    entries: int
    # Cumulative evictions by reason since start; the metrics actor adds the growth.
    evictions: dict[str, int]


@attrs.frozen(kw_only=True)
class RequestFinished:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds_to_first_token: float | None


@attrs.frozen(kw_only=True)
class RenderMetrics:
    reply_to: trio.MemorySendChannel[bytes] = attrs.field(repr=False)


MetricsMsg = CacheLookedUp | CacheStoreChanged | RequestFinished | RenderMetrics


# --- scheduler -> warmer -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ReplyFinished:
    """A healthy reply finished: the warmer may prepare the session's next turn."""

    context: CacheContext
    chat: ChatRequest | None = attrs.field(repr=False)
    reply_text: str = attrs.field(repr=False)
    prompt_tokens: int
    completion_tokens: int


WarmerMsg = ReplyFinished


@attrs.frozen(kw_only=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_steps: int
    num_completed: int
    num_cancelled: int
    num_failed: int
    max_decode_batch_size: int
    # How many decode steps ran at each batch size.
    decode_batch_sizes: dict[int, int]
    # Steps that prefilled one sequence's chunk while others decoded.
    num_interleaved_steps: int
    # Requests waiting for another request's prompt prefill to share its prefix.
    num_parked: int
    num_shared_prefills: int
    num_warm_started: int = 0
    num_warm_completed: int = 0
    num_warm_preempted: int = 0
    # Steps in which a warm-up ran while foreground requests waited or ran: must stay 0.
    num_warm_steps_with_foreground: int = 0
    running_request_ids: tuple[str, ...]
