"""Retention pins in the prefix store: LRU and TTL pass pinned entries by, within a share of the budget."""

from __future__ import annotations

from mlxcel.cache.key import CacheContext
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

TEXT = CacheContext(model_id="model", template_sig="t" * 64, session_key="alice")


def _store(**limits) -> PromptCacheStore:
    defaults = {"capacity_bytes": 1000, "min_prefix": 8, "pinned_share": 0.5}
    return PromptCacheStore(StoreLimits(**(defaults | limits)), ApcSettings(enabled=False))


def _tokens(start: int, count: int = 20) -> list[int]:
    return list(range(start, start + count))


def _alive(store: PromptCacheStore, start: int, now: float) -> bool:
    return store.lookup(TEXT, _tokens(start, 21), now=now, record=False) is not None


def test_a_pinned_entry_survives_lru_pressure_an_unpinned_one_does_not() -> None:
    store = _store()
    pinned = store.insert(TEXT, _tokens(0), "pinned", 300, now=0, retain_seconds=3600)
    assert pinned.pinned_until == 3600
    store.insert(TEXT, _tokens(100), "control", 300, now=1)
    # Ten more 300-byte conversations through a 1000-byte budget, each more recent than both.
    for index in range(10):
        store.insert(TEXT, _tokens(1000 + 100 * index), f"other{index}", 300, now=2 + index)
    assert _alive(store, 0, now=20)
    assert not _alive(store, 100, now=20)
    stats = store.stats(now=20)
    assert (stats.pinned_entries, stats.pinned_bytes, stats.pinned_capacity_bytes) == (1, 300, 500)
    assert stats.bytes <= 1000


def test_past_the_share_the_soonest_ending_pins_are_dropped_first() -> None:
    store = _store()  # 500 pinned bytes at most
    store.insert(TEXT, _tokens(0), "long", 200, now=0, retain_seconds=86400)
    store.insert(TEXT, _tokens(100), "short", 200, now=1, retain_seconds=300)
    outcome = store.insert(TEXT, _tokens(200), "middle", 200, now=2, retain_seconds=3600)
    assert outcome.pinned_until == 3602
    infos = {info.tokens[0]: info.pinned_until for info in store.entries_by_recency()}
    # 600 pinned bytes would pass the 500-byte share: the pin ending soonest ("short") goes.
    assert infos == {0: 86400, 100: None, 200: 3602}
    stats = store.stats(now=3)
    assert (stats.pinned_entries, stats.pinned_bytes, stats.pins_dropped) == (2, 400, 1)
    # "short" is an ordinary LRU entry now: the next pressure evicts it, not the pinned ones.
    store.insert(TEXT, _tokens(300), "x", 400, now=4)
    store.insert(TEXT, _tokens(400), "y", 400, now=5)
    assert not _alive(store, 100, now=6)
    assert _alive(store, 0, now=6)
    assert _alive(store, 200, now=6)
    assert store.stats(now=6).bytes <= 1000


def test_a_new_short_pin_loses_to_longer_ones_already_filling_the_share() -> None:
    store = _store()
    store.insert(TEXT, _tokens(0), "a", 250, now=0, retain_seconds=3600)
    store.insert(TEXT, _tokens(100), "b", 250, now=0, retain_seconds=3600)
    outcome = store.insert(TEXT, _tokens(200), "c", 100, now=1, retain_seconds=300)
    assert outcome.stored
    assert outcome.pinned_until is None
    assert store.stats(now=1).pins_dropped == 1


def test_pins_end_by_the_store_clock_and_then_lru_applies() -> None:
    store = _store()
    store.insert(TEXT, _tokens(0), "pinned", 300, now=0, retain_seconds=300)
    store.insert(TEXT, _tokens(100), "b", 300, now=1)
    store.insert(TEXT, _tokens(200), "c", 300, now=2)
    assert store.stats(now=299.9).pinned_entries == 1
    assert store.stats(now=300).pinned_entries == 0  # ended exactly at now + retain_seconds
    store.insert(TEXT, _tokens(300), "d", 300, now=301)
    assert not _alive(store, 0, now=302)  # least recently used, and no longer pinned
    assert _alive(store, 100, now=302)


def test_the_ttl_never_removes_a_pinned_entry_before_its_pin_ends() -> None:
    store = _store(ttl_seconds=60)
    store.insert(TEXT, _tokens(0), "pinned", 100, now=0, retain_seconds=86400)
    store.insert(TEXT, _tokens(100), "plain", 100, now=0)
    assert store.expire(now=61) == (("ttl", 100),)
    assert _alive(store, 0, now=86399)
    # Once the pin has ended, an entry idle longer than the TTL expires like any other.
    assert store.expire(now=86400) == (("ttl", 100),)
    assert len(store) == 0


def test_a_retaining_duplicate_or_longer_prefix_extends_the_pin() -> None:
    store = _store()
    first = store.insert(TEXT, _tokens(0), "prompt", 100, now=0, retain_seconds=300)
    again = store.insert(TEXT, _tokens(0), "again", 100, now=100, retain_seconds=300)
    assert again.reason == "duplicate"
    assert again.pinned_until == 400
    # A shorter retention never shortens a pin.
    assert store.insert(TEXT, _tokens(0), "x", 100, now=101, retain_seconds=10).pinned_until == 400
    longer = store.insert(TEXT, _tokens(0, 30), "reply", 150, now=200, retain_seconds=3600)
    assert longer.pinned_until == 3800
    infos = {info.entry_id: info for info in store.entries_by_recency()}
    # The superseded prompt is an alias, pinned through its new owner.
    assert infos[first.entry_id].alias_of == longer.entry_id
    assert infos[first.entry_id].pinned_until == 3800
    stats = store.stats(now=201)
    assert (stats.pinned_entries, stats.pinned_bytes) == (1, 150)


def test_an_entry_that_supersedes_a_pinned_one_inherits_its_pin() -> None:
    store = _store()
    store.insert(TEXT, _tokens(0), "prompt", 100, now=0, retain_seconds=3600)
    # The healthy completion's donation carries no retention of its own here.
    reply = store.insert(TEXT, _tokens(0, 30), "reply", 150, now=5, prompt_len=20)
    assert reply.pinned_until == 3600
    # An entry covering the prompt but not the old reply's tail drops it and keeps the pin too.
    turn = store.insert(TEXT, _tokens(0, 25) + _tokens(500, 10), "next turn", 170, now=9, prompt_len=35)
    assert ("superseded", 150) in turn.evictions
    assert turn.pinned_until == 3600
    assert store.stats(now=10).pinned_bytes == 170


def test_an_entry_larger_than_the_pinned_share_is_stored_unpinned() -> None:
    store = _store()
    outcome = store.insert(TEXT, _tokens(0), "big", 600, now=0, retain_seconds=3600)
    assert outcome.stored
    assert outcome.pinned_until is None
    assert outcome.pin_too_large
    stats = store.stats(now=0)
    assert (stats.pinned_entries, stats.pinned_bytes, stats.pins_dropped) == (0, 0, 1)


def test_a_share_of_zero_pins_nothing_and_reports_nothing() -> None:
    store = _store(pinned_share=0.0)
    outcome = store.insert(TEXT, _tokens(0), "a", 100, now=0, retain_seconds=3600)
    assert outcome.pinned_until is None
    assert not outcome.pin_too_large
    assert store.stats(now=0).pins_dropped == 0


def test_the_budget_holds_even_when_pins_must_give_way_to_an_unpinned_entry() -> None:
    store = _store(pinned_share=1.0)
    store.insert(TEXT, _tokens(0), "a", 400, now=0, retain_seconds=100)
    store.insert(TEXT, _tokens(100), "b", 400, now=1, retain_seconds=200)
    # 800 pinned bytes leave 200: a 500-byte entry is kept by giving up the pin ending soonest.
    outcome = store.insert(TEXT, _tokens(200), "c", 500, now=2)
    assert outcome.stored
    assert outcome.evictions == (("lru", 400),)
    assert not _alive(store, 0, now=3)
    assert _alive(store, 100, now=3)
    assert _alive(store, 200, now=3)
    stats = store.stats(now=3)
    assert stats.bytes == 900
    assert stats.pins_dropped == 1
    assert stats.pinned_bytes == 400


def test_the_entry_count_limit_passes_pinned_entries_by() -> None:
    store = _store(max_entries=2)
    store.insert(TEXT, _tokens(0), "pinned", 10, now=0, retain_seconds=3600)
    store.insert(TEXT, _tokens(100), "b", 10, now=1)
    store.insert(TEXT, _tokens(200), "c", 10, now=2)
    assert _alive(store, 0, now=3)
    assert not _alive(store, 100, now=3)


def test_reset_clears_pins_and_shedding_takes_pinned_entries_last() -> None:
    store = _store()
    store.insert(TEXT, _tokens(0), "pinned", 300, now=0, retain_seconds=3600)
    store.insert(TEXT, _tokens(100), "plain", 300, now=1)
    store.shed(300)
    assert _alive(store, 0, now=2)
    assert not _alive(store, 100, now=2)
    store.shed(0)  # out of memory: pins do not hold off memory pressure
    assert len(store) == 0
    assert store.stats(now=2).pinned_bytes == 0
    store.insert(TEXT, _tokens(0), "pinned", 300, now=3, retain_seconds=3600)
    assert store.reset().entries_freed == 1
    stats = store.stats(now=4)
    assert (stats.pinned_entries, stats.pinned_bytes) == (0, 0)
