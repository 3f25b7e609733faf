"""The detached KV set as pieces: cut, detach on a base, split, adopt across pieces."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.model.kv import AdoptError, DetachedKV, adopt, adopt_rows, detach

LAYERS, HEADS, DIM = 2, 2, 4


def caches_of(rows: int, padded: int = 8) -> list[KVCache]:
    """Per-layer caches whose row t holds the value t (step-padded, as a batch's are)."""
    caches = []
    for layer in range(LAYERS):
        ramp = mx.arange(rows + padded, dtype=mx.float32).reshape(1, 1, -1, 1)
        keys = mx.broadcast_to(ramp + 1000 * layer, (1, HEADS, rows + padded, DIM))
        cache = KVCache()
        cache.keys, cache.values, cache.offset = keys + 0, -keys, rows
        caches.append(cache)
    return caches


def rows_of(cache: KVCache) -> list[float]:
    return cache.keys[0, 0, :, 0].tolist()


def test_detach_on_a_base_reuses_its_pieces_and_copies_only_the_rest() -> None:
    base = detach(caches_of(10), 6)
    assert base is not None
    assert len(base.pieces()) == 1
    grown = detach(caches_of(10), 10, base=base)
    assert grown is not None
    assert grown.pieces()[0] is base.pieces()[0]
    assert [piece.length for piece in grown.pieces()] == [6, 4]
    assert grown.nbytes == detach(caches_of(10), 10).nbytes  # logical bytes: as if unshared
    adopted = adopt(grown, 9)
    assert rows_of(adopted[0]) == list(range(9))
    assert rows_of(adopted[1]) == [1000.0 + row for row in range(9)]
    assert adopted[1].values[0, 0, :, 0].tolist() == [-1000.0 - row for row in range(9)]


def test_a_base_longer_than_the_sequence_is_cut() -> None:
    base = detach(caches_of(10), 10)
    assert base is not None
    shorter = detach(caches_of(10), 7, base=base)
    assert shorter is not None
    assert shorter.pieces() == base.pieces()
    assert shorter.length == 7
    assert shorter.nbytes == base.nbytes * 7 // 10


def test_split_at_the_prompt_end_gives_prompt_and_reply_pieces() -> None:
    base = detach(caches_of(12), 4)
    assert base is not None
    done = detach(caches_of(12), 12, base=base, split_at=9)
    assert done is not None
    assert [piece.length for piece in done.pieces()] == [4, 5, 3]
    assert rows_of(adopt(done, 12)[0]) == list(range(12))
    # The next turn re-renders the reply: it adopts the prompt and does not hold the reply's piece.
    assert done.cut(9).pieces() == done.pieces()[:2]
    # A split outside the new rows is ignored.
    assert [piece.length for piece in detach(caches_of(12), 12, base=base, split_at=3).pieces()] == [4, 8]


def test_cut_and_adopt_refuse_lengths_past_the_prefix() -> None:
    stored = detach(caches_of(5), 5)
    assert isinstance(stored, DetachedKV)
    with pytest.raises(AdoptError):
        stored.cut(6)
    with pytest.raises(AdoptError):
        adopt(stored, 0)


def test_a_prefix_of_several_pieces_is_adopted_with_room_for_the_next_tokens() -> None:
    base = detach(caches_of(12), 5)
    stored = detach(caches_of(12), 12, base=base)
    assert stored is not None
    (cache, *_) = adopt(stored, 12, room=3)
    buffer = cache.keys.shape[2]
    assert buffer >= 15
    keys, _ = cache.update_and_fetch(mx.full((1, HEADS, 3, DIM), 99.0), mx.zeros((1, HEADS, 3, DIM)))
    # Written into the adopted buffer, not a new one.
    assert cache.keys.shape[2] == buffer
    assert keys[0, 0, :, 0].tolist() == [*range(12), 99.0, 99.0, 99.0]
    # One piece: views, no room needed (the cache copies once on its first write anyway).
    (single, *_) = adopt(base, 5, room=3)
    assert single.keys.shape[2] == 5


def test_rows_of_several_prefixes_share_one_buffer_each_row_as_adopted_alone() -> None:
    """A batch of hits adopts each row's prefix (one piece, or several shared with other rows) into one buffer
    per layer, with room after: row i then equals its own adoption."""
    base = detach(caches_of(12), 5)
    several = detach(caches_of(12), 12, base=base)
    single = detach(caches_of(9), 9)
    assert several is not None
    assert single is not None
    assert base is not None
    assert len(several.pieces()) == 2
    handles = [several, single, several.cut(8)]
    caches = adopt_rows(handles, 8, room=4)
    assert [cache.offset for cache in caches] == [8] * LAYERS
    assert caches[0].keys.shape == (3, HEADS, 12, DIM)
    for row, handle in enumerate(handles):
        for layer, alone in enumerate(adopt(handle, 8)):
            assert caches[layer].keys[row:row + 1, :, :8].tolist() == alone.keys[..., :8, :].tolist()
            assert caches[layer].values[row:row + 1, :, :8].tolist() == alone.values[..., :8, :].tolist()
    # The next tokens are written into that buffer, not a new one.
    keys, _ = caches[0].update_and_fetch(mx.full((3, HEADS, 4, DIM), 99.0), mx.zeros((3, HEADS, 4, DIM)))
    assert caches[0].keys.shape[2] == 12
    assert keys[2, 0, :, 0].tolist() == [*range(8), 99.0, 99.0, 99.0, 99.0]
    with pytest.raises(AdoptError):
        adopt_rows([single, base], 8)
