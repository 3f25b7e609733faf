"""The prompt-prefix store: LRU/TTL entries, two-tier lookup, APC chains, retention pins.

Synchronous and deterministic: time is passed in as `now` (monotonic
seconds, never decreasing) and payloads are opaque objects handed back
untouched.

Entries share storage. A payload that has ``pieces()`` (model/kv.py's
DetachedKV) is made of immutable pieces that other entries may hold too (a
conversation's entry holds the system prompt's piece that every other
conversation holds, plus pieces of its own). The store counts each piece's
bytes once, while any entry holds it: the byte budget is a budget of
*unique* bytes. An entry's ``nbytes`` is its logical size, what it would
take unshared. Any other payload is one piece of its own.

A donation may ask to be retained for a number of seconds (Anthropic's
`cache_control` ttl, OpenAI's `prompt_cache_retention`). Its entry is then
*pinned* until that time: LRU pressure and the TTL pass it by, as long as
the pinned bytes stay within ``StoreLimits.pinned_share`` of the budget.
Pins live on owners (an alias is pinned through its owner); a pin that has
ended makes its entry an ordinary LRU entry again.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Literal, Protocol, runtime_checkable

import attrs

from mlxcel.cache.apc import ALGORITHMS, BlockHasher, HashAlgorithm, agreeing_blocks
from mlxcel.cache.key import CacheContext, TrieKey, digest_packed, pack_tokens, trie_key
from mlxcel.cache.kv_events import BlockChange, BlocksCleared, BlocksRemoved, BlocksStored
from mlxcel.cache.trie import PackedPrefix, RadixTrie, TrieWalk

EvictionReason = Literal["lru", "ttl", "capacity", "superseded"]
EVICTION_REASONS: tuple[EvictionReason, ...] = ("lru", "ttl", "capacity", "superseded")
REFUSAL_REASONS = ("too_short", "too_large")
# APC block cap when none is configured: this many blocks per allowed entry.
DERIVED_BLOCKS_PER_ENTRY = 256

_non_negative = attrs.validators.ge(0)


class _Piece(Protocol):
    @property
    def nbytes(self) -> int: ...


@runtime_checkable
class SharedPayload(Protocol):
    """A payload made of pieces that other payloads may share (model/kv.py's DetachedKV)."""

    def pieces(self) -> Sequence[_Piece]: ...


@attrs.define(eq=False)
class _PieceRecord:
    piece: object = attrs.field(repr=False)
    nbytes: int
    # Entries holding it, and how many of them are pinned.
    refs: int = 0
    pinned_refs: int = 0


def _pieces_of(payload: object, nbytes: int) -> list[tuple[int, object, int]]:
    """(key, piece, bytes) of each distinct piece a payload holds."""
    if not isinstance(payload, SharedPayload):
        return [(id(payload), payload, nbytes)]
    found: dict[int, tuple[int, object, int]] = {}
    for piece in payload.pieces():
        found.setdefault(id(piece), (id(piece), piece, piece.nbytes))
    return list(found.values())


@attrs.frozen(kw_only=True)
class StoreLimits:
    capacity_bytes: int = attrs.field(validator=_non_negative)
    max_entries: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    ttl_seconds: float = attrs.field(default=3600.0, validator=attrs.validators.ge(0.0))
    min_prefix: int = attrs.field(default=32, validator=_non_negative)
    # The largest share of capacity_bytes that retention pins may hold (0: no pins).
    pinned_share: float = attrs.field(
        default=0.5, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)]
    )

    @property
    def pinned_capacity_bytes(self) -> int:
        return int(self.capacity_bytes * self.pinned_share)


@attrs.frozen(kw_only=True)
class ApcSettings:
    enabled: bool = True
    block_size: int = attrs.field(default=16, validator=attrs.validators.ge(1))
    num_blocks: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(_non_negative)
    )
    algorithm: HashAlgorithm = attrs.field(default="sha256", validator=attrs.validators.in_(ALGORITHMS))

    def block_cap(self, max_entries: int) -> int:
        if self.num_blocks is not None:
            return self.num_blocks
        return max_entries * DERIVED_BLOCKS_PER_ENTRY


@attrs.frozen(kw_only=True)
class Match:
    entry_id: bytes
    payload: object = attrs.field(repr=False)
    matched_len: int
    entry_len: int
    cross_session: bool
    # The entry diverges from the request; the length came from APC blocks.
    partial: bool


@attrs.frozen(kw_only=True)
class InsertOutcome:
    stored: bool
    entry_id: bytes | None = None
    reason: str | None = None
    evictions: tuple[tuple[EvictionReason, int], ...] = ()
    # When the entry (its owner, for an alias) is pinned until, after this insert; None: not pinned.
    pinned_until: float | None = None
    # Retention was asked for, but the entry is larger than the whole pinned share.
    pin_too_large: bool = False


@attrs.frozen(kw_only=True)
class ResetOutcome:
    entries_freed: int
    bytes_freed: int


@attrs.frozen(kw_only=True)
class StoreStats:
    entries: int
    bytes: int
    capacity_bytes: int
    max_entries: int
    hits: int
    misses: int
    tokens_reused: int
    evictions: Mapping[EvictionReason, int]
    inserts: int
    refusals: int
    duplicates: int
    aliases: int
    apc_enabled: bool
    apc_block_cap: int
    total_blocks_stored: int
    unique_block_hashes: int
    apc_active_entries: int
    pinned_entries: int = 0
    pinned_bytes: int = 0
    pinned_capacity_bytes: int = 0
    # Pins given up: past the pinned share (soonest-ending first), to fit a limit, or too large to pin.
    pins_dropped: int = 0
    # What the entries would take unshared (``bytes`` counts each shared piece once), and the pieces held.
    logical_bytes: int = 0
    pieces: int = 0

    @property
    def sharing_ratio(self) -> float:
        """Logical over unique bytes: 1.0 when nothing is shared."""
        return self.logical_bytes / self.bytes if self.bytes else 1.0


@attrs.frozen(kw_only=True)
class EntryInfo:
    """A read-only view of one entry, for stats pages and tests."""

    entry_id: bytes
    context: CacheContext
    tokens: tuple[int, ...] = attrs.field(repr=False)
    nbytes: int
    alias_of: bytes | None
    num_blocks: int
    last_used: float
    # When its pin (its owner's, for an alias) ends; None: not pinned.
    pinned_until: float | None = None


@attrs.define(eq=False)
class _Entry:
    entry_id: bytes
    context: CacheContext
    trie_key: TrieKey
    num_tokens: int
    payload: object
    nbytes: int
    last_used: float
    # Owners keep their packed tokens and chain; an alias reads its owner's.
    token_bytes: bytes | None
    chain: list[bytes]
    num_blocks: int
    owner: _Entry | None = None
    aliases: dict[bytes, _Entry] = attrs.Factory(dict)
    # How many leading tokens were the donating request's prompt (None: not told).
    prompt_len: int | None = None
    # Owners: the keys of the pieces its payload holds (aliases hold none).
    piece_keys: tuple[int, ...] = ()

    def packed(self) -> bytes:
        owner = self.owner or self
        assert owner.token_bytes is not None
        return owner.token_bytes[: 4 * self.num_tokens]


@attrs.frozen
class _Candidate:
    entry_id: bytes
    matched_len: int
    partial: bool


class _RequestChain:
    """The request's block hashes, filled in only as far as a lookup needs them.

    Where the trie has already found the request's packed tokens identical
    to a stored entry's through some block, the request's hash of that block
    is the entry's (same input bytes, same hash) and is copied, not
    recomputed; blocks past that point are hashed from the request itself.
    """

    def __init__(self, hasher: BlockHasher, request: PackedPrefix, mm_digest: bytes) -> None:
        self._hasher = hasher
        self._request = request
        self._mm_digest = mm_digest
        self.hashes: list[bytes] = []

    def up_to(self, num_blocks: int, donor: list[bytes], identical_blocks: int) -> list[bytes]:
        hashes = self.hashes
        known = min(identical_blocks, num_blocks, len(donor))
        if len(hashes) < known:
            hashes.extend(donor[len(hashes) : known])
        if len(hashes) < num_blocks:
            token_bytes = self._request.up_to(num_blocks * self._hasher.block_size)
            self.hashes = hashes = self._hasher.extend_packed(
                hashes, token_bytes, self._mm_digest, num_blocks
            )
        return hashes


class PromptCacheStore:
    """Stored prompt prefixes with their opaque KV payloads."""

    def __init__(self, limits: StoreLimits, apc: ApcSettings | None = None, *, log_blocks: bool = False) -> None:
        self.limits = limits
        # What happened to APC blocks since the last take_block_changes (None: not logged).
        self._block_log: list[BlockChange] | None = [] if log_blocks else None
        self.apc = apc if apc is not None else ApcSettings()
        self._hasher = BlockHasher(algorithm=self.apc.algorithm, block_size=self.apc.block_size)
        self._block_cap = self.apc.block_cap(limits.max_entries)
        self._entries: dict[bytes, _Entry] = {}
        # Least recently used first, which is also last_used order.
        self._recency: OrderedDict[bytes, None] = OrderedDict()
        self._owner_recency: OrderedDict[bytes, None] = OrderedDict()
        self._released: list[object] = []
        self._tries: dict[TrieKey, RadixTrie[bytes]] = {}
        self._block_refs: dict[bytes, int] = {}
        # Unique bytes (each held piece once) and logical bytes (each owner's nbytes).
        self._bytes = 0
        self._logical_bytes = 0
        self._pieces: dict[int, _PieceRecord] = {}
        self._total_blocks = 0
        self._apc_active = 0
        self._hits = 0
        self._misses = 0
        self._tokens_reused = 0
        self._inserts = 0
        self._refusals = 0
        self._duplicates = 0
        self._evictions = dict.fromkeys(EVICTION_REASONS, 0)
        # Pinned owners and when their pins end; their bytes.
        self._pins: dict[bytes, float] = {}
        self._pinned_bytes = 0
        self._pins_dropped = 0

    def __len__(self) -> int:
        return len(self._entries)

    # Insertion

    def insert(
        self,
        context: CacheContext,
        tokens: Sequence[int],
        payload: object,
        nbytes: int,
        now: float,
        prompt_len: int | None = None,
        retain_seconds: float = 0.0,
    ) -> InsertOutcome:
        """Offer the KV payload of tokens; the store keeps it when stored is True.

        ``prompt_len`` is how many leading tokens were the donating request's
        prompt (the rest it generated). An entry that told it is dropped
        (reason ``superseded``) when a later entry covers its whole prompt but
        not its generated tail: the conversation went on without that reply's
        tokens (the next turn re-renders the reply, or strips its reasoning),
        so the tail serves no one, and the rest is in the newer entry.

        ``retain_seconds`` > 0 pins the entry until ``now + retain_seconds``
        (a duplicate extends its entry's pin). A new entry that supersedes or
        drops pinned entries inherits the latest of their pins.
        """
        if nbytes < 0:
            raise ValueError("nbytes must not be negative")
        evictions: list[tuple[EvictionReason, int]] = []
        self._expire(now, evictions)
        retain_until = now + retain_seconds if retain_seconds > 0 else 0.0
        if len(tokens) < self.limits.min_prefix:
            return self._refuse("too_short", evictions)
        pieces = _pieces_of(payload, nbytes)
        if sum(piece_bytes for _, _, piece_bytes in pieces) > self.limits.capacity_bytes:
            return self._refuse("too_large", evictions)

        token_bytes = pack_tokens(tokens)
        entry_id = digest_packed(context, token_bytes)
        existing = self._entries.get(entry_id)
        if existing is not None:
            self._touch(existing, now)
            self._duplicates += 1
            owner = existing.owner or existing
            too_large = False
            if retain_until:
                too_large = not self._pin(owner, retain_until)
                self._enforce_pinned_share()
            return InsertOutcome(
                stored=False, entry_id=entry_id, reason="duplicate", evictions=tuple(evictions),
                pinned_until=self._pins.get(owner.entry_id), pin_too_large=too_large,
            )

        which = trie_key(context)
        trie = self._tries.get(which)
        superseded: list[_Entry] = []
        dominated: _Entry | None = None
        chain: list[bytes] = []
        if trie is not None:
            walk = trie.walk(token_bytes)
            nearest = walk.longest_common()
            if nearest is not None:
                neighbor = self._entries[nearest[0]]
                # A lookup of its own prompt is capped one token short, so a newer entry that parts from it
                # at its prompt's last token still serves everything it could (by a partial match, which
                # multimodal lookups decline: their entries stay).
                if (neighbor.owner is None and neighbor.context == context and neighbor.prompt_len is not None
                        and not context.is_multimodal
                        and neighbor.prompt_len - 1 <= nearest[1] < neighbor.num_tokens):
                    dominated = neighbor
            for older_id, length in walk.prefix_matches(tag=context.session_key):
                older = self._entries[older_id]
                if older.owner is None and length < len(tokens) and older.context == context:
                    superseded.append(older)
            if self.apc.enabled and nearest is not None:
                # The entry sharing the longest prefix lends its hashes for it.
                neighbor_chain, neighbor_blocks = self._chain_of(self._entries[nearest[0]])
                chain = neighbor_chain[: min(nearest[1] // self.apc.block_size, neighbor_blocks)]
        else:
            trie = self._tries[which] = RadixTrie()
        if self.apc.enabled:
            chain = self._hasher.extend_packed(
                chain, token_bytes, context.mm_digest, self._block_cap
            )

        entry = _Entry(
            entry_id=entry_id,
            context=context,
            trie_key=which,
            num_tokens=len(tokens),
            payload=payload,
            nbytes=nbytes,
            last_used=now,
            token_bytes=token_bytes,
            chain=chain,
            num_blocks=len(chain),
            prompt_len=prompt_len,
            piece_keys=tuple(key for key, _, _ in pieces),
        )
        trie.insert(token_bytes, entry_id, tag=context.session_key)
        self._entries[entry_id] = entry
        self._recency[entry_id] = None
        self._owner_recency[entry_id] = None
        self._hold_pieces(pieces)
        self._logical_bytes += nbytes
        self._count_chain(entry.num_blocks, +1)
        self._inserts += 1
        # The longest superseded chain is a prefix of the new one: hand its
        # references over instead of counting every block up and down again.
        heir = max(superseded, key=lambda older: len(older.chain), default=None)
        if self._block_log is not None:
            self._log_stored(context, chain, token_bytes)
        self._add_blocks(chain[len(heir.chain) :] if heir is not None else chain)
        # The new entry holds what the entries it replaces held, so it keeps their pins.
        inherited = [self._unpin(older) for older in (*superseded, dominated) if older is not None]
        pin_until = max([retain_until, *inherited])
        for older in superseded:
            self._supersede(older, entry, evictions, references_moved=older is heir)
        if dominated is not None:
            self._evict(dominated, "superseded", evictions)
        too_large = False
        if pin_until > now:
            too_large = not self._pin(entry, pin_until)
            self._enforce_pinned_share()
        self._enforce_limits(evictions, keep=entry)
        return InsertOutcome(
            stored=True, entry_id=entry_id, reason=None, evictions=tuple(evictions),
            pinned_until=self._pins.get(entry_id), pin_too_large=too_large,
        )

    def _refuse(
        self, reason: str, evictions: list[tuple[EvictionReason, int]]
    ) -> InsertOutcome:
        self._refusals += 1
        return InsertOutcome(stored=False, reason=reason, evictions=tuple(evictions))

    def _supersede(
        self,
        older: _Entry,
        newer: _Entry,
        evictions: list[tuple[EvictionReason, int]],
        references_moved: bool,
    ) -> None:
        """Turn older into a zero-byte alias of newer, which holds its tokens and more."""
        freed = self._release_pieces(older)
        self._logical_bytes -= older.nbytes
        evictions.append(("superseded", freed))
        self._evictions["superseded"] += 1
        # Its chain is a prefix of newer's, so its num_blocks stays valid.
        if not references_moved:
            self._drop_blocks(older.chain)
        self._released.append(older.payload)
        older.payload = None
        older.token_bytes = None
        older.chain = []
        older.nbytes = 0
        del self._owner_recency[older.entry_id]
        for alias in older.aliases.values():
            alias.owner = newer
            newer.aliases[alias.entry_id] = alias
        older.aliases = {}
        older.owner = newer
        newer.aliases[older.entry_id] = older

    def _enforce_limits(self, evictions: list[tuple[EvictionReason, int]], keep: _Entry) -> None:
        """Evict least recently used unpinned entries (never ``keep``, just stored) until within the limits.

        When only pinned entries (and ``keep``) are left and a limit is still
        exceeded, the pin that ends soonest is given up and the loop goes on.
        """
        limits = self.limits
        while len(self._entries) > limits.max_entries:
            self._evict(self._victim(self._recency, keep), "lru", evictions)
        # Aliases cost no bytes or blocks, so byte and block pressure evicts owners.
        while self._bytes > limits.capacity_bytes:
            self._evict(self._victim(self._owner_recency, keep, freeing=True), "lru", evictions)
        while len(self._block_refs) > self._block_cap:
            self._evict(self._victim(self._owner_recency, keep), "capacity", evictions)

    def _victim(self, order: OrderedDict[bytes, None], keep: _Entry | None, *, freeing: bool = False) -> _Entry:
        """The least recently used entry of order that is neither pinned nor keep.

        ``freeing``: byte pressure. Leaves go first: the least recently used
        owner whose eviction frees a piece (one no other entry holds). Only
        when every candidate shares all it holds does the plain least
        recently used one go, so the pieces it shares get closer to free.
        """
        while True:
            fallback = None
            for entry_id in order:
                entry = self._entries[entry_id]
                if entry is keep or (entry.owner or entry).entry_id in self._pins:
                    continue
                if not freeing or self._frees_bytes(entry):
                    return entry
                fallback = fallback or entry
            if fallback is not None:
                return fallback
            self._drop_pin(self._soonest_pin())

    def _frees_bytes(self, owner: _Entry) -> bool:
        pieces = self._pieces
        # Its own pieces are usually its last ones (what it added to a shared prefix).
        return any(pieces[key].refs == 1 for key in reversed(owner.piece_keys))

    # Pins

    def _pin(self, owner: _Entry, until: float) -> bool:
        """Pin owner until at least until; False when it is larger than the whole pinned share."""
        budget = self.limits.pinned_capacity_bytes
        if not budget:
            return True  # retention is off: nothing to pin, nothing to report
        if self._unique_bytes_of(owner) > budget:
            self._pins_dropped += 1
            return False
        current = self._pins.get(owner.entry_id)
        if current is None:
            for key in owner.piece_keys:
                record = self._pieces[key]
                if not record.pinned_refs:
                    self._pinned_bytes += record.nbytes
                record.pinned_refs += 1
            self._pins[owner.entry_id] = until
        else:
            self._pins[owner.entry_id] = max(current, until)
        return True

    def _unpin(self, owner: _Entry) -> float:
        """Take owner's pin away (it leaves or becomes an alias); when it would have ended, or 0."""
        until = self._pins.pop(owner.entry_id, None)
        if until is None:
            return 0.0
        for key in owner.piece_keys:
            record = self._pieces[key]
            record.pinned_refs -= 1
            if not record.pinned_refs:
                self._pinned_bytes -= record.nbytes
        return until

    def _drop_pin(self, entry_id: bytes) -> None:
        self._unpin(self._entries[entry_id])
        self._pins_dropped += 1

    def _soonest_pin(self) -> bytes:
        """The pinned owner whose pin ends first (of equal ones, the least recently used)."""
        pins = self._pins
        return min((entry_id for entry_id in self._owner_recency if entry_id in pins), key=pins.__getitem__)

    def _enforce_pinned_share(self) -> None:
        while self._pinned_bytes > self.limits.pinned_capacity_bytes:
            self._drop_pin(self._soonest_pin())

    def _end_pins(self, now: float) -> None:
        """Pins whose time has come end: their entries are ordinary LRU entries again."""
        if self._pins:
            for entry_id in [entry_id for entry_id, until in self._pins.items() if until <= now]:
                self._unpin(self._entries[entry_id])

    # Lookup

    def lookup(
        self,
        context: CacheContext,
        tokens: Sequence[int],
        now: float,
        max_len: int | None = None,
        *,
        record: bool = True,
        cross_session: bool = True,
    ) -> Match | None:
        """The longest usable stored prefix of tokens, or None (a miss).

        max_len caps the match (callers pass len(tokens) - 1 so at least one
        token is prefilled). The payload is handed back untouched; an
        adopter that needs fewer tokens than the entry holds trims a copy.
        ``record=False`` is a peek: no hit or miss is counted and recency is
        not refreshed. ``cross_session=False`` keeps the lookup inside the
        request's own session (tenant isolation).
        """
        self._expire(now, [])
        num_tokens = len(tokens)
        cap = num_tokens if max_len is None else min(max_len, num_tokens)
        floor = max(self.limits.min_prefix, 1)
        trie = self._tries.get(trie_key(context))
        if trie is None or cap < floor:
            self._misses += record
            return None
        # Packed lazily: a walk that parts early from every entry packs little.
        request = PackedPrefix(tokens)
        walk = trie.walk(request)
        request_chain = _RequestChain(self._hasher, request, context.mm_digest)
        own = self._best(walk, context, num_tokens, cap, request_chain, context.session_key, floor)
        if own is not None:
            floor = own.matched_len + 1
        # Another session's entry wins only when strictly longer.
        other = None
        if cross_session:
            other = self._best(walk, context, num_tokens, cap, request_chain, None, floor)
        chosen = other if other is not None else own
        if chosen is None:
            self._misses += record
            return None
        entry = self._entries[chosen.entry_id]
        if record:
            self._touch(entry, now)
            self._hits += 1
            self._tokens_reused += chosen.matched_len
        owner = entry.owner or entry
        return Match(
            entry_id=entry.entry_id,
            payload=owner.payload,
            matched_len=chosen.matched_len,
            entry_len=entry.num_tokens,
            cross_session=entry.context.session_key != context.session_key,
            partial=chosen.partial,
        )

    def _best(
        self,
        walk: TrieWalk[bytes],
        context: CacheContext,
        num_tokens: int,
        cap: int,
        request_chain: _RequestChain,
        tag: str | None,
        floor: int,
    ) -> _Candidate | None:
        """The best candidate of one tier that reaches at least floor tokens."""
        best: _Candidate | None = None
        best_len = floor - 1
        multimodal = context.is_multimodal
        for entry_id, length in walk.prefix_matches(tag=tag):
            if min(length, cap) <= best_len:
                break
            # Multimodal requests adopt whole entries only.
            if multimodal and length > cap:
                continue
            best = _Candidate(entry_id, min(length, cap), False)
            best_len = best.matched_len
            break
        if not self.apc.enabled or multimodal:
            return best
        block_size = self.apc.block_size
        cap_blocks = cap // block_size
        request_blocks = num_tokens // block_size
        # Only branches that share more tokens than best are visited.
        for entry_id, common in walk.diverging_matches(tag=tag, min_common=best_len + 1):
            bound = min(common, cap)
            # At equal length a whole-prefix match is kept.
            if bound <= best_len:
                break
            chain, num_blocks = self._chain_of(self._entries[entry_id])
            # One block past the common prefix lets the walk see the divergence.
            needed = min(common // block_size + 1, num_blocks, cap_blocks, request_blocks)
            request_hashes = request_chain.up_to(needed, chain, common // block_size)
            agreeing = agreeing_blocks(request_hashes[:needed], chain[:needed])
            # When the chains confirm every whole block of the shared tokens, the trie
            # knows the exact token where the entry parts from the request: the KV is
            # reused up to there, not rounded down to a block.
            matched = bound if agreeing >= bound // block_size else min(agreeing, cap_blocks) * block_size
            if matched > best_len:
                best = _Candidate(entry_id, matched, True)
                best_len = matched
            if matched >= bound:
                break  # later candidates share no more tokens than this one
        return best

    # Expiry, eviction, reset

    def expire(self, now: float) -> tuple[tuple[EvictionReason, int], ...]:
        """Drop entries unused for ttl_seconds; returns what went."""
        evictions: list[tuple[EvictionReason, int]] = []
        self._expire(now, evictions)
        return tuple(evictions)

    def _expire(self, now: float, evictions: list[tuple[EvictionReason, int]]) -> None:
        """End pins that are due, then drop entries unused for ttl_seconds that no pin holds."""
        self._end_pins(now)
        ttl = self.limits.ttl_seconds
        pins = self._pins
        expired: list[_Entry] = []
        # Recency order is last_used order: the first live entry ends the search.
        for entry_id in self._recency:
            entry = self._entries[entry_id]
            if now - entry.last_used < ttl:
                break
            if (entry.owner or entry).entry_id not in pins:
                expired.append(entry)
        for entry in expired:
            # An owner's eviction takes its aliases, which may be in the list too.
            if entry.entry_id in self._entries:
                self._evict(entry, "ttl", evictions)

    def take_released(self) -> list[object]:
        """Payloads the store has let go of since the last call.

        The store never frees a payload itself: its owner hands these to
        whoever must release them (MLX arrays are freed on the device thread).
        """
        released, self._released = self._released, []
        return released

    def shed(self, target_bytes: int) -> tuple[tuple[EvictionReason, int], ...]:
        """Evict least recently used entries until at most target_bytes remain (memory pressure)."""
        evictions: list[tuple[EvictionReason, int]] = []
        # Memory pressure outranks retention: unpinned entries go first, then pins ending soonest.
        while self._bytes > target_bytes and self._owner_recency:
            self._evict(self._victim(self._owner_recency, None, freeing=True), "capacity", evictions)
        return tuple(evictions)

    def shed_half(self, now: float) -> tuple[int, int]:
        """Expire, then shed down to half the bytes left (out of device memory); bytes before and after."""
        self._expire(now, [])
        before = self._bytes
        self.shed(before // 2)
        return before, self._bytes

    def reset(self) -> ResetOutcome:
        """Forget every entry and chain; the counters keep running."""
        outcome = ResetOutcome(entries_freed=len(self._entries), bytes_freed=self._bytes)
        self._released.extend(entry.payload for entry in self._entries.values() if entry.owner is None)
        self._entries.clear()
        self._recency.clear()
        self._owner_recency.clear()
        self._tries.clear()
        self._block_refs.clear()
        self._pins.clear()
        self._pinned_bytes = 0
        self._bytes = 0
        self._logical_bytes = 0
        self._pieces.clear()
        self._total_blocks = 0
        self._apc_active = 0
        if self._block_log is not None:
            self._block_log.append(BlocksCleared())
        return outcome

    def _evict(
        self, entry: _Entry, reason: EvictionReason, evictions: list[tuple[EvictionReason, int]]
    ) -> None:
        # Aliases read the owner's payload and tokens, so they leave first.
        for alias in list(entry.aliases.values()):
            self._remove(alias, reason, evictions)
        self._remove(entry, reason, evictions)

    def _remove(
        self, entry: _Entry, reason: EvictionReason, evictions: list[tuple[EvictionReason, int]]
    ) -> None:
        entry_id = entry.entry_id
        trie = self._tries[entry.trie_key]
        trie.remove(entry.packed(), entry_id)
        if not len(trie):
            del self._tries[entry.trie_key]
        del self._entries[entry_id]
        del self._recency[entry_id]
        self._count_chain(entry.num_blocks, -1)
        freed = 0
        if entry.owner is None:
            del self._owner_recency[entry_id]
            self._unpin(entry)
            self._drop_blocks(entry.chain)
            freed = self._release_pieces(entry)
            self._logical_bytes -= entry.nbytes
            self._released.append(entry.payload)
        else:
            del entry.owner.aliases[entry_id]
        evictions.append((reason, freed))
        self._evictions[reason] += 1

    # Bookkeeping

    def _touch(self, entry: _Entry, now: float) -> None:
        entry.last_used = now
        self._recency.move_to_end(entry.entry_id)
        owner = entry.owner
        if owner is None:
            self._owner_recency.move_to_end(entry.entry_id)
        else:
            owner.last_used = now
            self._recency.move_to_end(owner.entry_id)
            self._owner_recency.move_to_end(owner.entry_id)

    def _hold_pieces(self, pieces: list[tuple[int, object, int]]) -> None:
        records = self._pieces
        for key, piece, nbytes in pieces:
            record = records.get(key)
            if record is None:
                record = records[key] = _PieceRecord(piece=piece, nbytes=nbytes)
                self._bytes += nbytes
            record.refs += 1

    def _release_pieces(self, owner: _Entry) -> int:
        """Let go of owner's pieces; returns the bytes of those no other entry holds (now freed)."""
        records = self._pieces
        freed = 0
        for key in owner.piece_keys:
            record = records[key]
            record.refs -= 1
            if not record.refs:
                del records[key]
                freed += record.nbytes
        owner.piece_keys = ()
        self._bytes -= freed
        return freed

    def _unique_bytes_of(self, owner: _Entry) -> int:
        return sum(self._pieces[key].nbytes for key in owner.piece_keys)

    def _chain_of(self, entry: _Entry) -> tuple[list[bytes], int]:
        owner = entry.owner or entry
        return owner.chain, entry.num_blocks

    def _count_chain(self, num_blocks: int, sign: int) -> None:
        self._total_blocks += sign * num_blocks
        if num_blocks:
            self._apc_active += sign

    def _add_blocks(self, hashes: list[bytes]) -> None:
        refs = self._block_refs
        get = refs.get
        for block_hash in hashes:
            refs[block_hash] = get(block_hash, 0) + 1

    def _drop_blocks(self, hashes: list[bytes]) -> None:
        refs = self._block_refs
        gone = []
        for block_hash in hashes:
            remaining = refs[block_hash] - 1
            if remaining:
                refs[block_hash] = remaining
            else:
                del refs[block_hash]
                gone.append(block_hash)
        if gone and self._block_log is not None:
            self._block_log.append(BlocksRemoved(hashes=tuple(gone)))

    def _log_stored(self, context: CacheContext, chain: list[bytes], token_bytes: bytes) -> None:
        """Log the blocks of chain the store does not hold yet (before they are counted in)."""
        refs = self._block_refs
        # Every held chain starts at the root, so the held blocks are a prefix of chain.
        first = next((index for index, block_hash in enumerate(chain) if block_hash not in refs), len(chain))
        if first == len(chain):
            return
        width = 4 * self.apc.block_size
        assert self._block_log is not None
        self._block_log.append(BlocksStored(
            context=context, parent=chain[first - 1] if first else None, hashes=tuple(chain[first:]),
            first_index=first, token_bytes=token_bytes[first * width : len(chain) * width],
        ))

    def take_block_changes(self) -> list[BlockChange]:
        """The APC block changes since the last call, in order (empty unless log_blocks)."""
        if not self._block_log:
            return []
        changes, self._block_log = self._block_log, []
        return changes

    # Introspection

    def stats(self, now: float) -> StoreStats:
        self._expire(now, [])
        return StoreStats(
            entries=len(self._entries),
            bytes=self._bytes,
            capacity_bytes=self.limits.capacity_bytes,
            max_entries=self.limits.max_entries,
            hits=self._hits,
            misses=self._misses,
            tokens_reused=self._tokens_reused,
            evictions=dict(self._evictions),
            inserts=self._inserts,
            refusals=self._refusals,
            duplicates=self._duplicates,
            aliases=len(self._entries) - len(self._owner_recency),
            apc_enabled=self.apc.enabled,
            apc_block_cap=self._block_cap,
            total_blocks_stored=self._total_blocks,
            unique_block_hashes=len(self._block_refs),
            apc_active_entries=self._apc_active,
            pinned_entries=len(self._pins),
            pinned_bytes=self._pinned_bytes,
            pinned_capacity_bytes=self.limits.pinned_capacity_bytes,
            pins_dropped=self._pins_dropped,
            logical_bytes=self._logical_bytes,
            pieces=len(self._pieces),
        )

    def entries_by_recency(self) -> list[EntryInfo]:
        """Every entry, least recently used first (expires nothing)."""
        return [self._info(self._entries[entry_id]) for entry_id in self._recency]

    def _info(self, entry: _Entry) -> EntryInfo:
        return EntryInfo(
            entry_id=entry.entry_id,
            context=entry.context,
            tokens=struct.unpack(f"<{entry.num_tokens}i", entry.packed()),
            nbytes=entry.nbytes,
            alias_of=None if entry.owner is None else entry.owner.entry_id,
            num_blocks=entry.num_blocks,
            last_used=entry.last_used,
            pinned_until=self._pins.get((entry.owner or entry).entry_id),
        )

