"""Rows leaving the decode batch by slices: the same cache as mlx-lm's gather, whatever rows stay."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

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


def _copying_kernels(arrays: list[mx.array], tmp_path) -> int:
    """The copies and gathers evaluating ``arrays`` runs (from MLX's own graph of them)."""
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    text = path.read_text()
    return text.count('label ="Contiguous"') + text.count('label ="Gather"') + text.count('label ="GatherAxis"')


@pytest.mark.parametrize("gapped", [False, True])
def test_a_stored_row_is_copied_once_a_piece_and_holds_what_mlx_lm_reads_back(gapped, tmp_path):
    """A finished row's prompt and reply pieces come straight out of the batch's buffer, one copy (or gather) an
    array a piece, where mlx-lm's extract copied the whole row first (three kernels an array, 192 a row of a
    32-layer model, about 16 us of host time each to queue on an H100); the pieces hold the same values."""
    from mlxcel.model.gapped_cache import GappedBatchKVCache, keep_written
    from mlxcel.model.kv import EXACT, detach, use_store_format

    mx.random.seed(4)
    use_store_format(EXACT)
    cache = _cache([0, 2, 3, 0, 5], length=12)
    if gapped:
        written = mx.random.normal((5, 2, 3, 8))
        cache.update_and_fetch(written, written * 2)
        keep_written([cache], 3, [1, 3, 2, 3, 0])
        assert isinstance(cache, GappedBatchKVCache)
        assert cache.gaps[2]
    mx.eval(cache.keys, cache.values)
    row = 2
    batch_rows.install()
    view = cache.extract(row)
    assert isinstance(view, batch_rows.RowView)
    if gapped:
        # As the gapped cache read a row back before: the whole row gathered, then each piece copied.
        plain = KVCache()
        plain.keys, plain.values, plain.offset = view.keys, view.values, view.offset
    else:
        batch_rows.uninstall()
        plain = cache.extract(row)
        batch_rows.install()
        assert type(plain) is KVCache
    length = view.offset
    assert length == plain.offset
    split = length - 4
    stored = detach([view], length, split_at=split, evaluate=False)
    before = detach([plain], length, split_at=split, evaluate=False)
    assert _copying_kernels(stored.arrays(), tmp_path) == 4  # keys and values of 2 pieces, once each
    assert _copying_kernels(before.arrays(), tmp_path) == 6
    for mine, theirs in zip(stored.arrays(), before.arrays(), strict=True):
        assert mine.shape == theirs.shape
        assert mx.array_equal(mine, theirs).item()


@pytest.mark.parametrize(("heads", "length"), [(4, 1000), (1, 1000), (4, 1024)])
def test_a_stored_row_does_not_keep_the_batch_alive(heads, length):
    """The pieces own their buffers: once the batch and the row are gone, the memory left is the row's. One KV
    head, or a row filling the whole buffer, would make the row's slice the batch's memory itself: those rows
    are copied whole first, as mlx-lm does (the batch grows in steps of 256 positions: 1,024 is full)."""
    import gc

    from mlxcel.model.kv import EXACT, detach, use_store_format

    use_store_format(EXACT)
    batch_rows.install()
    gc.collect()
    mx.clear_cache()
    already = mx.get_active_memory()  # what other tests left
    cache = BatchKVCache([0] * 8)
    keys = mx.random.normal((8, heads, length, 64))
    cache.update_and_fetch(keys, keys * 2)
    mx.eval(cache.keys, cache.values)
    row = cache.extract(3)
    assert isinstance(row, batch_rows.RowView) == (heads > 1 and length < cache.keys.shape[2])
    stored = detach([row], length, split_at=600)
    assert stored.nbytes == 2 * heads * length * 64 * 4
    del cache, keys, row
    gc.collect()
    mx.clear_cache()
    held = mx.get_active_memory() - already
    assert held < 4 * stored.nbytes, (held, stored.nbytes)
