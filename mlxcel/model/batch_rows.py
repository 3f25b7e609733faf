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

A row read back out of the batch (``BatchKVCache.extract``: a finished or
removed sequence's KV, to be stored) was copied whole, and the store then
copied each stored piece of it again (a finished sequence's prompt and reply
are two pieces): three copy kernels an array a layer, 192 a row of a 32-layer
model. A wave of 64 rows finishing together spent 0.2 s of an H100's host
queueing their 12,288 kernels (about 16 us each). ``extract_row``
returns a ``RowView`` instead: views of the batch's buffers, each stored
piece copied straight out of them once (``RowView.piece``). A gapped row
(``gapped_cache``) gathers each piece over its positions the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.model import patches, unpadded_decode

__all__ = ["RowView", "extract_row", "filter_by_slices", "install", "runs", "take_rows", "uninstall"]


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
    spans = runs(rows)
    if len(spans) == 1:
        start, end = spans[0]
        return array[start:end]
    return mx.concatenate([array[start:end] for start, end in spans], axis=0)


def filter_by_slices(self: Any, batch_indices: Sequence[int]) -> None:
    """``BatchKVCache.filter``, with the keys and values kept by ``take_rows``."""
    rows = [int(row) for row in batch_indices]
    if self.keys is not None:
        self.keys = take_rows(self.keys, rows)
        self.values = take_rows(self.values, rows)
    self.offset = self.offset[rows]
    # The kept padding worked out on the host and stored as a ready array: a gather on the device would queue
    # behind the step mlx-lm has already started, and reading it back (here, and in every ``extract``) would
    # wait for that step, leaving the device idle while the host builds the next one.
    padding = unpadded_decode.padding_of(self)
    kept = [padding[row] for row in rows]
    # As mlx-lm: shift left to drop the padding every remaining row has.
    min_left_pad = min(kept) if rows else 0
    if min_left_pad > 0 and self.keys is not None:
        self.keys = self.keys[..., min_left_pad:, :]
        self.values = self.values[..., min_left_pad:, :]
    self._idx -= min_left_pad
    self.left_padding = mx.array([value - min_left_pad for value in kept], dtype=self.left_padding.dtype)
    unpadded_decode.remember(self, [value - min_left_pad for value in kept])


class RowView(KVCache):
    """One row of a batch cache over the batch's own buffers: ``keys`` and ``values`` are views of them (a
    gapped row's: its positions gathered), so whoever keeps them copies them; ``piece`` copies a range of the
    row's positions out of the batch's buffers in one kernel an array.

    ``sources`` are the row's (1, heads, span, dim) slices of the batch's keys and values, never row-contiguous
    (``extract_row`` makes a plain copy where they would be), so ``mx.contiguous`` of any part of them copies;
    ``positions`` (a gapped row's) index the span.
    """

    def __init__(self, keys: Any, values: Any, positions: Any = None) -> None:
        super().__init__()
        self.sources = (keys, values)
        self.positions = positions
        if positions is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = mx.take(keys, positions, axis=2), mx.take(values, positions, axis=2)
        self.offset = self.keys.shape[2]

    def piece(self, begin: int, end: int) -> tuple[Any, Any]:
        """The row's positions [begin, end), copied out of the batch's buffers (arrays of their own)."""
        keys, values = self.sources
        if self.positions is None:
            return mx.contiguous(keys[..., begin:end, :]), mx.contiguous(values[..., begin:end, :])
        chosen = self.positions[begin:end]
        return mx.take(keys, chosen, axis=2), mx.take(values, chosen, axis=2)


def extract_row(self: Any, idx: int) -> Any:
    """``BatchKVCache.extract``: the row as a ``RowView`` over the batch's buffers, not a copy of it."""
    padding = unpadded_decode.padding_of(self)[idx]
    keys = self.keys[idx:idx + 1, :, padding:self._idx]
    if keys.shape[1] == 1 or (padding == 0 and self._idx == self.keys.shape[2]):
        # The slice would be row-contiguous: a contiguous copy of it would be the batch's own buffer.
        return patches.original(BatchKVCache, "extract")(self, idx)
    return RowView(keys, self.values[idx:idx + 1, :, padding:self._idx])


def install() -> bool:
    """Point ``BatchKVCache.filter`` at ``filter_by_slices`` and ``extract`` at ``extract_row``; whether it
    changed."""
    filtered = patches.point(BatchKVCache, "filter", filter_by_slices)
    return patches.point(BatchKVCache, "extract", extract_row) or filtered


def uninstall() -> None:
    """Undo ``install`` (tests and benchmarks compare both)."""
    patches.restore(BatchKVCache, "filter", filter_by_slices)
    patches.restore(BatchKVCache, "extract", extract_row)
