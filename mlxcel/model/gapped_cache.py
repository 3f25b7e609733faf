"""A batch KV cache whose rows may have gaps: rejected verify positions are masked out where they lie, not moved.

A speculative verify step (``speculation.py``) writes ``width`` positions
into every row of mlx-lm's ``BatchKVCache``; each row keeps only its first
``kept``. mlx-lm's cache holds each row as one run ending at the batch's
write index, so the rows' common rejected count is trimmed and the rest had
to be rolled into the row's left padding (``prepare(right_padding=...)``):
a gather of every row's whole KV, every layer, every verify step. On the
2-core CPU at 8 rows of ~2k tokens (SmolLM2-135M) that roll cost ~0.65 s,
more than the verify pass's own width (docs/benchmarks.md).

``GappedBatchKVCache`` instead records, per row, the buffer intervals that
hold no token of the row (its gaps) and adds them to the attention mask.
Attention does not depend on where a key lies (the position is in the
rotated key itself and in ``offset``, the row's token count, which RoPE
reads), so nothing moves: keeping costs a host list append and a boolean
mask row per step. The gaps take buffer room that mlx-lm's roll would have
given to left padding, so the batch attends over as many positions as
before. Whatever reads the rows in order sees them without gaps:
``extract`` gathers the row's tokens, ``filter`` and ``extend`` move the
gaps with the rows, ``trim`` counts them; ``finalize`` (a right-padding
roll) and ``compact`` gather every row's tokens to the right once and turn
the cache back into mlx-lm's own class. A cache becomes gapped only when a
step's rows keep different counts (``keep_written``); until then it is
mlx-lm's unchanged. Only the device thread uses it, and only for plain KV
caches.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.model import unpadded_decode
from mlxcel.model.batch_rows import RowView

__all__ = ["GappedBatchKVCache", "from_shared_pass", "keep_written"]

# A row's gaps are gathered away (``compact``) once every row has this many gap or left-padding positions
# (and a quarter of the buffer): the buffer then shrinks by at least that much. Below it, gaps cost only
# the attention over them, as the left padding mlx-lm's roll made did.
COMPACT_AT_POSITIONS = 256
# ... or once a row has this many separate gaps (its mask row is rebuilt from them each step).
COMPACT_AT_GAPS = 256


# A gapped row's token positions as a device array, by (its gaps, its left padding, the buffer's end): every
# layer's cache holds the same gaps, so the layers of a row extracted together share one (a wave of 64 finishing
# rows of 32 layers made 2,048, each a host array copied over). Only the device thread extracts.
ROW_POSITIONS_KEPT = 256
_row_positions: dict[tuple[Any, ...], Any] = {}


class GappedBatchKVCache(BatchKVCache):
    """mlx-lm's ``BatchKVCache`` with per-row gaps masked out (see the module's docstring)."""

    # Per row, the buffer intervals [start, end) below ``_idx`` that hold none of the row's tokens.
    gaps: list[list[tuple[int, int]]]
    # The gaps the mask's device bounds were made from, and those bounds (``_gap_bounds``).
    _bounds_key: Any = None
    _bounds: Any = None

    @classmethod
    def adopt(cls, cache: BatchKVCache) -> GappedBatchKVCache:
        """The same cache object, able to hold gaps (no copy)."""
        if not isinstance(cache, GappedBatchKVCache):
            cache.__class__ = cls
            assert isinstance(cache, GappedBatchKVCache)
            cache.gaps = [[] for _ in range(cache.left_padding.shape[0])]
        return cache

    def has_gaps(self) -> bool:
        return any(self.gaps)

    def drop_tail(self, counts: list[int], as_array: Any = None) -> None:
        """Row ``e`` loses its last ``counts[e]`` positions (all below ``_idx``, written by the last step).

        ``as_array``: ``counts`` as an MLX array (one for all layers' caches).
        """
        for row, count in zip(self.gaps, counts, strict=True):
            if count <= 0:
                continue
            start = self._idx - count
            if row and row[-1][1] == start:
                row[-1] = (row[-1][0], self._idx)
            else:
                row.append((start, self._idx))
        self.offset = self.offset - (mx.array(counts) if as_array is None else as_array)

    def make_mask(self, N: int, return_array: bool = False, **kwargs: Any) -> Any:  # noqa: N803 (mlx-lm's name)
        mask = super().make_mask(N, return_array=return_array, **kwargs)
        if not self.has_gaps():
            return mask
        # The gaps as (rows, most gaps) bounds, compared with the positions on the device: a few operations a
        # step instead of a (rows x positions) host array filled and copied over (64 rows on the CPU box:
        # 115 -> 50 us of host time a step).
        starts, ends = self._gap_bounds()
        positions = mx.arange(self._idx + N)
        in_gap = mx.any((positions >= starts[..., None]) & (positions < ends[..., None]), axis=1)
        return mx.logical_and(mask, mx.logical_not(in_gap)[:, None, None, :])

    def _gap_bounds(self) -> tuple[Any, Any]:
        """(starts, ends): int32 (rows, most gaps in a row), padded with empty (0, 0) intervals; remade only
        when some row's gaps changed (they change when rows keep different counts, not each step)."""
        key = tuple(map(tuple, self.gaps))
        if key != self._bounds_key:
            width = max(len(row) for row in key)
            bounds = np.zeros((2, len(key), width), dtype=np.int32)
            for e, row in enumerate(key):
                for g, (start, end) in enumerate(row):
                    bounds[0, e, g], bounds[1, e, g] = start, end
            self._bounds_key, self._bounds = key, (mx.array(bounds[0]), mx.array(bounds[1]))
        return self._bounds

    def trim(self, n: int) -> int:
        before = self._idx
        n = super().trim(n)
        if n and self.has_gaps():
            # Gap positions cut off were no row's tokens: those rows lost fewer tokens than n.
            restored = []
            for row in self.gaps:
                cut = sum(min(end, before) - max(start, self._idx) for start, end in row if end > self._idx)
                row[:] = [(start, min(end, self._idx)) for start, end in row if start < self._idx]
                restored.append(cut)
            if any(restored):
                self.offset = self.offset + mx.array(restored)
        return n

    def filter(self, batch_indices: Any) -> None:
        indices = _ints(batch_indices)
        self.gaps = [self.gaps[index] for index in indices]
        before = self._idx
        super().filter(batch_indices)
        self._shift(self.gaps, self._idx - before)

    def extend(self, other: Any) -> None:
        length = max(self._idx, other._idx)
        mine = self._shift(self.gaps, length - self._idx)
        rows = other.left_padding.shape[0]
        theirs = self._shift(other.gaps, length - other._idx) if isinstance(other, GappedBatchKVCache) \
            else [[] for _ in range(rows)]
        super().extend(other)
        self.gaps = mine + theirs

    def extract(self, idx: int) -> KVCache:  # a RowView (batch_rows.py) for a gapped row
        if not self.gaps[idx]:
            return super().extract(idx)
        padding = unpadded_decode.padding_of(self)[idx]
        key = (tuple(self.gaps[idx]), padding, self._idx)
        positions = _row_positions.get(key)
        if positions is None:
            if len(_row_positions) >= ROW_POSITIONS_KEPT:
                _row_positions.clear()
            positions = _row_positions[key] = mx.array(self._positions(idx, padding))
        keys: Any = self.keys
        values: Any = self.values
        # Gathered piece by piece where it is stored (batch_rows.RowView): one gather a piece, not a gather
        # of the whole row and a copy of each piece.
        return RowView(keys[idx:idx + 1, :, :self._idx], values[idx:idx + 1, :, :self._idx], positions)

    def finalize(self) -> None:
        if self._right_padding is not None and self.has_gaps():
            self.compact()  # mlx-lm's class from here
        BatchKVCache.finalize(self)

    def compact(self) -> None:
        """Gather every row's tokens to the right end, drop the left padding all rows share: no gaps left."""
        if not self.has_gaps():
            return
        padding = unpadded_decode.padding_of(self)
        rows = [self._positions(e, start) for e, start in enumerate(padding)]
        new_padding = [self._idx - len(row) for row in rows]
        shared = min(new_padding)
        length = self._idx - shared
        indices = np.zeros((len(rows), length), dtype=np.int32)
        for e, row in enumerate(rows):
            indices[e, new_padding[e] - shared:] = row
        gather = mx.array(indices)[:, None, :, None]
        keys: Any = self.keys
        values: Any = self.values
        self.keys = mx.take_along_axis(keys[..., :self._idx, :], gather, axis=2)  # type: ignore[assignment]
        self.values = mx.take_along_axis(values[..., :self._idx, :], gather, axis=2)  # type: ignore[assignment]
        self._idx = length
        self.left_padding = mx.array([value - shared for value in new_padding])
        unpadded_decode.remember(self, [value - shared for value in new_padding])
        self.gaps = [[] for _ in rows]
        self.__class__ = BatchKVCache  # type: ignore[assignment]

    def wants_compacting(self) -> bool:
        if any(len(row) > COMPACT_AT_GAPS for row in self.gaps):
            return True
        padding = unpadded_decode.padding_of(self)
        spare = min(start + sum(end - begin for begin, end in row)
                    for start, row in zip(padding, self.gaps, strict=True))
        return spare >= max(COMPACT_AT_POSITIONS, self._idx // 4)

    def _positions(self, e: int, start: int) -> list[int]:
        """Row ``e``'s token positions from ``start`` (its left padding) to ``_idx``, in order."""
        positions: list[int] = []
        cursor = start
        for begin, end in self.gaps[e]:
            positions.extend(range(cursor, begin))
            cursor = end
        positions.extend(range(cursor, self._idx))
        return positions

    @staticmethod
    def _shift(gaps: list[list[tuple[int, int]]], by: int) -> list[list[tuple[int, int]]]:
        if by:
            for row in gaps:
                row[:] = [(start + by, end + by) for start, end in row]
        return gaps


def _ints(values: Any) -> list[int]:
    """An MLX array's (or a sequence's) values as host ints."""
    return [int(value) for value in np.asarray(values).reshape(-1).tolist()]


def keep_written(caches: Any, width: int, kept: list[int]) -> None:
    """Each row of these batch caches keeps its first ``kept`` of the ``width`` positions just written.

    The rows' common rejected count is trimmed; the rest become the row's
    gaps (``GappedBatchKVCache``): no keys or values move.
    """
    rejected = [width - count for count in kept]
    common = min(rejected)
    extra = [count - common for count in rejected]
    dropped = mx.array(extra) if any(extra) else None
    compact = False
    for layer, cache in enumerate(caches):
        if common:
            cache.trim(common)
        if dropped is not None:
            gapped = GappedBatchKVCache.adopt(cache)
            gapped.drop_tail(extra, dropped)
            # Every layer's cache has the same rows, padding and gaps: the first decides for all.
            compact = compact or (layer == 0 and gapped.wants_compacting())
            if compact:
                gapped.compact()


def from_shared_pass(caches: Any, rows: list[int], lengths: list[int]) -> list[GappedBatchKVCache]:
    """Batch caches of ``rows`` of one batched start pass's per-layer caches, no key moved.

    In such a pass row ``r`` holds its sequence's tokens from position 0 (``lengths[r]`` of them) and the pass's
    filler after them; here the filler up to the longest row becomes the row's gap. mlx-lm's merge would instead
    copy every row into a left-padded buffer, a copy per row, layer, keys and values (4,096 kernels for 64 rows
    of a 32-layer model, each a launch on a GPU), where this is at most one gather per layer and side (none when
    the rows are the pass's first ones).
    """
    picked = None if rows == list(range(len(rows))) else mx.array(rows)
    offsets = mx.array(lengths)
    # The filler past the longest row is no row's: the batch's write index stops there (the next writes
    # overwrite the rest), so that row has no gap, nor has a row alone, whose decode then needs no mask.
    end = max(lengths)
    batch_caches = []
    for cache in caches:
        keys, values = cache.keys, cache.values
        if picked is not None:
            keys, values = keys[picked], values[picked]
        elif len(rows) < keys.shape[0]:
            keys, values = keys[:len(rows)], values[:len(rows)]
        batch = BatchKVCache([0] * len(rows))
        batch.keys, batch.values, batch.offset, batch._idx = keys, values, offsets, end
        gapped = GappedBatchKVCache.adopt(batch)
        gapped.gaps = [[(length, end)] if length < end else [] for length in lengths]  # lists of its own per layer
        batch_caches.append(gapped)
    return batch_caches
