"""The store's block log and its vLLM encoding (pure: no sockets)."""

from __future__ import annotations

import random

import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from mlxcel.cache.key import CacheContext
from mlxcel.cache.kv_events import (
    BlockChange,
    BlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KvEventEncoder,
    external_block_hash,
)
from mlxcel.cache.store import ApcSettings, PromptCacheStore, StoreLimits

BLOCK = 4
CONTEXT = CacheContext(model_id="m", template_sig="sig")


def store(capacity_bytes: int = 10_000, **limits: int) -> PromptCacheStore:
    return PromptCacheStore(StoreLimits(capacity_bytes=capacity_bytes, min_prefix=4, **limits),
                            ApcSettings(block_size=BLOCK), log_blocks=True)


def held_after(changes: list[BlockChange], held: set[bytes] | None = None) -> set[bytes]:
    """Replay a log as a consumer would, checking prefix order on the way."""
    held = set() if held is None else held
    for change in changes:
        if isinstance(change, BlocksCleared):
            held.clear()
        elif isinstance(change, BlocksRemoved):
            assert set(change.hashes) <= held
            held -= set(change.hashes)
        else:
            assert change.parent is None or change.parent in held, "a block before its parent"
            assert not set(change.hashes) & held, "a block announced twice"
            assert len(change.token_bytes) == 4 * BLOCK * len(change.hashes)
            held |= set(change.hashes)
    return held


def test_insert_logs_only_the_new_tail_of_the_chain() -> None:
    cache = store()
    assert cache.insert(CONTEXT, list(range(12)), "a", 10, now=0.0).stored
    (first,) = cache.take_block_changes()
    assert isinstance(first, BlocksStored)
    assert first.parent is None
    assert len(first.hashes) == 3
    # Shares two blocks, then parts: only the blocks after the shared ones are new.
    assert cache.insert(CONTEXT, [*range(8), 99, 98, 97, 96, 95], "b", 10, now=1.0).stored
    (second,) = cache.take_block_changes()
    assert isinstance(second, BlocksStored)
    assert second.parent == first.hashes[1]
    assert second.first_index == 2
    assert len(second.hashes) == 1
    assert second.token_bytes == b"".join(value.to_bytes(4, "little") for value in (99, 98, 97, 96))
    assert cache.take_block_changes() == []


def test_eviction_and_reset_are_logged() -> None:
    cache = store(capacity_bytes=25)
    cache.insert(CONTEXT, list(range(8)), "a", 10, now=0.0)
    cache.insert(CONTEXT, list(range(100, 108)), "b", 10, now=1.0)
    cache.take_block_changes()
    cache.insert(CONTEXT, list(range(200, 208)), "c", 10, now=2.0)  # over 25 bytes: "a" goes
    stored, removed = cache.take_block_changes()
    assert isinstance(stored, BlocksStored)
    assert isinstance(removed, BlocksRemoved)
    assert len(removed.hashes) == 2
    cache.reset()
    assert cache.take_block_changes() == [BlocksCleared()]


def test_no_log_unless_asked() -> None:
    cache = PromptCacheStore(StoreLimits(capacity_bytes=100, min_prefix=4), ApcSettings(block_size=BLOCK))
    cache.insert(CONTEXT, list(range(12)), "a", 10, now=0.0)
    assert cache.take_block_changes() == []


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.integers(20, 120), st.integers(1, 6))
def test_the_log_always_replays_to_the_blocks_the_store_holds(seed: int, capacity: int, max_entries: int) -> None:
    """Random conversations growing, branching and being evicted: a consumer's view stays exact."""
    rng = random.Random(seed)
    cache = store(capacity_bytes=capacity, max_entries=max_entries)
    sequences: list[list[int]] = [[rng.randrange(6) for _ in range(rng.randrange(4, 14))]]
    held: set[bytes] = set()
    for step in range(40):
        base = rng.choice(sequences)
        if rng.random() < 0.6:
            tokens = base + [rng.randrange(6) for _ in range(rng.randrange(0, 9))]
        else:
            tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(6) for _ in range(rng.randrange(4, 10))]
        sequences.append(tokens)
        if rng.random() < 0.05:
            cache.reset()
        else:
            cache.insert(CONTEXT, tokens, object(), rng.randrange(1, 30), now=float(step))
        held = held_after(cache.take_block_changes(), held)
        assert held == set(cache._block_refs)


@pytest.mark.parametrize("form", ["positional", "map"])
def test_encoding_follows_vllm(form: str) -> None:
    salted = CacheContext(model_id="m", template_sig="sig", cache_salt="tenant-7")
    changes: list[BlockChange] = [
        BlocksCleared(),
        BlocksStored(context=salted, parent=None, hashes=(b"\x01" * 32, b"\x02" * 32), first_index=0,
                     token_bytes=b"".join(i.to_bytes(4, "little") for i in range(8))),
        BlocksRemoved(hashes=(b"\x02" * 32,)),
    ]
    ts, events, rank = msgpack.unpackb(KvEventEncoder(block_size=BLOCK, form=form).batch(12.5, changes))
    assert (ts, rank) == (12.5, 0)
    one, two = external_block_hash(b"\x01" * 32), external_block_hash(b"\x02" * 32)
    assert one == int.from_bytes(b"\x01" * 8, "big")
    if form == "positional":
        assert events == [
            ["AllBlocksCleared"],
            ["BlockStored", [one, two], None, list(range(8)), BLOCK, None, "GPU", None, [["tenant-7"], None]],
            ["BlockRemoved", [two], "GPU"],
        ]
    else:
        assert events == [
            {"type": "AllBlocksCleared"},
            {"type": "BlockStored", "block_hashes": [one, two], "parent_block_hash": None,
             "token_ids": list(range(8)), "block_size": BLOCK, "lora_id": None, "medium": "GPU",
             "lora_name": None, "extra_keys": [["tenant-7"], None]},
            {"type": "BlockRemoved", "block_hashes": [two], "medium": "GPU"},
        ]
