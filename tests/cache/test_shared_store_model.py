"""The store with shared payloads against a plain reference: sets of pieces and linear scans.

Payloads here are made as the device makes them: a new entry holds the
pieces of the entry it extended (cut where the two part) plus a piece of its
own. The reference counts unique bytes as the union of the live owners'
pieces, and evicts, under byte pressure, the least recently used owner that
holds a piece no other owner holds (a leaf), else the least recently used
owner.
"""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlxcel.cache.key import CacheContext, prefix_digest
from mlxcel.cache.store import ApcSettings, PromptCacheStore, SharedPayload, StoreLimits

BASE = CacheContext(model_id="m1", template_sig="t", session_key="a")
CONTEXTS = [BASE, attrs.evolve(BASE, session_key="b"), attrs.evolve(BASE, session_key="c"),
            attrs.evolve(BASE, model_id="m2")]


@attrs.frozen(eq=False)
class FakePiece:
    start: int
    length: int
    nbytes: int


@attrs.frozen(eq=False)
class FakePayload:
    """Pieces in token order covering ``length`` tokens (the last possibly in part)."""

    segments: tuple[FakePiece, ...]
    length: int

    def pieces(self) -> tuple[FakePiece, ...]:
        return self.segments

    @property
    def nbytes(self) -> int:
        return sum(piece.nbytes for piece in self.segments)

    def cut(self, num_tokens: int) -> tuple[FakePiece, ...]:
        return tuple(piece for piece in self.segments if piece.start < num_tokens)


@attrs.define
class RefEntry:
    entry_id: bytes
    context: CacheContext
    tokens: tuple[int, ...]
    payload: FakePayload | None
    owner: bytes | None = None


class Reference:
    def __init__(self, limits: StoreLimits) -> None:
        self.limits = limits
        self.entries: list[RefEntry] = []  # least recently used first
        self.evictions: Counter[str] = Counter()

    def owners(self) -> list[RefEntry]:
        return [entry for entry in self.entries if entry.owner is None]

    def held(self, excluding: RefEntry | None = None) -> dict[int, FakePiece]:
        return {id(piece): piece for entry in self.owners() if entry is not excluding
                for piece in entry.payload.segments}

    def unique_bytes(self) -> int:
        return sum(piece.nbytes for piece in self.held().values())

    def logical_bytes(self) -> int:
        return sum(entry.payload.nbytes for entry in self.owners())

    def frees(self, owner: RefEntry) -> int:
        others = self.held(excluding=owner)
        return sum(piece.nbytes for piece in {id(p): p for p in owner.payload.segments}.values()
                   if id(piece) not in others)

    def is_leaf(self, owner: RefEntry) -> bool:
        others = self.held(excluding=owner)
        return any(id(piece) not in others for piece in owner.payload.segments)

    def find(self, entry_id: bytes) -> RefEntry:
        return next(entry for entry in self.entries if entry.entry_id == entry_id)

    def touch(self, entry: RefEntry) -> None:
        for target in [entry] + ([self.find(entry.owner)] if entry.owner else []):
            self.entries.remove(target)
            self.entries.append(target)

    def evict(self, entry: RefEntry, reason: str, out: list) -> None:
        for alias in [other for other in self.entries if other.owner == entry.entry_id]:
            self.entries.remove(alias)
            out.append((reason, 0))
            self.evictions[reason] += 1
        freed = self.frees(entry) if entry.owner is None else 0
        self.entries.remove(entry)
        out.append((reason, freed))
        self.evictions[reason] += 1

    def insert(self, context, tokens, payload: FakePayload):
        out: list = []
        if len(tokens) < self.limits.min_prefix:
            return False, "too_short", out
        if payload.nbytes > self.limits.capacity_bytes:
            return False, "too_large", out
        entry_id = prefix_digest(context, tokens, len(tokens))
        for entry in self.entries:
            if entry.entry_id == entry_id:
                self.touch(entry)
                return False, "duplicate", out
        new = RefEntry(entry_id, context, tokens, payload)
        superseded = [entry for entry in self.owners() if entry.context == context
                      and len(entry.tokens) < len(tokens) and tokens[: len(entry.tokens)] == entry.tokens]
        self.entries.append(new)
        for older in superseded:
            out.append(("superseded", self.frees(older)))
            self.evictions["superseded"] += 1
            for alias in self.entries:
                if alias.owner == older.entry_id:
                    alias.owner = entry_id
            older.owner, older.payload = entry_id, None
        while len(self.entries) > self.limits.max_entries:
            self.evict(next(e for e in self.entries if e is not new), "lru", out)
        while self.unique_bytes() > self.limits.capacity_bytes:
            candidates = [e for e in self.owners() if e is not new]
            victim = next((e for e in candidates if self.is_leaf(e)), candidates[0])
            self.evict(victim, "lru", out)
        return True, None, out


class SharedStoreMachine(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([40, 100, 400]), max_entries=st.integers(2, 10),
                min_prefix=st.integers(0, 3))
    def start(self, capacity, max_entries, min_prefix):
        limits = StoreLimits(capacity_bytes=capacity, max_entries=max_entries, ttl_seconds=1e9,
                             min_prefix=min_prefix, pinned_share=0.0)
        self.store = PromptCacheStore(limits, ApcSettings(enabled=False))
        self.reference = Reference(limits)
        # Every payload ever made: a sequence may extend an entry evicted while it ran.
        self.made: list[tuple[CacheContext, tuple[int, ...], FakePayload]] = []

    def _insert(self, context, tokens, payload):
        outcome = self.store.insert(context, tokens, payload, payload.nbytes, 0.0)
        stored, reason, evictions = self.reference.insert(context, tokens, payload)
        assert (outcome.stored, outcome.reason) == (stored, reason)
        assert Counter(outcome.evictions) == Counter(evictions)
        self.made.append((context, tokens, payload))

    @rule(context=st.sampled_from(CONTEXTS), tokens=st.lists(st.integers(0, 2), min_size=3, max_size=12),
          nbytes=st.integers(0, 60))
    def insert_cold(self, context, tokens, nbytes):
        tokens = tuple(tokens)
        self._insert(context, tokens, FakePayload((FakePiece(0, len(tokens), nbytes),), len(tokens)))

    @precondition(lambda self: self.made)
    @rule(data=st.data(), cut=st.integers(0, 6), extra=st.lists(st.integers(0, 2), min_size=0, max_size=8),
          nbytes=st.integers(0, 30), same=st.booleans())
    def insert_extending(self, data, cut, extra, nbytes, same):
        """A sequence that adopted a prefix of an earlier payload donates it plus its own piece."""
        context, tokens, base = data.draw(st.sampled_from(self.made))
        if not same:
            context = attrs.evolve(context, session_key=data.draw(st.sampled_from("abc")))
        kept = max(len(tokens) - cut, 1)
        new_tokens = tokens[:kept] + tuple(extra)
        pieces = base.cut(kept)
        if len(new_tokens) > kept:
            pieces += (FakePiece(kept, len(new_tokens) - kept, nbytes),)
        self._insert(context, new_tokens, FakePayload(pieces, len(new_tokens)))

    @precondition(lambda self: self.reference.entries)
    @rule(data=st.data())
    def lookup(self, data):
        entry = data.draw(st.sampled_from(self.reference.entries))
        match = self.store.lookup(entry.context, entry.tokens + (9,), 0.0)
        assert match is not None
        assert match.matched_len == len(entry.tokens)
        owner = self.reference.find(entry.owner) if entry.owner else entry
        # The payload handed back is whole: every piece it holds is still counted by the store.
        assert match.payload is owner.payload
        assert isinstance(match.payload, SharedPayload)
        self.reference.touch(self.reference.find(match.entry_id))

    @rule(target_share=st.sampled_from([0.0, 0.5]))
    def shed(self, target_share):
        out: list = []
        target = int(self.reference.unique_bytes() * target_share)
        while self.reference.unique_bytes() > target and self.reference.owners():
            owners = self.reference.owners()
            victim = next((e for e in owners if self.reference.is_leaf(e)), owners[0])
            self.reference.evict(victim, "capacity", out)
        assert Counter(self.store.shed(target)) == Counter(out)

    @invariant()
    def same_contents_and_bytes(self):
        if not hasattr(self, "store"):
            return
        stats = self.store.stats(0.0)
        reference = self.reference
        assert stats.bytes == reference.unique_bytes() <= reference.limits.capacity_bytes
        assert stats.logical_bytes == reference.logical_bytes()
        assert stats.pieces == len(reference.held())
        assert [info.entry_id for info in self.store.entries_by_recency()] == [e.entry_id for e in reference.entries]
        assert {reason: count for reason, count in stats.evictions.items() if count} == dict(+reference.evictions)


SharedStoreMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
# A few seconds of examples: in the full suite, not the fast lane.
TestSharedStoreAgainstReference = pytest.mark.slow(SharedStoreMachine.TestCase)
