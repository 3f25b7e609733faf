"""What the scheduling core asks of the other actors, and the values it reports: plain data."""

from __future__ import annotations

from typing import Any

import attrs

from mlxcel.cache.key import CacheContext
from mlxcel.types import ChatRequest

# --- to the cache store ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class DonateSequence:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int
    # Leading tokens that were the request's prompt (the rest it generated).
    prompt_len: int | None = None
    # Pin the entry against eviction this long (0: ordinary LRU).
    retain_seconds: float = 0.0


@attrs.frozen(kw_only=True)
class DonateSnapshot:
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    payload: Any = attrs.field(repr=False)
    nbytes: int
    # A branch point kept when the conversation moves on (not superseded by its descendants).
    checkpoint: bool = False
    # Every layer can be cut back to an earlier length (partial restore).
    cuttable: bool = False


@attrs.frozen(kw_only=True)
class SnapshotRestoreFailed:
    """The device could not restore a found snapshot; counted as an incompatible refusal."""

    reason: str


@attrs.frozen(kw_only=True)
class ShedCache:
    """The device ran out of memory: drop the least recently used half of both stores."""


# --- to the metrics actor and the warmer ---------------------------------------------


@attrs.frozen(kw_only=True)
class RequestFinished:
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    seconds_to_first_token: float | None


@attrs.frozen(kw_only=True)
class CacheLookedUp:
    """A lookup's outcome (the cache store's, or the core's once a start's disk read is done)."""

    hit: bool
    tokens_reused: int = 0
    # The request's prompt length: vLLM's prefix_cache_queries count tokens, not lookups.
    tokens_queried: int = 0
    # A stored snapshot was refused for this cause: not a miss (a miss is nothing stored).
    refusal: str | None = None


@attrs.frozen(kw_only=True)
class ReplyFinished:
    """A healthy reply finished: the warmer may prepare the session's next turn."""

    context: CacheContext
    chat: ChatRequest | None = attrs.field(repr=False)
    reply_text: str = attrs.field(repr=False)
    prompt_tokens: int
    completion_tokens: int


CacheEffect = DonateSequence | DonateSnapshot | SnapshotRestoreFailed | ShedCache
Effect = CacheEffect | RequestFinished | ReplyFinished | CacheLookedUp


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
    # Warm-ups that found their tokens already in a stored snapshot (nothing ran).
    num_warm_covered: int = 0
    num_warm_preempted: int = 0
    # Steps in which a warm-up ran while foreground requests waited or ran: must stay 0.
    num_warm_steps_with_foreground: int = 0
    # Speculative decoding since start: verify steps, proposed and accepted tokens.
    num_verify_steps: int = 0
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0
    running_request_ids: tuple[str, ...]
