"""Rows leaving the decode batch by slices: the same cache as mlx-lm's gather, whatever rows stay."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlxcel.model import batch_rows


def test_runs_split_rows_into_consecutive_spans_in_order():
    assert batch_rows.runs([0, 1, 2]) == [(0, 3)]
    assert batch_rows.runs([0, 2, 3, 5]) == [(0, 1), (2, 4), (5, 6)]
    assert batch_rows.runs([3, 4, 0, 1]) == [(3, 5), (0, 2)]
    assert batch_rows.runs([]) == []


def _cache(left_padding: list[int], length: int = 12) -> BatchKVCache:
    rows = len(left_padding)
    cache = BatchKVCache(left_padding)
    keys = mx.random.normal((rows, 2, length, 8))
    cache.update_and_fetch(keys, keys * 2)
    return cache


@pytest.mark.parametrize("keep", [[0, 1, 2, 3, 4], [1, 2, 3, 4], [0, 1, 2], [0, 2, 4], [4, 1], [3], [2, 3, 0]])
def test_filter_by_slices_keeps_what_mlx_lm_keeps(keep):
    mx.random.seed(3)
    # Rows 0 and 3 unpadded: some keeps leave only padded rows, and the shared padding is dropped.
    padding = [0, 2, 3, 0, 5]
    expected, got = _cache(padding), _cache(padding)
    got.keys, got.values = expected.keys, expected.values
    batch_rows.uninstall()
    BatchKVCache.filter(expected, keep)
    batch_rows.filter_by_slices(got, keep)
    assert got.keys.shape == expected.keys.shape
    assert mx.array_equal(got.keys, expected.keys).item()
    assert mx.array_equal(got.values, expected.values).item()
    assert got.offset.tolist() == expected.offset.tolist()
    assert got.left_padding.tolist() == expected.left_padding.tolist()
    assert got._idx == expected._idx


def test_install_points_the_batch_cache_at_it_and_uninstall_undoes_it():
    original = BatchKVCache.filter
    try:
        batch_rows.uninstall()
        plain = BatchKVCache.filter
        assert batch_rows.install()
        assert BatchKVCache.filter is batch_rows.filter_by_slices
        assert not batch_rows.install()
        batch_rows.uninstall()
        assert BatchKVCache.filter is plain
    finally:
        BatchKVCache.filter = original
