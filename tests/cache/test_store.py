"""The prefix store: tiers, APC, multimodal, rope regimes, aliases, eviction."""

from __future__ import annotations

import attrs
import pytest

from mlxcel.cache.key import CacheContext, RopeRegime
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

TEXT = CacheContext(model_id="model", template_sig="t" * 64, session_key="alice")
BOB = attrs.evolve(TEXT, session_key="bob")
IMAGE = attrs.evolve(TEXT, mm_digest=bytes(range(32)))


def _store(**limits) -> PromptCacheStore:
    apc = limits.pop("apc", ApcSettings())
    defaults = {"capacity_bytes": 10_000, "min_prefix": 8}
    return PromptCacheStore(StoreLimits(**(defaults | limits)), apc)


def _tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


SHARED = _tokens(1000, 100)


def test_whole_prefix_hit_and_miss_counters() -> None:
    store = _store()
    assert store.insert(TEXT, _tokens(0, 40), "kv", 100, now=0).stored
    match = store.lookup(TEXT, _tokens(0, 50), now=1, max_len=49)
    assert match is not None
    assert (match.matched_len, match.entry_len, match.partial, match.cross_session) == (40, 40, False, False)
    assert match.payload == "kv"
    assert store.lookup(TEXT, _tokens(500, 50), now=2) is None
    stats = store.stats(now=2)
    assert (stats.hits, stats.misses, stats.tokens_reused) == (1, 1, 40)


def test_max_len_caps_a_whole_prefix_match() -> None:
    store = _store()
    store.insert(TEXT, _tokens(0, 40), "kv", 100, now=0)
    match = store.lookup(TEXT, _tokens(0, 40), now=1, max_len=39)
    assert match is not None
    assert (match.matched_len, match.partial) == (39, False)
    assert store.lookup(TEXT, _tokens(0, 40), now=1, max_len=7) is None  # below min_prefix


def test_apc_partial_match_reaches_the_exact_divergence() -> None:
    """The block chains confirm the shared blocks; the trie gives the token where the entry parts."""
    store = _store()
    store.insert(TEXT, SHARED + _tokens(1, 20), "kv", 100, now=0)
    request = SHARED + _tokens(500, 20)
    match = store.lookup(TEXT, request, now=1, max_len=len(request) - 1)
    assert match is not None
    assert (match.matched_len, match.entry_len, match.partial) == (100, 120, True)


def test_partial_match_is_capped_exactly() -> None:
    store = _store()
    store.insert(TEXT, SHARED + _tokens(1, 20), "kv", 100, now=0)
    match = store.lookup(TEXT, SHARED + _tokens(500, 20), now=1, max_len=90)
    assert match is not None
    assert match.matched_len == 90
    # A request that is a strict prefix of a longer entry is a partial match too.
    match = store.lookup(TEXT, SHARED[:50], now=1, max_len=49)
    assert match is not None
    assert (match.matched_len, match.partial) == (49, True)


def test_partial_match_without_a_block_chain_rounds_down_to_agreeing_blocks() -> None:
    """Past the blocks an entry's chain covers (the APC block cap), the reuse stops at a block."""
    store = _store(apc=ApcSettings(num_blocks=3))
    store.insert(TEXT, SHARED + _tokens(1, 20), "kv", 100, now=0)
    match = store.lookup(TEXT, SHARED + _tokens(500, 20), now=1)
    assert match is not None
    assert (match.matched_len, match.partial) == (48, True)


def test_apc_off_diverging_entry_is_a_miss() -> None:
    store = _store(apc=ApcSettings(enabled=False))
    store.insert(TEXT, SHARED + _tokens(1, 20), "kv", 100, now=0)
    assert store.lookup(TEXT, SHARED + _tokens(500, 20), now=1) is None
    stats = store.stats(now=1)
    assert (stats.apc_enabled, stats.total_blocks_stored, stats.apc_active_entries) == (False, 0, 0)


def test_multimodal_needs_a_whole_entry() -> None:
    store = _store()
    store.insert(IMAGE, SHARED + _tokens(1, 20), "kv", 100, now=0)
    # Diverging: no APC for multimodal requests.
    assert store.lookup(IMAGE, SHARED + _tokens(500, 20), now=1) is None
    # The whole entry plus new text: adopted.
    extended = SHARED + _tokens(1, 20) + [7, 7, 7]
    match = store.lookup(IMAGE, extended, now=1, max_len=len(extended) - 1)
    assert match is not None
    assert match.matched_len == 120
    # The same prompt again: a capped match would not cover the entry.
    same = SHARED + _tokens(1, 20)
    assert store.lookup(IMAGE, same, now=1, max_len=len(same) - 1) is None
    # A text request never sees multimodal entries, nor the reverse.
    assert store.lookup(TEXT, extended, now=1) is None


def test_multimodal_falls_back_to_a_shorter_whole_entry() -> None:
    store = _store()
    store.insert(IMAGE, SHARED[:60], "short", 10, now=0)
    store.insert(attrs.evolve(IMAGE, session_key="carol"), SHARED, "long", 10, now=0)
    match = store.lookup(IMAGE, SHARED, now=1, max_len=99)
    assert match is not None
    assert (match.payload, match.matched_len) == ("short", 60)


def test_rope_regimes_do_not_share() -> None:
    store = _store()
    short = attrs.evolve(TEXT, rope_regime=RopeRegime.SHORT)
    long = attrs.evolve(TEXT, rope_regime=RopeRegime.LONG)
    store.insert(short, SHARED, "kv", 10, now=0)
    assert store.lookup(long, SHARED + [1], now=1) is None
    assert store.lookup(TEXT, SHARED + [1], now=1) is None
    assert store.lookup(short, SHARED + [1], now=1) is not None


def test_buckets_and_salts_do_not_share() -> None:
    store = _store()
    store.insert(TEXT, SHARED, "kv", 10, now=0)
    for change in ({"model_id": "other"}, {"lora_id": "x"}, {"template_sig": "u" * 64}, {"cache_salt": "t1"}):
        assert store.lookup(attrs.evolve(TEXT, **change), SHARED + [1], now=1) is None
    salted = attrs.evolve(TEXT, cache_salt="t1")
    store.insert(salted, SHARED, "salted", 10, now=2)
    match = store.lookup(attrs.evolve(salted, session_key="bob"), SHARED + [1], now=3)
    assert match is not None
    assert match.payload == "salted"
    assert match.cross_session


def test_two_tiers_cross_session_only_when_strictly_longer() -> None:
    store = _store()
    store.insert(TEXT, SHARED[:50], "alice-50", 10, now=0)
    store.insert(BOB, SHARED[:50], "bob-50", 10, now=0)
    store.insert(BOB, SHARED[:80], "bob-80", 10, now=0)
    # Bob's 80 is strictly longer than Alice's own 50: cross-session wins.
    match = store.lookup(TEXT, SHARED, now=1, max_len=99)
    assert match is not None
    assert (match.payload, match.cross_session) == ("bob-80", True)
    # Capped at 50, both tie: Alice keeps her own entry.
    match = store.lookup(TEXT, SHARED, now=1, max_len=50)
    assert match is not None
    assert (match.payload, match.cross_session) == ("alice-50", False)
    # A session with nothing of its own takes the best of the others.
    match = store.lookup(attrs.evolve(TEXT, session_key="dave"), SHARED, now=1, max_len=99)
    assert match is not None
    assert match.matched_len == 80
    assert match.cross_session


def test_in_session_partial_beats_shorter_cross_session_whole() -> None:
    store = _store()
    store.insert(TEXT, SHARED + _tokens(1, 20), "alice", 10, now=0)
    store.insert(BOB, SHARED[:40], "bob", 10, now=0)
    match = store.lookup(TEXT, SHARED + _tokens(500, 20), now=1)
    assert match is not None
    assert (match.payload, match.matched_len, match.partial) == ("alice", 100, True)


def test_whole_prefix_preferred_over_equal_partial() -> None:
    store = _store()
    # Longest first, so the shorter one is not superseded into an alias.
    store.insert(TEXT, SHARED + [1], "diverging", 10, now=0)
    store.insert(TEXT, SHARED[:96], "whole", 10, now=0)
    match = store.lookup(TEXT, SHARED[:96] + [5, 6], now=1)
    assert match is not None
    assert (match.payload, match.matched_len, match.partial) == ("whole", 96, False)
    # One shared token more and the diverging entry is the longer match.
    match = store.lookup(TEXT, SHARED[:97] + [5, 6], now=1)
    assert match is not None
    assert (match.payload, match.matched_len, match.partial) == ("diverging", 97, True)


def test_refusals_and_duplicates() -> None:
    store = _store(capacity_bytes=1000)
    outcome = store.insert(TEXT, _tokens(0, 7), "kv", 10, now=0)
    assert (outcome.stored, outcome.reason) == (False, "too_short")
    outcome = store.insert(TEXT, _tokens(0, 20), "kv", 1001, now=0)
    assert (outcome.stored, outcome.reason) == (False, "too_large")
    first = store.insert(TEXT, _tokens(0, 20), "kv", 100, now=0)
    again = store.insert(TEXT, _tokens(0, 20), "kv-again", 100, now=5)
    assert (again.stored, again.reason, again.entry_id) == (False, "duplicate", first.entry_id)
    stats = store.stats(now=5)
    assert (stats.entries, stats.bytes, stats.inserts, stats.refusals, stats.duplicates) == (1, 100, 1, 2, 1)
    assert store.entries_by_recency()[0].last_used == 5


def test_superseded_entry_becomes_a_free_alias() -> None:
    store = _store()
    turn_one = SHARED[:40]
    turn_two = SHARED[:70]
    first = store.insert(TEXT, turn_one, "kv-1", 400, now=0)
    second = store.insert(TEXT, turn_two, "kv-2", 700, now=1)
    assert second.evictions == (("superseded", 400),)
    stats = store.stats(now=1)
    assert (stats.entries, stats.bytes, stats.aliases, stats.evictions["superseded"]) == (2, 700, 1, 1)
    # The alias serves its own length from the newer payload.
    match = store.lookup(TEXT, turn_one + [9, 9], now=2)
    assert match is not None
    assert (match.entry_id, match.payload, match.matched_len) == (first.entry_id, "kv-2", 40)
    # A third turn moves both older entries under the newest.
    third = store.insert(TEXT, SHARED, "kv-3", 1000, now=3)
    infos = {info.entry_id: info for info in store.entries_by_recency()}
    assert infos[first.entry_id].alias_of == third.entry_id
    assert infos[second.entry_id].alias_of == third.entry_id
    assert store.stats(now=3).bytes == 1000
    # Evicting the owner takes its aliases with it.
    store.insert(BOB, _tokens(5000, 40), "other", 9500, now=4)
    stats = store.stats(now=4)
    assert (stats.entries, stats.bytes, stats.aliases) == (1, 9500, 0)


def test_an_entry_whose_whole_prompt_a_newer_entry_covers_is_dropped() -> None:
    """A reply re-rendered differently next turn leaves the old entry only its useless tail."""
    store = _store()
    system, first_user, reply, rerendered = SHARED[:40], _tokens(2000, 10), _tokens(3000, 8), _tokens(4000, 8)
    old_prompt = system + first_user
    old = store.insert(TEXT, old_prompt + reply, "old", 580, now=0, prompt_len=len(old_prompt))
    # Another conversation in the session shares only the system prompt: it keeps its entry.
    other = store.insert(TEXT, system + _tokens(5000, 18), "other", 580, now=1, prompt_len=50)
    # Without a prompt length an entry is never judged this way.
    unknown = store.insert(TEXT, system + _tokens(6000, 18), "unknown", 580, now=2)
    new_prompt = old_prompt + rerendered + _tokens(7000, 20)
    outcome = store.insert(TEXT, new_prompt + _tokens(8000, 5), "new", 830, now=3, prompt_len=len(new_prompt))
    assert outcome.stored
    assert outcome.evictions == (("superseded", 580),)
    assert store.take_released() == ["old"]
    live = {info.entry_id for info in store.entries_by_recency()}
    assert live == {other.entry_id, unknown.entry_id, outcome.entry_id}
    assert old.entry_id not in live
    # The old conversation's next turn finds its previous prompt in the newer entry.
    match = store.lookup(TEXT, new_prompt + [1, 2], now=4)
    assert match is not None
    assert (match.payload, match.matched_len) == ("new", len(new_prompt))


def test_an_entry_parted_from_at_its_prompts_last_token_is_dropped_too() -> None:
    """The reply's first characters merge with the prompt's last token when re-rendered (BPE)."""
    store = _store()
    old_prompt, reply = SHARED[:50], _tokens(3000, 8)
    old = store.insert(TEXT, old_prompt + reply, "old", 580, now=0, prompt_len=len(old_prompt))
    new_prompt = old_prompt[:-1] + _tokens(4000, 30)
    outcome = store.insert(TEXT, new_prompt + _tokens(8000, 5), "new", 830, now=1, prompt_len=len(new_prompt))
    assert outcome.evictions == (("superseded", 580),)
    # A resend of the old prompt is capped one token short: the newer entry serves all of it.
    match = store.lookup(TEXT, old_prompt, now=2, max_len=len(old_prompt) - 1)
    assert match is not None
    assert (match.payload, match.matched_len) == ("new", len(old_prompt) - 1)
    assert old.entry_id not in {info.entry_id for info in store.entries_by_recency()}
    # Two tokens short is another branch: it stays.
    kept = store.insert(TEXT, SHARED[:60] + reply, "kept", 580, now=3, prompt_len=60)
    store.insert(TEXT, SHARED[:58] + _tokens(5000, 30), "branch", 830, now=4, prompt_len=88)
    assert kept.entry_id in {info.entry_id for info in store.entries_by_recency()}


def test_an_image_entry_parted_from_at_its_prompts_last_token_stays() -> None:
    """Image lookups take whole entries only, so the newer entry cannot serve the old prompt: it stays,
    with the alias of its prompt's own entry that a resend of that prompt adopts."""
    store = _store()
    old_prompt, reply = SHARED[:50], _tokens(3000, 8)
    prompt_entry = store.insert(IMAGE, old_prompt[:-3], "old", 580, now=0, prompt_len=47)
    old = store.insert(IMAGE, old_prompt + reply, "old", 580, now=1, prompt_len=len(old_prompt))
    new_prompt = old_prompt[:-1] + _tokens(4000, 30)
    outcome = store.insert(IMAGE, new_prompt + _tokens(8000, 5), "new", 830, now=2, prompt_len=len(new_prompt))
    assert outcome.evictions == ()
    live = {info.entry_id for info in store.entries_by_recency()}
    assert {prompt_entry.entry_id, old.entry_id, outcome.entry_id} <= live
    match = store.lookup(IMAGE, old_prompt, now=3, max_len=len(old_prompt) - 1)
    assert match is not None
    assert match.matched_len == 47


def test_other_sessions_are_not_superseded() -> None:
    store = _store()
    store.insert(BOB, SHARED[:40], "bob", 400, now=0)
    outcome = store.insert(TEXT, SHARED[:70], "alice", 700, now=1)
    assert outcome.evictions == ()
    assert store.stats(now=1).bytes == 1100


def test_lru_eviction_by_count_and_bytes() -> None:
    store = _store(max_entries=2, capacity_bytes=1000)
    a = store.insert(TEXT, _tokens(0, 20), "a", 300, now=0)
    store.insert(TEXT, _tokens(100, 20), "b", 300, now=1)
    assert store.lookup(TEXT, _tokens(0, 21), now=2) is not None  # a is now the most recent
    outcome = store.insert(TEXT, _tokens(200, 20), "c", 300, now=3)
    assert outcome.evictions == (("lru", 300),)
    assert store.lookup(TEXT, _tokens(100, 21), now=4) is None
    assert store.lookup(TEXT, _tokens(0, 21), now=4).entry_id == a.entry_id
    outcome = store.insert(TEXT, _tokens(300, 20), "d", 900, now=5)
    assert sorted(outcome.evictions) == [("lru", 300), ("lru", 300)]
    stats = store.stats(now=5)
    assert (stats.entries, stats.bytes, stats.evictions["lru"]) == (1, 900, 3)


def test_ttl_counts_from_the_last_hit() -> None:
    store = _store(ttl_seconds=10)
    store.insert(TEXT, _tokens(0, 20), "a", 100, now=0)
    store.insert(TEXT, _tokens(100, 20), "b", 100, now=0)
    assert store.lookup(TEXT, _tokens(0, 21), now=9) is not None
    assert store.expire(now=10) == (("ttl", 100),)
    assert store.lookup(TEXT, _tokens(0, 21), now=18.5) is not None
    assert store.stats(now=28.4).entries == 1
    # Expired once a full ttl has passed.
    assert store.stats(now=28.5).entries == 0
    assert store.stats(now=28.5).evictions["ttl"] == 2


def test_block_cap_evicts_owners() -> None:
    store = _store(apc=ApcSettings(num_blocks=10, block_size=4))
    store.insert(TEXT, _tokens(0, 24), "a", 10, now=0)  # 6 blocks
    outcome = store.insert(TEXT, _tokens(100, 24), "b", 10, now=1)
    assert outcome.evictions == (("capacity", 10),)
    stats = store.stats(now=1)
    assert (stats.entries, stats.unique_block_hashes, stats.evictions["capacity"]) == (1, 6, 1)
    # An entry longer than the whole cap keeps a truncated chain.
    store.insert(TEXT, _tokens(200, 60), "c", 10, now=2)
    assert store.stats(now=2).unique_block_hashes == 10


def test_apc_stats_and_derived_block_cap() -> None:
    store = _store(max_entries=4)
    store.insert(TEXT, SHARED + _tokens(1, 28), "a", 10, now=0)  # 128 tokens: 8 blocks
    store.insert(BOB, SHARED + _tokens(500, 28), "b", 10, now=0)  # shares 6 blocks
    store.insert(TEXT, _tokens(0, 10), "c", 10, now=0)  # no full block
    stats = store.stats(now=0)
    assert stats.apc_block_cap == 4 * 256
    assert (stats.total_blocks_stored, stats.unique_block_hashes, stats.apc_active_entries) == (16, 10, 2)


def test_aliases_count_their_blocks_without_new_hashes() -> None:
    store = _store()
    store.insert(TEXT, SHARED[:48], "1", 10, now=0)
    store.insert(TEXT, SHARED, "2", 10, now=1)
    stats = store.stats(now=1)
    assert (stats.total_blocks_stored, stats.unique_block_hashes, stats.apc_active_entries) == (9, 6, 2)


def test_reset_clears_everything_but_counters() -> None:
    store = _store()
    store.insert(TEXT, SHARED[:48], "1", 10, now=0)
    store.insert(TEXT, SHARED, "2", 20, now=1)
    store.insert(BOB, _tokens(0, 30), "3", 30, now=1)
    store.lookup(TEXT, SHARED, now=2)
    outcome = store.reset()
    assert (outcome.entries_freed, outcome.bytes_freed) == (3, 50)
    stats = store.stats(now=3)
    assert (stats.entries, stats.bytes, stats.total_blocks_stored, stats.unique_block_hashes) == (0, 0, 0, 0)
    assert stats.hits == 1
    assert stats.inserts == 3
    assert store.lookup(TEXT, SHARED, now=3) is None
    assert store.insert(TEXT, SHARED, "again", 20, now=4).stored


def test_lookup_does_not_touch_payload_and_refreshes_owner() -> None:
    store = _store(max_entries=3)
    payload = ["kv"]
    store.insert(TEXT, SHARED[:40], payload, 10, now=0)
    store.insert(TEXT, SHARED[:60], payload, 10, now=1)  # 40 becomes an alias
    store.insert(BOB, _tokens(0, 30), "bob", 10, now=2)
    match = store.lookup(TEXT, SHARED[:40] + [1], now=3)
    assert match is not None
    assert match.payload is payload
    assert payload == ["kv"]
    order = [info.entry_id for info in store.entries_by_recency()]
    assert order[-1] != match.entry_id  # the owner follows its alias to the end
    assert store.entries_by_recency()[-1].alias_of is None


@pytest.mark.parametrize(
    "limits",
    [
        {"capacity_bytes": -1},
        {"capacity_bytes": 1, "max_entries": 0},
        {"capacity_bytes": 1, "min_prefix": -1},
    ],
)
def test_limits_validation(limits) -> None:
    with pytest.raises(ValueError):
        StoreLimits(**limits)


def test_apc_settings_validation() -> None:
    with pytest.raises(ValueError):
        ApcSettings(algorithm="md5")
    with pytest.raises(ValueError):
        ApcSettings(block_size=0)
    assert ApcSettings().block_cap(1024) == 262_144
    assert ApcSettings(num_blocks=7).block_cap(1024) == 7
