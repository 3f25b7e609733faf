"""The gapped batch KV cache: rejected verify positions masked out where they lie, rows read back in order."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.model.gapped_cache import GappedBatchKVCache, keep_written

HEADS, DIM = 2, 4


def _batch(lengths: list[int], rng: np.random.Generator) -> tuple[BatchKVCache, list[np.ndarray], list[np.ndarray]]:
    """A batch cache of rows of these lengths (random keys and values), and each row's keys and values."""
    rows_k, rows_v, caches = [], [], []
    for length in lengths:
        keys = rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)
        values = rng.standard_normal((1, HEADS, length, DIM)).astype(np.float32)
        cache = KVCache()
        cache.update_and_fetch(mx.array(keys), mx.array(values))
        caches.append(cache)
        rows_k.append(keys[0])
        rows_v.append(values[0])
    return BatchKVCache.merge(caches), rows_k, rows_v


def _write(cache: Any, rows_k: list[np.ndarray], rows_v: list[np.ndarray], width: int, kept: list[int],
           rng: np.random.Generator) -> None:
    """A verify step: ``width`` positions written to every row, each row keeping its first ``kept``."""
    keys = rng.standard_normal((len(kept), HEADS, width, DIM)).astype(np.float32)
    values = rng.standard_normal((len(kept), HEADS, width, DIM)).astype(np.float32)
    cache.update_and_fetch(mx.array(keys), mx.array(values))
    keep_written([cache], width, kept)
    for e, count in enumerate(kept):
        rows_k[e] = np.concatenate([rows_k[e], keys[e, :, :count]], axis=1)
        rows_v[e] = np.concatenate([rows_v[e], values[e, :, :count]], axis=1)


def _assert_rows(cache: Any, rows_k: list[np.ndarray], rows_v: list[np.ndarray]) -> None:
    for e, (keys, values) in enumerate(zip(rows_k, rows_v, strict=True)):
        row = cache.extract(e)
        np.testing.assert_array_equal(np.asarray(row.keys[0]), keys)
        np.testing.assert_array_equal(np.asarray(row.values[0]), values)
        assert int(cache.offset[e].item()) == keys.shape[1]


def _assert_attention(cache: Any, rows_k: list[np.ndarray], rows_v: list[np.ndarray], width: int,
                      rng: np.random.Generator) -> None:
    """A pass of ``width`` queries over the batch equals, per row, the pass over the row's tokens alone."""
    rows = len(rows_k)
    queries = mx.array(rng.standard_normal((rows, HEADS, width, DIM)).astype(np.float32))
    new_k = rng.standard_normal((rows, HEADS, width, DIM)).astype(np.float32)
    new_v = rng.standard_normal((rows, HEADS, width, DIM)).astype(np.float32)
    mask = cache.make_mask(width)
    keys, values = cache.update_and_fetch(mx.array(new_k), mx.array(new_v))
    out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=0.5, mask=mask)
    cache.trim(width)
    for e in range(rows):
        alone_k = mx.array(np.concatenate([rows_k[e], new_k[e]], axis=1))[None]
        alone_v = mx.array(np.concatenate([rows_v[e], new_v[e]], axis=1))[None]
        expected = mx.fast.scaled_dot_product_attention(queries[e:e + 1], alone_k, alone_v, scale=0.5,
                                                        mask="causal")
        np.testing.assert_allclose(np.asarray(out[e:e + 1]), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_rows_keeping_different_counts_leave_gaps_and_nothing_moves() -> None:
    rng = np.random.default_rng(0)
    cache, rows_k, rows_v = _batch([7, 4, 9], rng)
    written = rng.standard_normal((3, HEADS, 5, DIM)).astype(np.float32)
    cache.update_and_fetch(mx.array(written), mx.array(written))
    buffers = (cache.keys, cache.values)
    keep_written([cache], 5, [1, 5, 3])
    assert type(cache) is GappedBatchKVCache
    # Row 1 kept all 5: nothing trimmed; rows 0 and 2 lost their last 4 and 2 positions in place.
    assert cache.gaps == [[(10, 14)], [], [(12, 14)]]
    assert cache.keys is buffers[0]
    assert cache.values is buffers[1]
    for e, count in enumerate([1, 5, 3]):
        rows_k[e] = np.concatenate([rows_k[e], written[e, :, :count]], axis=1)
        rows_v[e] = np.concatenate([rows_v[e], written[e, :, :count]], axis=1)
    _assert_rows(cache, rows_k, rows_v)


def test_attention_over_a_gapped_batch_equals_each_row_alone() -> None:
    rng = np.random.default_rng(1)
    cache, rows_k, rows_v = _batch([6, 3, 8], rng)
    for kept in ([2, 5, 1], [5, 1, 3], [4, 4, 2]):
        _write(cache, rows_k, rows_v, 5, kept, rng)
        _assert_attention(cache, rows_k, rows_v, 5, rng)
        _assert_attention(cache, rows_k, rows_v, 1, rng)
    _assert_rows(cache, rows_k, rows_v)


def test_gaps_follow_rows_through_filter_extend_trim_and_compaction() -> None:
    rng = np.random.default_rng(2)
    cache, rows_k, rows_v = _batch([6, 3, 8], rng)
    _write(cache, rows_k, rows_v, 4, [1, 4, 2], rng)
    _write(cache, rows_k, rows_v, 4, [3, 1, 4], rng)
    # A row leaves.
    cache.filter([0, 2])
    rows_k, rows_v = [rows_k[0], rows_k[2]], [rows_v[0], rows_v[2]]
    _assert_rows(cache, rows_k, rows_v)
    _assert_attention(cache, rows_k, rows_v, 3, rng)
    # A longer row joins (the gapped rows move right with their gaps).
    joining, join_k, join_v = _batch([40], rng)
    cache.extend(joining)
    rows_k, rows_v = rows_k + join_k, rows_v + join_v
    _assert_rows(cache, rows_k, rows_v)
    _assert_attention(cache, rows_k, rows_v, 2, rng)
    # Trimming past a gap: the rows with a gap there lose fewer tokens.
    _write(cache, rows_k, rows_v, 3, [1, 3, 3], rng)
    cache.trim(2)
    rows_k = [rows_k[0], rows_k[1][:, :-2], rows_k[2][:, :-2]]
    rows_v = [rows_v[0], rows_v[1][:, :-2], rows_v[2][:, :-2]]
    _assert_rows(cache, rows_k, rows_v)
    # Compaction: mlx-lm's own layout again, the same rows.
    assert isinstance(cache, GappedBatchKVCache)
    cache.compact()
    assert type(cache) is BatchKVCache
    _assert_rows(cache, rows_k, rows_v)
    _assert_attention(cache, rows_k, rows_v, 4, rng)


def test_a_right_padding_roll_on_a_gapped_cache_compacts_first() -> None:
    rng = np.random.default_rng(3)
    cache, rows_k, rows_v = _batch([5, 2], rng)
    _write(cache, rows_k, rows_v, 3, [1, 3], rng)
    keys = rng.standard_normal((2, HEADS, 2, DIM)).astype(np.float32)
    cache.update_and_fetch(mx.array(keys), mx.array(keys))
    # Row 0 fed one token (then padding), row 1 two: mlx-lm's roll of the padding into the left.
    cache.prepare(right_padding=[1, 0])
    cache.finalize()
    rows_k = [np.concatenate([rows_k[0], keys[0, :, :1]], axis=1), np.concatenate([rows_k[1], keys[1]], axis=1)]
    rows_v = [np.concatenate([rows_v[0], keys[0, :, :1]], axis=1), np.concatenate([rows_v[1], keys[1]], axis=1)]
    _assert_rows(cache, rows_k, rows_v)


def test_the_layers_of_a_row_share_its_positions_when_extracted() -> None:
    """Every layer's cache holds the same gaps: the layers of a row read back with one positions array between
    them (a finishing wave of 64 rows of 32 layers made 2,048), and each still reads back its own tokens."""
    from mlxcel.model import gapped_cache

    layers = []
    for seed in (5, 6):
        rng = np.random.default_rng(seed)
        cache, rows_k, rows_v = _batch([3, 5, 4], np.random.default_rng(9))
        cache = GappedBatchKVCache.adopt(cache)
        _write(cache, rows_k, rows_v, width=3, kept=[1, 3, 2], rng=rng)
        _write(cache, rows_k, rows_v, width=2, kept=[2, 0, 1], rng=rng)
        layers.append((cache, rows_k, rows_v))
    assert layers[0][0].gaps == layers[1][0].gaps
    assert layers[0][0].has_gaps()
    gapped_cache._row_positions.clear()
    for cache, rows_k, rows_v in layers:
        _assert_rows(cache, rows_k, rows_v)
    assert len(gapped_cache._row_positions) == sum(1 for row in layers[0][0].gaps if row)
