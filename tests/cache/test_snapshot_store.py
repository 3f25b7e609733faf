"""The session snapshot store: one live snapshot per session, refusals by cause, budgets, TTL."""

from __future__ import annotations

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from mlxcel.cache.key import CacheContext
from mlxcel.cache.snapshots import RefusalCause, SnapshotHit, SnapshotLimits, SnapshotRefused, SnapshotStore


def context(session: str = "alice", template: str = "t1", **changes) -> CacheContext:
    return CacheContext(model_id="m", template_sig=template, session_key=session, **changes)


def store(capacity: int = 1000, **changes) -> SnapshotStore:
    return SnapshotStore(SnapshotLimits(capacity_bytes=capacity, **changes))


def test_a_prompt_extending_the_snapshot_restores_it() -> None:
    snapshots = store()
    assert snapshots.insert(context(), [1, 2, 3, 4], "state", 100, now=0.0)
    hit = snapshots.lookup(context(), [1, 2, 3, 4, 5, 6], now=1.0)
    assert hit == SnapshotHit(payload="state", num_tokens=4)
    assert snapshots.lookup(context("bob"), [1, 2, 3, 4, 5], now=1.0) is None


def test_divergent_requests_are_refused_by_cause() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2, 3, 4], "state", 100, now=0.0)
    rewritten = snapshots.lookup(context(), [1, 9, 3, 4, 5], now=1.0)
    assert rewritten == SnapshotRefused(cause=RefusalCause.HISTORY_REWRITTEN, snapshot_tokens=4, common_tokens=1)
    assert snapshots.lookup(context(), [1, 2], now=1.0).cause is RefusalCause.TOO_SHORT
    assert snapshots.lookup(context(), [1, 2, 3, 4], now=1.0).cause is RefusalCause.TOO_SHORT
    assert snapshots.lookup(context(template="t2"), [1, 2, 3, 4, 5], now=1.0).cause is RefusalCause.TEMPLATE_CHANGED
    assert snapshots.lookup(context(mm_digest=b"\x01" * 32), [1, 2, 3, 4, 5], now=1.0).cause is RefusalCause.MULTIMODAL
    stats = snapshots.stats(now=1.0)
    assert stats.refusals == {"history_rewritten": 1, "too_short": 2, "template_changed": 1, "multimodal": 1}
    assert stats.hits == 0
    assert stats.misses == 0


def test_a_newer_snapshot_supersedes_the_session_chain() -> None:
    snapshots = store()
    snapshots.insert(context(), [1, 2], "turn1", 100, now=0.0)
    snapshots.insert(context(), [1, 2, 3, 4], "turn2", 150, now=1.0)
    stats = snapshots.stats(now=1.0)
    assert stats.entries == 1
    assert stats.bytes == 150
    assert stats.remaining_bytes == 850
    assert snapshots.lookup(context(), [1, 2, 3, 4, 5], now=2.0).payload == "turn2"


def test_budget_ttl_and_oversize() -> None:
    snapshots = store(capacity=250, ttl_seconds=10.0)
    assert not snapshots.insert(context("huge"), [1], "x", 251, now=0.0)
    snapshots.insert(context("a"), [1, 2], "a", 100, now=0.0)
    snapshots.insert(context("b"), [1, 2], "b", 100, now=1.0)
    snapshots.lookup(context("a"), [1, 2, 3], now=2.0)  # a is now the most recent
    snapshots.insert(context("c"), [1, 2], "c", 100, now=3.0)
    assert snapshots.lookup(context("b"), [1, 2, 3], now=3.0) is None  # least recently used went
    assert snapshots.stats(now=3.0).evictions == {"lru": 1}
    assert snapshots.lookup(context("a"), [1, 2, 3], now=12.5) is None  # idle > 10 s
    assert snapshots.stats(now=12.5).evictions["ttl"] >= 1


class SnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = store(capacity=500, max_entries=3, ttl_seconds=50.0)
        self.now = 0.0

    @rule(session=st.sampled_from("abcde"), length=st.integers(1, 8), nbytes=st.integers(1, 300))
    def insert(self, session: str, length: int, nbytes: int) -> None:
        self.store.insert(context(session), list(range(length)), session, nbytes, self.now)

    @rule(session=st.sampled_from("abcde"), length=st.integers(1, 10))
    def lookup(self, session: str, length: int) -> None:
        result = self.store.lookup(context(session), list(range(length)), self.now)
        if isinstance(result, SnapshotHit):
            assert result.payload == session
            assert result.num_tokens < length

    @rule(seconds=st.floats(0, 40))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @invariant()
    def budgets_hold(self) -> None:
        stats = self.store.stats(self.now)
        assert stats.bytes <= 500
        assert stats.entries <= 3
        assert stats.remaining_bytes == 500 - stats.bytes
        # One live snapshot per session: the entries' payloads name distinct sessions.
        payloads = [entry.payload for entry in self.store._entries.values()]
        assert len(payloads) == len(set(payloads))


TestSnapshotMachine = SnapshotMachine.TestCase
TestSnapshotMachine.settings = settings(max_examples=60, deadline=None, stateful_step_count=30)
