"""The stored responses behind previous_response_id are shared fairly: one owner's flood evicts its own."""

from __future__ import annotations

from mlxcel.http.responses import ResponseStore
from tests.fakes import FakeEngine, client_for
from tests.http.test_responses import post

ITEM = ({"type": "message", "role": "user", "content": "x" * 100},)


def test_the_owner_holding_the_most_gives_way() -> None:
    store = ResponseStore(max_entries=4, max_bytes=100_000)
    assert store.put("victim", "v", {"id": "v"}, ITEM, ITEM)
    for index in range(20):
        assert store.put("flood", f"f{index}", {"id": f"f{index}"}, ITEM, ITEM)
    assert store.get("victim", "v") is not None
    assert [store.get("flood", f"f{index}") is not None for index in range(16, 20)] == [False, True, True, True]
    assert store.statistics().num_entries == 4
    # By bytes too: the owner holding the most bytes loses its oldest first, never the entry just stored.
    store = ResponseStore(max_entries=100, max_bytes=1_500)
    assert store.put("victim", "v", {"id": "v"}, ITEM, ITEM)
    big = ({"type": "message", "role": "user", "content": "y" * 600},)
    for index in range(5):
        assert store.put("flood", f"f{index}", {"id": f"f{index}"}, big, big)
    assert store.get("victim", "v") is not None
    assert store.get("flood", "f4") is not None
    assert store.statistics().nbytes <= 1_500
    # A lone large response of a new owner is kept; the largest other owner makes room.
    assert store.put("third", "t", {"id": "t"}, big, big)
    assert store.get("third", "t") is not None
    assert store.get("victim", "v") is not None
    # Deleting the last response of an owner forgets the owner.
    assert store.delete("third", "t")
    assert not store.delete("third", "t")


async def test_one_tenant_s_stored_responses_do_not_evict_another_s_previous_response_id() -> None:
    """Issue 33, item 8: 1,024 responses of one salt evicted every other tenant's (a plain LRU)."""
    client = client_for(FakeEngine(), responses_store_entries=8)
    status, victim = await post(client, {"input": "remember this", "cache_salt": "tenant-b"})
    assert status == 200
    for index in range(30):
        assert (await post(client, {"input": f"flood {index}", "cache_salt": "tenant-a"}))[0] == 200
    status, follow_up = await post(client, {"input": "and then?", "previous_response_id": victim["id"],
                                            "cache_salt": "tenant-b"})
    assert status == 200, follow_up
