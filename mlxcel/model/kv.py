"""The detached KV set: a finished sequence's per-layer cache, outside any batch.

A stored prefix is a list of *pieces*, each the keys and values of a run of
consecutive tokens in every layer, in token order; the last one may be used
only in part. A piece is written once and never again, so many stored
prefixes can hold the same piece: a conversation that adopted a shared
system prompt donates only what it added (``detach(..., base=adopted)``),
and its entry reuses the system prompt's piece instead of a copy of it.

Only the device thread calls ``detach`` and ``adopt`` (they touch MLX). The
metadata (``length``, ``nbytes``, ``pieces()``, ``can_adopt``) is plain
Python, so the scheduler and the cache store may read it without touching an
array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class AdoptError(Exception):
    """A stored payload cannot seed a new sequence at the requested length."""


class KvPiece:
    """Per-layer keys and values of ``length`` consecutive tokens, in a buffer of their own."""

    __slots__ = ("layers", "length", "nbytes")

    def __init__(self, layers: list[tuple[mx.array, mx.array]], length: int) -> None:
        self.layers = layers
        self.length = length
        self.nbytes = sum(keys.nbytes + values.nbytes for keys, values in layers)

    def __repr__(self) -> str:
        return f"KvPiece(length={self.length}, nbytes={self.nbytes})"


class DetachedKV:
    """A prefix of ``length`` tokens: ``segments`` are (piece, tokens used from its start), in order.

    ``nbytes`` is what the prefix would take on its own (its logical bytes);
    the pieces it holds, shared or not, are ``pieces()``. A piece used in
    part stays whole in memory.
    """

    __slots__ = ("length", "nbytes", "segments", "trimmable")

    def __init__(self, segments: Sequence[tuple[KvPiece, int]]) -> None:
        self.segments = tuple(segments)
        self.length = sum(used for _, used in self.segments)
        self.nbytes = sum(piece.nbytes * used // piece.length for piece, used in self.segments)
        self.trimmable = True

    @classmethod
    def whole(cls, layers: list[tuple[mx.array, mx.array]], length: int) -> DetachedKV:
        """A prefix held in one piece of its own."""
        return cls([(KvPiece(layers, length), length)])

    def pieces(self) -> tuple[KvPiece, ...]:
        return tuple(piece for piece, _ in self.segments)

    def arrays(self) -> list[mx.array]:
        return [array for piece in self.pieces() for pair in piece.layers for array in pair]

    def can_adopt(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.length

    def cut(self, num_tokens: int) -> DetachedKV:
        """The first ``num_tokens`` tokens, on the same pieces (nothing is copied)."""
        if not 0 <= num_tokens <= self.length:
            raise AdoptError(f"cannot cut {num_tokens} tokens from an entry of {self.length}")
        segments: list[tuple[KvPiece, int]] = []
        left = num_tokens
        for piece, used in self.segments:
            if left <= 0:
                break
            segments.append((piece, min(used, left)))
            left -= used
        return DetachedKV(segments)

    def rows(self, start: int, end: int, layers: range | None = None, *, spare: int = 0
             ) -> list[tuple[mx.array, mx.array]]:
        """Per layer (all, or those in ``layers``), the keys and values of token rows [start, end).

        Views where the rows lie in one piece, else one concatenation per layer, followed by
        ``spare`` zero rows (room for rows to be written next).
        """
        if not 0 <= start <= end <= self.length:
            raise AdoptError(f"no rows [{start}, {end}) in an entry of {self.length}")
        spans: list[tuple[KvPiece, int, int]] = []
        offset = 0
        for piece, used in self.segments:
            begin, stop = max(start, offset), min(end, offset + used)
            if begin < stop:
                spans.append((piece, begin - offset, stop - offset))
            offset += used
        chosen = []
        for layer in layers if layers is not None else range(len(self.segments[0][0].layers)):
            parts = [(piece.layers[layer][0][..., begin:stop, :], piece.layers[layer][1][..., begin:stop, :])
                     for piece, begin, stop in spans]
            if len(parts) == 1:
                chosen.append(parts[0])
            else:
                chosen.append((_joined([keys for keys, _ in parts], spare),
                               _joined([values for _, values in parts], spare)))
        return chosen

    def __repr__(self) -> str:
        return f"DetachedKV(length={self.length}, nbytes={self.nbytes}, pieces={len(self.segments)})"


def detach(
    caches: Sequence[Any], num_tokens: int, *, base: DetachedKV | None = None, split_at: int | None = None,
    evaluate: bool = True,
) -> DetachedKV | None:
    """Detach a single sequence's caches (as extracted from a batch).

    ``base`` is a stored prefix the caches began from (what the sequence
    adopted, or its prompt's earlier donation): its pieces are reused and
    only the rows past it are copied into a new piece (two, split at
    ``split_at`` when it falls inside them: a finished sequence's prompt and
    reply, so the reply's rows can be freed once the next turn, which
    re-renders the reply, no longer needs them). Returns None for
    layer kinds that cannot be resumed from an arbitrary prefix (rotating
    windows, recurrent state): those families go through session snapshots
    instead. With ``evaluate=False`` the caller evaluates ``arrays()``
    itself (with other work, in one go).
    """
    start = 0
    if base is not None and base.length > 0:
        start = min(base.length, num_tokens)
        base = base.cut(start)
    edges = [start, num_tokens]
    if split_at is not None and start < split_at < num_tokens:
        edges.insert(1, split_at)
    runs: list[list[tuple[mx.array, mx.array]]] = [[] for _ in edges[1:]]
    for cache in caches:
        if type(cache) is not KVCache or cache.keys is None:
            return None
        if cache.offset < num_tokens:
            return None
        for run, begin, end in zip(runs, edges, edges[1:], strict=False):
            keys = cache.keys[..., begin:end, :]
            values = cache.values[..., begin:end, :]
            if keys.shape[2] != cache.keys.shape[2]:
                # A copy, so the piece owns its buffer instead of pinning the larger step-padded one.
                keys, values = mx.contiguous(keys), mx.contiguous(values)
            run.append((keys, values))
    segments = list(base.segments) if base is not None and start else []
    for run, begin, end in zip(runs, edges, edges[1:], strict=False):
        if begin < end:
            segments.append((KvPiece(run, end - begin), end - begin))
    detached = DetachedKV(segments)
    if evaluate:
        mx.eval(detached.arrays())
    return detached


def adopt(detached: DetachedKV, num_tokens: int, *, room: int = 0) -> list[KVCache]:
    """Fresh per-layer caches holding the first ``num_tokens`` stored rows.

    From one piece they are views (no copy; the cache copies them once,
    when the first new token is written). From several, one concatenation
    per layer, with ``room`` more rows (rounded up to the cache's step) so
    that the tokens a direct start runs next are written in place rather
    than copied once more.
    """
    if not detached.can_adopt(num_tokens):
        raise AdoptError(
            f"cannot adopt {num_tokens} tokens from an entry of {detached.length}"
        )
    caches = []
    for keys, values in detached.rows(0, num_tokens, spare=-(-room // KVCache.step) * KVCache.step):
        cache = KVCache()
        cache.keys = keys
        cache.values = values
        cache.offset = num_tokens
        caches.append(cache)
    return caches


def _joined(parts: list[mx.array], spare: int) -> mx.array:
    if spare:
        batch, heads, _, dim = parts[0].shape
        parts = [*parts, mx.zeros((batch, heads, spare, dim), parts[0].dtype)]
    return mx.concatenate(parts, axis=2)
