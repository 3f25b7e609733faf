"""The session snapshot store: whole-state snapshots indexed by their token prefix.

For model families whose state is not a plain, trimmable KV table (recurrent
hybrids, sliding windows), a stored state can only be resumed where it was
taken (or, for a snapshot whose every layer still holds every token, cut
back to an earlier point). So a request resumes from the longest stored
snapshot whose tokens begin its prompt, found in a radix trie per bucket,
with the prefix store's two tiers: the request's own session first, another
session's only when strictly longer.

A session holds several snapshots. A newer one on the same path (its tokens
extend an older one of the same session) supersedes that ancestor, so a
conversation keeps one tip; siblings (other conversations, subagents under
one key) coexist. Checkpoints (the end of the shared system prompt, chunk
boundaries of long prompts) are never superseded: they are the branch
points other conversations resume from, and leave only by LRU, TTL or reset.

A request that finds nothing usable but shares a meaningful prefix with a
snapshot of its own session is refused with a named cause, apart from
plain misses.

Pure logic: the payload is opaque, time is passed in.
"""

from __future__ import annotations

import collections
import enum
import itertools
from collections.abc import Sequence
from typing import Any

import attrs

from mlxcel.cache.key import CacheContext, SessionId, TrieKey, pack_tokens, session_id, trie_key
from mlxcel.cache.trie import PackedPrefix, RadixTrie

# A request sharing fewer tokens than this with its session's snapshots is a
# plain miss (a new conversation shares the template's first tokens with
# every sibling), not a refusal.
REFUSAL_MIN_COMMON = 32


class RefusalCause(enum.Enum):
    HISTORY_REWRITTEN = "history_rewritten"
    TEMPLATE_CHANGED = "template_changed"
    INCOMPATIBLE = "incompatible"
    TOO_SHORT = "too_short"
    MULTIMODAL = "multimodal"


@attrs.frozen(kw_only=True)
class SnapshotLimits:
    capacity_bytes: int = attrs.field(validator=attrs.validators.ge(0))
    max_entries: int = attrs.field(default=4096, validator=attrs.validators.ge(1))
    ttl_seconds: float = attrs.field(default=7200.0, validator=attrs.validators.ge(0.0))
    refusal_min_common: int = attrs.field(default=REFUSAL_MIN_COMMON, validator=attrs.validators.ge(0))


@attrs.frozen(kw_only=True)
class SnapshotHit:
    payload: Any = attrs.field(repr=False)
    # Tokens to resume at: the snapshot's length, or less for a partial restore.
    num_tokens: int
    # The snapshot is cut back to num_tokens (it diverges from the request after that).
    partial: bool = False
    cross_session: bool = False


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
    checkpoints: int = 0
    sessions: int = 0
    tokens_reused: int = 0
    partial_hits: int = 0
    cross_session_hits: int = 0


@attrs.frozen(kw_only=True)
class SnapshotInfo:
    """A read-only view of one snapshot, for tests and stats pages."""

    entry_id: int
    session_key: str
    tokens: tuple[int, ...] = attrs.field(repr=False)
    nbytes: int
    checkpoint: bool
    cuttable: bool
    last_used: float


@attrs.define(eq=False)
class _Snapshot:
    entry_id: int
    context: CacheContext
    trie_key: TrieKey
    tokens: tuple[int, ...]
    payload: Any
    nbytes: int
    last_used: float
    checkpoint: bool
    # Every layer can be cut back to an earlier length (no recurrent state, no wrapped window).
    cuttable: bool


@attrs.frozen
class _Candidate:
    entry_id: int
    usable: int
    partial: bool


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
        self._entries: dict[int, _Snapshot] = {}
        # Least recently used first.
        self._recency: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._tries: dict[TrieKey, RadixTrie[int]] = {}
        self._by_session: dict[SessionId, set[int]] = {}
        self._ids = itertools.count()
        self._bytes = 0
        self._num_cuttable = 0
        self._hits = 0
        self._misses = 0
        self._inserts = 0
        self._tokens_reused = 0
        self._partial_hits = 0
        self._cross_session_hits = 0
        self._refusals: collections.Counter[str] = collections.Counter()
        self._evictions: collections.Counter[str] = collections.Counter()
        self._released: list[Any] = []

    def __len__(self) -> int:
        return len(self._entries)

    # --- lookup ---------------------------------------------------------------------------

    def lookup(
        self, context: CacheContext, tokens: Sequence[int], now: float, *, record: bool = True,
        cross_session: bool = True,
    ) -> SnapshotHit | SnapshotRefused | None:
        """The longest snapshot the request can resume from; a refusal or None when there is none.

        At least one token is always left to prefill. ``record=False`` is a
        peek (for background warm-ups): nothing is counted and recency is not
        refreshed. ``cross_session=False`` never reaches another session.
        """
        self._expire(now)
        tokens = tuple(tokens)
        result = self._find(context, tokens, now, cross_session)
        if not record:
            return result
        if isinstance(result, SnapshotHit):
            self._hits += 1
            self._tokens_reused += result.num_tokens
            self._partial_hits += result.partial
            self._cross_session_hits += result.cross_session
        elif isinstance(result, SnapshotRefused):
            self._refusals[result.cause.value] += 1
        else:
            self._misses += 1
        return result

    def _find(
        self, context: CacheContext, tokens: tuple[int, ...], now: float, cross_session: bool
    ) -> SnapshotHit | SnapshotRefused | None:
        if context.is_multimodal:
            # Media state is never stored; say so when the session had something to offer.
            own = self._by_session.get(session_id(context))
            if own:
                longest = max(len(self._entries[entry_id].tokens) for entry_id in own)
                return SnapshotRefused(cause=RefusalCause.MULTIMODAL, snapshot_tokens=longest)
            return None
        trie = self._tries.get(trie_key(context))
        cap = len(tokens) - 1
        if trie is not None and cap >= 1:
            walk = trie.walk(PackedPrefix(pack_tokens(tokens)))
            best = self._best(walk, context.session_key, cap)
            if cross_session:
                other = self._best(walk, None, cap)
                if other is not None and (best is None or other.usable > best.usable):
                    best = other
            if best is not None:
                entry = self._entries[best.entry_id]
                self._touch(entry, now)
                return SnapshotHit(payload=entry.payload, num_tokens=best.usable, partial=best.partial,
                                   cross_session=entry.context.session_key != context.session_key)
        return self._refusal(context, tokens)

    def _best(self, walk: Any, tag: str | None, cap: int) -> _Candidate | None:
        """The longest usable snapshot of one session (tag) or of any: whole prefixes, then cuts."""
        best: _Candidate | None = None
        for entry_id, length in walk.prefix_matches(tag=tag):
            if length <= cap:
                # Between equal lengths a whole snapshot beats a cut one.
                if best is None or length >= best.usable:
                    best = _Candidate(entry_id, length, False)
                break
            if best is None and self._entries[entry_id].cuttable:
                best = _Candidate(entry_id, cap, True)
        if not self._num_cuttable:
            return best
        floor = best.usable if best is not None else 0
        for entry_id, common in walk.diverging_matches(tag=tag, min_common=floor + 1):
            usable = min(common, cap)
            if usable <= floor:
                break
            if self._entries[entry_id].cuttable:
                # Common lengths never increase along the walk: the first cuttable one is the best.
                return _Candidate(entry_id, usable, True)
        return best

    def _refusal(self, context: CacheContext, tokens: tuple[int, ...]) -> SnapshotRefused | None:
        """Why the session's own snapshots could not serve this prompt (None: a plain miss)."""
        own = self._by_session.get(session_id(context), ())
        best: tuple[int, int, RefusalCause] | None = None  # (common, stored, cause)
        for entry_id in own:
            entry = self._entries[entry_id]
            common = common_prefix_length(entry.tokens, tokens)
            if common < self.limits.refusal_min_common and common < len(entry.tokens):
                continue
            if entry.context.template_sig != context.template_sig:
                cause = RefusalCause.TEMPLATE_CHANGED
            elif entry.context.rope_regime != context.rope_regime:
                cause = RefusalCause.INCOMPATIBLE
            elif common == len(tokens) or common == len(entry.tokens):
                # The prompt ends inside (or exactly at the end of) the snapshot.
                cause = RefusalCause.TOO_SHORT
            else:
                cause = RefusalCause.HISTORY_REWRITTEN
            if best is None or common > best[0]:
                best = (common, len(entry.tokens), cause)
        if best is None:
            return None
        common, stored, cause = best
        return SnapshotRefused(cause=cause, snapshot_tokens=stored, common_tokens=common)

    def record_incompatible(self) -> None:
        """The device refused to restore a payload it was given (family, layer or shape mismatch)."""
        self._hits -= 1
        self._refusals[RefusalCause.INCOMPATIBLE.value] += 1

    # --- insertion ------------------------------------------------------------------------

    def insert(
        self, context: CacheContext, tokens: Sequence[int], payload: Any, nbytes: int, now: float, *,
        checkpoint: bool = False, cuttable: bool = False,
    ) -> bool:
        """Store a snapshot; a newer one on the same session's path supersedes its non-checkpoint ancestors.

        False: not kept (larger than the whole budget, empty, multimodal, or
        evicted at once); the payload is then among the released ones.
        """
        self._expire(now)
        tokens = tuple(tokens)
        if nbytes > self.limits.capacity_bytes or not tokens or context.is_multimodal:
            self._released.append(payload)
            return False
        key = trie_key(context)
        trie = self._tries.setdefault(key, RadixTrie())
        packed = pack_tokens(tokens)
        walk = trie.walk(PackedPrefix(packed))
        for older_id, length in list(walk.prefix_matches(tag=context.session_key)):
            older = self._entries[older_id]
            if length == len(tokens):
                # The same tokens again: the newer state replaces it, keeping its role.
                checkpoint = checkpoint or older.checkpoint
                self._remove(older, "superseded")
            elif not older.checkpoint:
                self._remove(older, "superseded")
        entry = _Snapshot(entry_id=next(self._ids), context=context, trie_key=key, tokens=tokens,
                          payload=payload, nbytes=nbytes, last_used=now, checkpoint=checkpoint,
                          cuttable=cuttable)
        # Superseding the trie's last entry dropped it.
        trie = self._tries.setdefault(key, trie)
        trie.insert(packed, entry.entry_id, tag=context.session_key)
        self._entries[entry.entry_id] = entry
        self._recency[entry.entry_id] = None
        self._by_session.setdefault(session_id(context), set()).add(entry.entry_id)
        self._bytes += nbytes
        self._num_cuttable += cuttable
        self._inserts += 1
        while self._bytes > self.limits.capacity_bytes or len(self._entries) > self.limits.max_entries:
            self._evict_oldest("lru")
        return entry.entry_id in self._entries

    # --- memory ---------------------------------------------------------------------------

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
        self._recency.clear()
        self._tries.clear()
        self._by_session.clear()
        self._bytes = 0
        self._num_cuttable = 0
        return freed

    # --- views ----------------------------------------------------------------------------

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
            checkpoints=sum(entry.checkpoint for entry in self._entries.values()),
            sessions=len(self._by_session),
            tokens_reused=self._tokens_reused,
            partial_hits=self._partial_hits,
            cross_session_hits=self._cross_session_hits,
        )

    def entries_by_recency(self) -> list[SnapshotInfo]:
        """Every live snapshot, least recently used first."""
        return [self._info(self._entries[entry_id]) for entry_id in self._recency]

    @staticmethod
    def _info(entry: _Snapshot) -> SnapshotInfo:
        return SnapshotInfo(entry_id=entry.entry_id, session_key=entry.context.session_key, tokens=entry.tokens,
                            nbytes=entry.nbytes, checkpoint=entry.checkpoint, cuttable=entry.cuttable,
                            last_used=entry.last_used)

    # --- internals ------------------------------------------------------------------------

    def _touch(self, entry: _Snapshot, now: float) -> None:
        entry.last_used = now
        self._recency.move_to_end(entry.entry_id)

    def _expire(self, now: float) -> None:
        # Kept in last-use order, so the expired ones are at the front.
        while self._recency:
            oldest = self._entries[next(iter(self._recency))]
            if now - oldest.last_used <= self.limits.ttl_seconds:
                return
            self._remove(oldest, "ttl")

    def _evict_oldest(self, reason: str) -> None:
        self._remove(self._entries[next(iter(self._recency))], reason)

    def _remove(self, entry: _Snapshot, reason: str) -> None:
        del self._entries[entry.entry_id]
        del self._recency[entry.entry_id]
        trie = self._tries[entry.trie_key]
        trie.remove(pack_tokens(entry.tokens), entry.entry_id)
        if not len(trie):
            del self._tries[entry.trie_key]
        session = session_id(entry.context)
        owned = self._by_session[session]
        owned.discard(entry.entry_id)
        if not owned:
            del self._by_session[session]
        self._bytes -= entry.nbytes
        self._num_cuttable -= entry.cuttable
        self._released.append(entry.payload)
        self._evictions[reason] += 1
