"""The store against a plain reference: a list of entries and linear scans (retention pins included)."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxcel.cache.key import CacheContext, RopeRegime, prefix_digest
from mlxcel.cache.store import ApcSettings, Match, PromptCacheStore, StoreLimits

BASE = CacheContext(model_id="m1", template_sig="t", session_key="a")
CONTEXTS = [
    BASE,
    attrs.evolve(BASE, session_key="b"),
    attrs.evolve(BASE, session_key="c"),
    attrs.evolve(BASE, model_id="m2"),
    attrs.evolve(BASE, rope_regime=RopeRegime.SHORT),
    attrs.evolve(BASE, mm_digest=bytes(32)),
    attrs.evolve(BASE, mm_digest=bytes(32), session_key="b"),
    attrs.evolve(BASE, cache_salt="tenant"),
]
token_lists = st.lists(st.integers(0, 2), min_size=0, max_size=26)
stored_lists = st.lists(st.integers(0, 2), min_size=4, max_size=26)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


@attrs.define
class RefEntry:
    entry_id: bytes
    context: CacheContext
    tokens: tuple[int, ...]
    payload: object
    nbytes: int
    last_used: float
    owner: bytes | None = None


class Reference:
    """Every rule of the store written as plainly as possible."""

    def __init__(self, limits: StoreLimits, apc: ApcSettings) -> None:
        self.limits = limits
        self.apc = apc
        self.block_cap = apc.block_cap(limits.max_entries)
        self.entries: list[RefEntry] = []  # least recently used first
        self.hits = self.misses = self.tokens_reused = 0
        self.inserts = self.refusals = self.duplicates = 0
        self.evictions: Counter[str] = Counter()
        # Pinned owners: entry id -> when the pin ends.
        self.pins: dict[bytes, float] = {}
        self.pins_dropped = 0
        self.budget = int(limits.capacity_bytes * limits.pinned_share)

    def root(self, entry: RefEntry) -> bytes:
        return entry.owner or entry.entry_id

    def pinned_bytes(self) -> int:
        return sum(self.find(entry_id).nbytes for entry_id in self.pins)

    def pin(self, owner: RefEntry, until: float) -> None:
        if not self.budget:
            return
        if owner.nbytes > self.budget:
            self.pins_dropped += 1
            return
        self.pins[owner.entry_id] = max(self.pins.get(owner.entry_id, 0.0), until)

    def drop_soonest_pin(self) -> None:
        # Of pins ending together, the least recently used owner's goes.
        soonest = min((e for e in self.owners() if e.entry_id in self.pins), key=lambda e: self.pins[e.entry_id])
        del self.pins[soonest.entry_id]
        self.pins_dropped += 1

    def victim(self, candidates: list[RefEntry], keep: RefEntry) -> RefEntry:
        while True:
            for entry in candidates:
                if entry is not keep and self.root(entry) not in self.pins:
                    return entry
            self.drop_soonest_pin()

    def find(self, entry_id: bytes) -> RefEntry:
        return next(entry for entry in self.entries if entry.entry_id == entry_id)

    def num_blocks(self, entry: RefEntry) -> int:
        if not self.apc.enabled:
            return 0
        return min(len(entry.tokens) // self.apc.block_size, self.block_cap)

    def owners(self) -> list[RefEntry]:
        return [entry for entry in self.entries if entry.owner is None]

    def unique_blocks(self) -> int:
        size = self.apc.block_size
        blocks = set()
        for entry in self.owners():
            for count in range(1, self.num_blocks(entry) + 1):
                blocks.add((entry.context.mm_digest, entry.tokens[: count * size]))
        return len(blocks)

    def total_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.entries)

    def touch(self, entry: RefEntry, now: float) -> None:
        for target in [entry] + ([self.find(entry.owner)] if entry.owner else []):
            target.last_used = now
            self.entries.remove(target)
            self.entries.append(target)

    def evict(self, entry: RefEntry, reason: str, out: list) -> None:
        for alias in [other for other in self.entries if other.owner == entry.entry_id]:
            self.remove(alias, reason, out)
        self.remove(entry, reason, out)

    def remove(self, entry: RefEntry, reason: str, out: list) -> None:
        self.entries.remove(entry)
        self.pins.pop(entry.entry_id, None)
        out.append((reason, entry.nbytes))
        self.evictions[reason] += 1

    def expire(self, now: float, out: list) -> None:
        self.pins = {entry_id: until for entry_id, until in self.pins.items() if until > now}
        while True:
            expired = [entry for entry in self.entries if now - entry.last_used >= self.limits.ttl_seconds
                       and self.root(entry) not in self.pins]
            if not expired:
                return
            self.evict(expired[0], "ttl", out)

    def insert(self, context, tokens, payload, nbytes, now, retain=0.0):
        out: list = []
        self.expire(now, out)
        tokens = tuple(tokens)
        if len(tokens) < self.limits.min_prefix:
            self.refusals += 1
            return False, "too_short", out
        if nbytes > self.limits.capacity_bytes:
            self.refusals += 1
            return False, "too_large", out
        entry_id = prefix_digest(context, tokens, len(tokens))
        retain_until = now + retain if retain > 0 else 0.0
        for entry in self.entries:
            if entry.entry_id == entry_id:
                self.touch(entry, now)
                self.duplicates += 1
                if retain_until:
                    self.pin(self.find(self.root(entry)), retain_until)
                    self.enforce_share()
                return False, "duplicate", out
        new = RefEntry(entry_id, context, tokens, payload, nbytes, now)
        superseded = [
            entry
            for entry in self.owners()
            if entry.context == context
            and len(entry.tokens) < len(tokens)
            and tokens[: len(entry.tokens)] == entry.tokens
        ]
        self.entries.append(new)
        self.inserts += 1
        until = max([retain_until, *(self.pins.pop(older.entry_id, 0.0) for older in superseded)])
        for older in superseded:
            out.append(("superseded", older.nbytes))
            self.evictions["superseded"] += 1
            for alias in self.entries:
                if alias.owner == older.entry_id:
                    alias.owner = entry_id
            older.owner, older.nbytes, older.payload = entry_id, 0, None
        if until > now:
            self.pin(new, until)
            self.enforce_share()
        while len(self.entries) > self.limits.max_entries:
            self.evict(self.victim(self.entries, new), "lru", out)
        while self.total_bytes() > self.limits.capacity_bytes:
            self.evict(self.victim(self.owners(), new), "lru", out)
        while self.unique_blocks() > self.block_cap:
            self.evict(self.victim(self.owners(), new), "capacity", out)
        return True, None, out

    def enforce_share(self) -> None:
        while self.pinned_bytes() > self.budget:
            self.drop_soonest_pin()

    def candidates(self, context, tokens, cap):
        """(entry, usable length, partial) for every entry the request may use."""
        size = self.apc.block_size
        for entry in self.entries:
            same = (entry.context.bucket, entry.context.rope_regime, entry.context.mm_digest)
            if same != (context.bucket, context.rope_regime, context.mm_digest):
                continue
            common = _common(entry.tokens, tokens)
            if common == len(entry.tokens):
                if context.is_multimodal and len(entry.tokens) > cap:
                    continue
                yield entry, min(common, cap), False
            elif self.apc.enabled and not context.is_multimodal:
                usable = min(common, cap)
                if usable // size > self.num_blocks(entry):
                    # Past the entry's block chain only whole agreeing blocks count.
                    usable = min(common // size, self.num_blocks(entry), cap // size) * size
                yield entry, usable, True

    def lookup(self, context, tokens, now, max_len):
        self.expire(now, [])
        tokens = tuple(tokens)
        cap = len(tokens) if max_len is None else min(max_len, len(tokens))
        found = list(self.candidates(context, tokens, cap))
        own = [c for c in found if c[0].context.session_key == context.session_key]
        own_best = max((length for _, length, _ in own), default=0)
        any_best = max((length for _, length, _ in found), default=0)
        tier, best = (found, any_best) if any_best > own_best else (own, own_best)
        if best < max(self.limits.min_prefix, 1):
            self.misses += 1
            return None
        return best, [(entry, partial) for entry, length, partial in tier if length == best]


def _neighbours(context: CacheContext) -> st.SearchStrategy[CacheContext]:
    """The same context, mostly, else another session of its bucket or anything."""
    sessions = [attrs.evolve(context, session_key=key) for key in ("a", "b", "c")]
    return st.sampled_from([context, context, context, *sessions, *CONTEXTS[:2]])


class StoreMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 4]),
        enabled=st.booleans(),
        algorithm=st.sampled_from(["sha256", "blake3"]),
        num_blocks=st.sampled_from([None, None, 3, 6, 12]),
        capacity=st.sampled_from([30, 100, 1000]),
        max_entries=st.integers(1, 8),
        ttl=st.sampled_from([5.0, 12.0, 1000.0]),
        min_prefix=st.integers(0, 5),
        pinned_share=st.sampled_from([0.0, 0.3, 0.5, 0.5, 1.0]),
    )
    def start(self, block_size, enabled, algorithm, num_blocks, capacity, max_entries, ttl, min_prefix,
              pinned_share):
        limits = StoreLimits(
            capacity_bytes=capacity, max_entries=max_entries, ttl_seconds=ttl, min_prefix=min_prefix,
            pinned_share=pinned_share,
        )
        apc = ApcSettings(enabled=enabled, block_size=block_size, num_blocks=num_blocks, algorithm=algorithm)
        self.store = PromptCacheStore(limits, apc)
        self.reference = Reference(limits, apc)
        self.now = 0.0
        self.payloads = 0

    def _insert(self, context, tokens, nbytes, retain=0.0):
        self.payloads += 1
        payload = f"payload-{self.payloads}"
        pinned_before = self._pinned()
        dropped_before = self.store.stats(self.now).pins_dropped
        outcome = self.store.insert(context, tokens, payload, nbytes, self.now, retain_seconds=retain)
        stored, reason, evictions = self.reference.insert(context, tokens, payload, nbytes, self.now, retain)
        assert (outcome.stored, outcome.reason) == (stored, reason)
        assert Counter(outcome.evictions) == Counter(evictions)
        if self.store.stats(self.now).pins_dropped == dropped_before:
            self._pins_held(pinned_before)

    def _pinned(self) -> dict[bytes, float]:
        return {info.entry_id: info.pinned_until for info in self.store.entries_by_recency()
                if info.pinned_until is not None and info.pinned_until > self.now}

    def _pins_held(self, pinned_before: dict[bytes, float]) -> None:
        """Independent of the reference: with no pin dropped, every entry pinned before is
        still there, pinned at least as long (a superseded one through its new owner)."""
        after = {info.entry_id: info.pinned_until for info in self.store.entries_by_recency()}
        for entry_id, until in pinned_before.items():
            if until > self.now:
                assert entry_id in after
                assert after[entry_id] is not None
                assert after[entry_id] >= until

    @rule(context=st.sampled_from(CONTEXTS), tokens=stored_lists, nbytes=st.integers(0, 20),
          retain=st.sampled_from([0.0, 0.0, 0.0, 3.0, 10.0, 100.0]))
    def insert(self, context, tokens, nbytes, retain):
        self._insert(context, tokens, nbytes, retain)

    @precondition(lambda self: self.reference.entries)
    @rule(data=st.data(), extra=token_lists, nbytes=st.integers(0, 20), same=st.booleans(),
          retain=st.sampled_from([0.0, 0.0, 3.0, 10.0, 100.0]))
    def insert_next_turn(self, data, extra, nbytes, same, retain):
        entry = data.draw(st.sampled_from(self.reference.entries))
        context = entry.context if same else data.draw(_neighbours(entry.context))
        self._insert(context, entry.tokens + tuple(extra), nbytes, retain)

    def _lookup(self, context, tokens, max_len):
        match = self.store.lookup(context, tokens, self.now, max_len=max_len)
        expected = self.reference.lookup(context, tokens, self.now, max_len)
        if expected is None:
            assert match is None
            return
        assert isinstance(match, Match)
        best, valid = expected
        assert match.matched_len == best
        chosen = {entry.entry_id: (entry, partial) for entry, partial in valid}
        assert match.entry_id in chosen
        entry, partial = chosen[match.entry_id]
        assert match.partial == partial
        if any(not partial for _, partial in valid):
            assert not match.partial  # whole-prefix matches win ties
        assert match.cross_session == (entry.context.session_key != context.session_key)
        assert match.entry_len == len(entry.tokens)
        owner = self.reference.find(entry.owner) if entry.owner else entry
        assert match.payload == owner.payload
        self.reference.touch(entry, self.now)
        self.reference.hits += 1
        self.reference.tokens_reused += best

    @precondition(lambda self: self.reference.entries)
    @rule(
        data=st.data(),
        probes=st.lists(
            st.tuples(
                token_lists,
                st.sampled_from([0, 0, 0, 1, 2, 5, 9]),
                st.sampled_from([None, 0, 1, 1, 3]),
                st.integers(0, 4),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def lookup(self, data, probes):
        for extra, cut, trim, near in probes:
            # Expire first (the store's lookup will too) so only live entries are drawn.
            self.reference.expire(self.now, [])
            entries = self.reference.entries
            if entries and near:
                # Near a stored entry: its tokens, perhaps cut short, then more.
                entry = data.draw(st.sampled_from(entries))
                context = data.draw(_neighbours(entry.context))
                tokens = entry.tokens[: max(len(entry.tokens) - cut, 0)] + tuple(extra)
            else:
                context = data.draw(st.sampled_from(CONTEXTS))
                tokens = tuple(extra)
            self._lookup(context, tokens, None if trim is None else len(tokens) - trim)

    @rule(seconds=st.sampled_from([0.0, 2.5, 6.0]))
    def expire(self, seconds):
        pinned_before = self._pinned()
        self.now += seconds
        out: list = []
        self.reference.expire(self.now, out)
        assert Counter(self.store.expire(self.now)) == Counter(out)
        self._pins_held(pinned_before)  # the TTL never ends a pin early

    @precondition(lambda self: len(self.reference.entries) >= 3)
    @rule()
    def reset(self):
        outcome = self.store.reset()
        assert (outcome.entries_freed, outcome.bytes_freed) == (
            len(self.reference.entries),
            self.reference.total_bytes(),
        )
        self.reference.entries.clear()
        self.reference.pins.clear()

    @invariant()
    def same_contents_and_stats(self):
        if not hasattr(self, "store"):
            return
        reference = self.reference
        # stats() expires too: keep both sides in step.
        reference.expire(self.now, [])
        stats = self.store.stats(self.now)
        limits = reference.limits
        assert stats.bytes == reference.total_bytes() <= limits.capacity_bytes
        assert stats.entries == len(reference.entries) <= limits.max_entries
        assert stats.aliases == sum(entry.owner is not None for entry in reference.entries)
        assert stats.unique_block_hashes == reference.unique_blocks() <= reference.block_cap
        assert stats.total_blocks_stored == sum(map(reference.num_blocks, reference.entries))
        assert stats.apc_active_entries == sum(reference.num_blocks(e) > 0 for e in reference.entries)
        assert (stats.hits, stats.misses, stats.tokens_reused) == (
            reference.hits,
            reference.misses,
            reference.tokens_reused,
        )
        assert (stats.inserts, stats.refusals, stats.duplicates) == (
            reference.inserts,
            reference.refusals,
            reference.duplicates,
        )
        assert {reason: count for reason, count in stats.evictions.items() if count} == dict(
            +reference.evictions
        )
        infos = self.store.entries_by_recency()
        assert [info.entry_id for info in infos] == [entry.entry_id for entry in reference.entries]
        for info, entry in zip(infos, reference.entries, strict=False):
            assert info.tokens == entry.tokens
            assert info.alias_of == entry.owner
            assert info.last_used == entry.last_used
            assert info.pinned_until == reference.pins.get(reference.root(entry))
        assert stats.pinned_entries == len(reference.pins)
        assert stats.pinned_bytes == reference.pinned_bytes() <= stats.pinned_capacity_bytes == reference.budget
        assert stats.pins_dropped == reference.pins_dropped


StoreMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
# A few seconds of examples: in the full suite, not the fast lane.
TestStoreAgainstReference = pytest.mark.slow(StoreMachine.TestCase)
