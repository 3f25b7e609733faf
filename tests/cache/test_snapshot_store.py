"""The session snapshot store: prefix-indexed snapshots, two tiers, supersession, refusals, budgets."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlxcel.cache.key import CacheContext
from mlxcel.cache.snapshots import RefusalCause, SnapshotHit, SnapshotLimits, SnapshotRefused, SnapshotStore


def context(session: str = "alice", template: str = "t1", **changes) -> CacheContext:
    return CacheContext(model_id="m", template_sig=template, session_key=session, **changes)


def store(capacity: int = 1000, **changes) -> SnapshotStore:
    changes.setdefault("refusal_min_common", 2)
    return SnapshotStore(SnapshotLimits(capacity_bytes=capacity, **changes))


def test_a_prompt_extending_a_snapshot_restores_it() -> None:
    snapshots = store()
    assert snapshots.insert(context(), [1, 2, 3, 4], "state", 100, now=0.0)
    hit = snapshots.lookup(context(), [1, 2, 3, 4, 5, 6], now=1.0)
    assert hit == SnapshotHit(payload="state", num_tokens=4)
    # Another session reaches it through the second tier.
    assert snapshots.lookup(context("bob"), [1, 2, 3, 4, 5], now=1.0) == SnapshotHit(
        payload="state", num_tokens=4, cross_session=True)
    assert snapshots.lookup(context("bob"), [1, 2, 3, 4, 5], now=1.0, cross_session=False) is None


def test_own_session_first_and_another_only_when_strictly_longer() -> None:
    snapshots = store()
    snapshots.insert(context("alice"), [1, 2, 3], "alice", 10, now=0.0)
    snapshots.insert(context("bob"), [1, 2, 3], "bob", 10, now=0.0)
    snapshots.insert(context("carol"), [1, 2, 3, 4, 5], "carol", 10, now=0.0)
    assert snapshots.lookup(context("alice"), [1, 2, 3, 9], now=1.0).payload == "alice"
    assert snapshots.lookup(context("bob"), [1, 2, 3, 4, 5, 6], now=1.0).payload == "carol"


def test_siblings_coexist_and_a_newer_snapshot_supersedes_its_ancestors() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2], "system", 10, now=0.0, checkpoint=True)
    snapshots.insert(context(), [1, 2, 3, 4], "a1", 20, now=1.0)
    snapshots.insert(context(), [1, 2, 7, 8], "b1", 20, now=2.0)
    snapshots.insert(context(), [1, 2, 3, 4, 5, 6], "a2", 30, now=3.0)
    payloads = {info.tokens: info.checkpoint for info in snapshots.entries_by_recency()}
    # a1 went (a2 extends it); the checkpoint and the sibling b1 stay.
    assert payloads == {(1, 2): True, (1, 2, 7, 8): False, (1, 2, 3, 4, 5, 6): False}
    stats = snapshots.stats(now=3.0)
    assert (stats.entries, stats.bytes, stats.checkpoints, stats.sessions) == (3, 60, 1, 1)
    assert stats.evictions == {"superseded": 1}
    assert snapshots.lookup(context(), [1, 2, 7, 8, 9], now=4.0).payload == "b1"
    assert snapshots.lookup(context(), [1, 2, 9], now=4.0).payload == "system"
    # Another session's snapshot is never superseded.
    snapshots.insert(context("bob"), [1, 2, 7, 8, 9, 10], "bob", 5, now=5.0)
    assert snapshots.lookup(context(), [1, 2, 7, 8, 0], now=6.0).payload == "b1"


def test_the_same_tokens_again_replace_the_snapshot() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2, 3], "old", 10, now=0.0, checkpoint=True)
    snapshots.insert(context(), [1, 2, 3], "new", 12, now=1.0)
    (info,) = snapshots.entries_by_recency()
    assert (info.nbytes, info.checkpoint) == (12, True)
    assert snapshots.take_released() == ["old"]


def test_divergent_requests_are_refused_by_cause() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2, 3, 4], "state", 100, now=0.0)
    rewritten = snapshots.lookup(context(), [1, 2, 9, 4, 5], now=1.0)
    assert rewritten == SnapshotRefused(cause=RefusalCause.HISTORY_REWRITTEN, snapshot_tokens=4, common_tokens=2)
    assert snapshots.lookup(context(), [1, 2, 3], now=1.0).cause is RefusalCause.TOO_SHORT
    assert snapshots.lookup(context(), [1, 2, 3, 4], now=1.0).cause is RefusalCause.TOO_SHORT
    assert snapshots.lookup(context(template="t2"), [1, 2, 3, 4, 5], now=1.0).cause is RefusalCause.TEMPLATE_CHANGED
    assert snapshots.lookup(context(mm_digest=b"\x01" * 32), [1, 2, 3, 4, 5], now=1.0).cause is RefusalCause.MULTIMODAL
    # Sharing less than refusal_min_common tokens: a new conversation, a plain miss.
    assert snapshots.lookup(context(), [1, 9, 9, 9, 9], now=1.0) is None
    assert snapshots.lookup(context("bob"), [1, 2, 9, 4, 5], now=1.0) is None
    stats = snapshots.stats(now=1.0)
    assert stats.refusals == {"history_rewritten": 1, "too_short": 2, "template_changed": 1, "multimodal": 1}
    assert (stats.hits, stats.misses) == (0, 2)


def test_cuttable_snapshots_resume_at_the_longest_common_prefix() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2, 3, 4, 5, 6], "window", 60, now=0.0, cuttable=True)
    snapshots.insert(context(), [1, 2], "system", 20, now=0.0, checkpoint=True)
    hit = snapshots.lookup(context(), [1, 2, 3, 4, 9, 9], now=1.0)
    assert hit == SnapshotHit(payload="window", num_tokens=4, partial=True)
    # A prompt that ends inside it resumes one token short of its end.
    assert snapshots.lookup(context(), [1, 2, 3, 4, 5], now=1.0).num_tokens == 4
    assert snapshots.lookup(context(), [1, 2, 3, 4, 5, 6], now=1.0).num_tokens == 5
    # A whole snapshot of equal length wins over a cut.
    snapshots.insert(context(), [1, 2, 3, 4], "whole", 40, now=2.0)
    assert snapshots.lookup(context(), [1, 2, 3, 4, 8], now=3.0) == SnapshotHit(payload="whole", num_tokens=4)
    assert snapshots.stats(now=3.0).partial_hits == 3


def test_budget_ttl_and_oversize() -> None:
    snapshots = store(capacity=250, ttl_seconds=10.0)
    assert not snapshots.insert(context("huge"), [1], "x", 251, now=0.0)
    snapshots.insert(context("a"), [1, 2], "a", 100, now=0.0)
    snapshots.insert(context("b"), [1, 3], "b", 100, now=1.0)
    snapshots.lookup(context("a"), [1, 2, 3], now=2.0)  # a is now the most recent
    snapshots.insert(context("c"), [1, 4], "c", 100, now=3.0)
    assert snapshots.lookup(context("b"), [1, 3, 3], now=3.0) is None  # least recently used went
    assert snapshots.stats(now=3.0).evictions == {"lru": 1}
    assert snapshots.lookup(context("a"), [1, 2, 3], now=12.5) is None  # idle > 10 s
    assert snapshots.stats(now=12.5).evictions == {"lru": 1, "ttl": 1}  # a idled 10.5 s, c only 9.5 s


# --- the store against a plain model -------------------------------------------------------

SESSIONS = "abc"


class PlainSnapshots:
    """Every rule written as plainly as possible: a list in LRU order and linear scans."""

    def __init__(self, capacity: int, max_entries: int, ttl: float) -> None:
        self.capacity, self.max_entries, self.ttl = capacity, max_entries, ttl
        self.entries: list[dict] = []  # least recently used first

    def expire(self, now: float) -> None:
        self.entries = [entry for entry in self.entries if now - entry["last_used"] <= self.ttl]

    def insert(self, session: str, tokens: tuple[int, ...], payload: str, nbytes: int, now: float,
               checkpoint: bool) -> None:
        self.expire(now)
        if nbytes > self.capacity:
            return
        kept = []
        for entry in self.entries:
            same_path = entry["session"] == session and tokens[: len(entry["tokens"])] == entry["tokens"]
            if same_path and len(entry["tokens"]) == len(tokens):
                checkpoint = checkpoint or entry["checkpoint"]
            elif not (same_path and not entry["checkpoint"]):
                kept.append(entry)
        self.inserted = getattr(self, "inserted", 0) + 1
        kept.append({"session": session, "tokens": tokens, "payload": payload, "nbytes": nbytes,
                     "last_used": now, "checkpoint": checkpoint, "inserted": self.inserted})
        while sum(entry["nbytes"] for entry in kept) > self.capacity or len(kept) > self.max_entries:
            kept.pop(0)
        self.entries = kept

    def lookup(self, session: str, tokens: tuple[int, ...], now: float) -> tuple[str, int] | None:
        self.expire(now)

        def best(entries: list[dict]) -> dict | None:
            usable = [entry for entry in entries
                      if len(entry["tokens"]) < len(tokens) and tokens[: len(entry["tokens"])] == entry["tokens"]]
            # Between equal tokens (other sessions), the one stored first, as the trie keeps them.
            return max(usable, key=lambda entry: (len(entry["tokens"]), -entry["inserted"]), default=None)

        own = best([entry for entry in self.entries if entry["session"] == session])
        other = best(self.entries)
        found = own
        if other is not None and (own is None or len(other["tokens"]) > len(own["tokens"])):
            found = other
        if found is None:
            return None
        found["last_used"] = now
        self.entries.remove(found)
        self.entries.append(found)
        return found["payload"], len(found["tokens"])


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = store(capacity=500, max_entries=4, ttl_seconds=50.0)
        self.model = PlainSnapshots(capacity=500, max_entries=4, ttl=50.0)
        self.now = 0.0
        self.counter = 0

    @rule(session=st.sampled_from(SESSIONS), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=7),
          nbytes=st.integers(1, 300), checkpoint=st.booleans())
    def insert(self, session: str, tokens: list[int], nbytes: int, checkpoint: bool) -> None:
        self.counter += 1
        payload = f"{session}{self.counter}"
        self.store.insert(context(session), tokens, payload, nbytes, self.now, checkpoint=checkpoint)
        self.model.insert(session, tuple(tokens), payload, nbytes, self.now, checkpoint)

    @rule(session=st.sampled_from(SESSIONS), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def lookup(self, session: str, tokens: list[int]) -> None:
        result = self.store.lookup(context(session), tokens, self.now)
        expected = self.model.lookup(session, tuple(tokens), self.now)
        if expected is None:
            assert not isinstance(result, SnapshotHit)
        else:
            assert isinstance(result, SnapshotHit)
            assert (result.payload, result.num_tokens) == expected

    @rule(seconds=st.floats(0, 40))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def same_entries_in_the_same_order(self) -> None:
        stats = self.store.stats(self.now)
        self.model.expire(self.now)
        assert stats.bytes <= 500
        assert stats.entries <= 4
        assert stats.remaining_bytes == 500 - stats.bytes
        assert stats.bytes == sum(entry["nbytes"] for entry in self.model.entries)
        # Least recently used first, in both: eviction order is LRU.
        got = [(info.session_key, info.tokens, info.checkpoint) for info in self.store.entries_by_recency()]
        want = [(entry["session"], entry["tokens"], entry["checkpoint"]) for entry in self.model.entries]
        assert got == want


# A few seconds of examples: in the full suite, not the fast lane.
TestSnapshotMachine = pytest.mark.slow(SnapshotMachine.TestCase)
TestSnapshotMachine.settings = settings(max_examples=80, deadline=None, stateful_step_count=40)
