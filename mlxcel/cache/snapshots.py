"""The session snapshot store: one whole-state snapshot per session.

For model families whose state is not a plain, trimmable KV table (recurrent
hybrids, sliding windows), a stored state can only be resumed at exactly the
point where it was taken. So each session keeps one snapshot (the newest
supersedes its ancestors), a request resumes from it only when its prompt
begins with the snapshot's tokens, and any other relation is refused with a
named cause rather than restored into a state that never existed.

Pure logic: the payload is opaque, time is passed in.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Sequence
from typing import Any

import attrs

from mlxcel.cache.key import CacheContext


class RefusalCause(enum.Enum):
    HISTORY_REWRITTEN = "history_rewritten"
    TEMPLATE_CHANGED = "template_changed"
    INCOMPATIBLE = "incompatible"
    TOO_SHORT = "too_short"
    MULTIMODAL = "multimodal"


@attrs.frozen(kw_only=True)
class SnapshotLimits:
    capacity_bytes: int
    max_entries: int = 4096
    ttl_seconds: float = 7200.0


@attrs.frozen(kw_only=True)
class SnapshotHit:
    payload: Any = attrs.field(repr=False)
    num_tokens: int


@attrs.frozen(kw_only=True)
class SnapshotRefused:
    cause: RefusalCause
    snapshot_tokens: int
    # Tokens the request shares with the snapshot (where that is meaningful).
    common_tokens: int = 0


@attrs.frozen(kw_only=True)
class SnapshotStats:
    entries: int
    bytes: int
    capacity_bytes: int
    remaining_bytes: int
    max_entries: int
    hits: int
    misses: int
    refusals: dict[str, int]
    inserts: int
    evictions: dict[str, int]


@attrs.define(kw_only=True)
class _Snapshot:
    context: CacheContext
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int
    last_used: float


def _session(context: CacheContext) -> tuple[str, str, str, str]:
    return (context.model_id, context.lora_id, context.cache_salt, context.session_key)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix, by bisection on C-speed slice comparisons."""
    a, b = tuple(a), tuple(b)
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[low:middle] == b[low:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class SnapshotStore:
    def __init__(self, limits: SnapshotLimits) -> None:
        self.limits = limits
        # Least recently used first.
        self._entries: collections.OrderedDict[tuple[str, str, str, str], _Snapshot] = collections.OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._inserts = 0
        self._refusals: collections.Counter[str] = collections.Counter()
        self._evictions: collections.Counter[str] = collections.Counter()
        self._released: list[Any] = []

    def lookup(
        self, context: CacheContext, tokens: Sequence[int], now: float, *, record: bool = True
    ) -> SnapshotHit | SnapshotRefused | None:
        """The session's snapshot when the request's prompt extends it; a refusal when it does not.

        ``record=False`` is a peek (for background warm-ups): nothing is counted
        and recency is not refreshed.
        """
        self._expire(now)
        key = _session(context)
        entry = self._entries.get(key)
        if entry is None:
            self._misses += record
            return None
        refusal = self._refusal(entry, context, tokens)
        if refusal is not None:
            if record:
                self._refusals[refusal.cause.value] += 1
            return refusal
        if not record:
            return SnapshotHit(payload=entry.payload, num_tokens=len(entry.tokens))
        entry.last_used = now
        self._entries.move_to_end(key)
        self._hits += 1
        return SnapshotHit(payload=entry.payload, num_tokens=len(entry.tokens))

    @staticmethod
    def _refusal(entry: _Snapshot, context: CacheContext, tokens: Sequence[int]) -> SnapshotRefused | None:
        stored = len(entry.tokens)
        if context.is_multimodal:
            return SnapshotRefused(cause=RefusalCause.MULTIMODAL, snapshot_tokens=stored)
        if entry.context.template_sig != context.template_sig:
            return SnapshotRefused(cause=RefusalCause.TEMPLATE_CHANGED, snapshot_tokens=stored)
        if entry.context.rope_regime != context.rope_regime:
            return SnapshotRefused(cause=RefusalCause.INCOMPATIBLE, snapshot_tokens=stored)
        common = common_prefix_length(entry.tokens, tokens)
        if common < stored:
            cause = RefusalCause.TOO_SHORT if common == len(tokens) else RefusalCause.HISTORY_REWRITTEN
            return SnapshotRefused(cause=cause, snapshot_tokens=stored, common_tokens=common)
        if len(tokens) == stored:
            # Nothing would be left to prefill; resuming needs at least one new token.
            return SnapshotRefused(cause=RefusalCause.TOO_SHORT, snapshot_tokens=stored, common_tokens=common)
        return None

    def record_incompatible(self) -> None:
        """The device refused to restore a payload (family, layer or shape mismatch)."""
        self._hits -= 1
        self._refusals[RefusalCause.INCOMPATIBLE.value] += 1

    def insert(self, context: CacheContext, tokens: Sequence[int], payload: Any, nbytes: int, now: float) -> bool:
        """Store the session's newest snapshot, superseding its previous one."""
        self._expire(now)
        if nbytes > self.limits.capacity_bytes or not tokens:
            return False
        key = _session(context)
        previous = self._entries.pop(key, None)
        if previous is not None:
            self._bytes -= previous.nbytes
            self._released.append(previous.payload)
            self._evictions["superseded"] += 1
        self._entries[key] = _Snapshot(
            context=context, tokens=tuple(tokens), payload=payload, nbytes=nbytes, last_used=now
        )
        self._bytes += nbytes
        self._inserts += 1
        while self._bytes > self.limits.capacity_bytes or len(self._entries) > self.limits.max_entries:
            self._evict_oldest("lru")
        return key in self._entries

    def shed(self, target_bytes: int) -> None:
        """Evict least recently used snapshots until at most target_bytes remain."""
        while self._entries and self._bytes > target_bytes:
            self._evict_oldest("capacity")

    def shed_half(self, now: float) -> tuple[int, int]:
        """Expire, then shed down to half the bytes left (out of device memory); bytes before and after."""
        self._expire(now)
        before = self._bytes
        self.shed(before // 2)
        return before, self._bytes

    def take_released(self) -> list[Any]:
        """Payloads let go of since the last call, for the owner to release on the device thread."""
        released, self._released = self._released, []
        return released

    def reset(self) -> tuple[int, int]:
        freed = (len(self._entries), self._bytes)
        self._released.extend(entry.payload for entry in self._entries.values())
        self._entries.clear()
        self._bytes = 0
        return freed

    def stats(self, now: float) -> SnapshotStats:
        self._expire(now)
        return SnapshotStats(
            entries=len(self._entries),
            bytes=self._bytes,
            capacity_bytes=self.limits.capacity_bytes,
            remaining_bytes=self.limits.capacity_bytes - self._bytes,
            max_entries=self.limits.max_entries,
            hits=self._hits,
            misses=self._misses,
            refusals=dict(self._refusals),
            inserts=self._inserts,
            evictions=dict(self._evictions),
        )

    def _expire(self, now: float) -> None:
        # Entries are kept in last-use order, so the expired ones are at the front.
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if now - oldest.last_used <= self.limits.ttl_seconds:
                return
            self._evict_oldest("ttl")

    def _evict_oldest(self, reason: str) -> None:
        _key, entry = self._entries.popitem(last=False)
        self._bytes -= entry.nbytes
        self._released.append(entry.payload)
        self._evictions[reason] += 1
