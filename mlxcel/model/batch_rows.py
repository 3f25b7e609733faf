"""Rows leaving mlx-lm's decode batch without MLX's gather over the batch axis.

mlx-lm's ``BatchKVCache.filter`` keeps the remaining rows with
``keys[batch_indices]``: a gather, which on the H200 copies at about 210 GB/s,
while a slice costs nothing and a concatenation copies at memcpy speed. With
long contexts the batch's KV is large (the 8B KV shape holds 128 KiB a token:
32 rows of 8k tokens are 34 GB), and every finished sequence's removal copied
all of it: 161 ms at 32 rows, where 4 rows joining took 20 ms
(``benchmarks/batch_join_cost.py``). ``filter_by_slices`` keeps the same rows
in the same order as runs of consecutive rows, sliced and joined once. When
one run stays (the last rows leave), the result is a slice, which the next
step's write into the cache copies once (a slice is not donated): a copy at
copy speed either way, not a gather.

``install()`` points ``BatchKVCache.filter`` at it; only the device thread
filters batches. The result is the same arrays, so nothing else changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlxcel.model import patches

__all__ = ["filter_by_slices", "install", "runs", "take_rows", "uninstall"]


def runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """``rows`` as [start, end) runs of consecutive indices, in order."""
    spans: list[tuple[int, int]] = []
    for row in rows:
        if spans and spans[-1][1] == row:
            spans[-1] = (spans[-1][0], row + 1)
        else:
            spans.append((row, row + 1))
    return spans


def take_rows(array: Any, rows: Sequence[int]) -> Any:
    """``array[rows]`` along the first axis, by slices of consecutive rows."""
    import mlx.core as mx

    spans = runs(rows)
    if len(spans) == 1:
        start, end = spans[0]
        return array[start:end]
    return mx.concatenate([array[start:end] for start, end in spans], axis=0)


def filter_by_slices(self: Any, batch_indices: Sequence[int]) -> None:
    """``BatchKVCache.filter``, with the keys and values kept by ``take_rows``."""
    import mlx.core as mx

    rows = [int(row) for row in batch_indices]
    if self.keys is not None:
        self.keys = take_rows(self.keys, rows)
        self.values = take_rows(self.values, rows)
    self.offset = self.offset[rows]
    # The kept padding worked out on the host and stored as a ready array: a gather on the device would queue
    # behind the step mlx-lm has already started, and reading it back (here, and in every ``extract``) would
    # wait for that step, leaving the device idle while the host builds the next one.
    padding = self.left_padding.tolist()
    kept = [padding[row] for row in rows]
    # As mlx-lm: shift left to drop the padding every remaining row has.
    min_left_pad = min(kept) if rows else 0
    if min_left_pad > 0 and self.keys is not None:
        self.keys = self.keys[..., min_left_pad:, :]
        self.values = self.values[..., min_left_pad:, :]
    self._idx -= min_left_pad
    self.left_padding = mx.array([value - min_left_pad for value in kept], dtype=self.left_padding.dtype)


def install() -> bool:
    """Point ``BatchKVCache.filter`` at ``filter_by_slices``; whether it changed."""
    from mlx_lm.models.cache import BatchKVCache

    return patches.point(BatchKVCache, "filter", filter_by_slices)


def uninstall() -> None:
    """Undo ``install`` (tests and benchmarks compare both)."""
    from mlx_lm.models.cache import BatchKVCache

    patches.restore(BatchKVCache, "filter", filter_by_slices)
