"""The detached KV set: a finished sequence's per-layer cache, outside any batch.

Only the device thread calls ``detach`` and ``adopt`` (they touch MLX). The
metadata (``length``, ``nbytes``, ``can_adopt``) is plain Python, so the
scheduler and the cache store may read it without touching an array.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache


class AdoptError(Exception):
    """A stored payload cannot seed a new sequence at the requested length."""


class DetachedKV:
    """Per-layer keys and values of ``length`` tokens, compact and immutable.

    MLX arrays are values: a new sequence gets sliced views (no copy), and the
    batch merge copies them into its own buffers, so the stored rows are never
    written again.
    """

    __slots__ = ("layers", "length", "nbytes", "trimmable")

    def __init__(self, layers: list[tuple[mx.array, mx.array]], length: int) -> None:
        self.layers = layers
        self.length = length
        self.nbytes = sum(keys.nbytes + values.nbytes for keys, values in layers)
        self.trimmable = True

    def arrays(self) -> list[mx.array]:
        return [array for pair in self.layers for array in pair]

    def can_adopt(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.length

    def __repr__(self) -> str:
        return f"DetachedKV(length={self.length}, nbytes={self.nbytes})"


def detach(caches: Sequence[Any], num_tokens: int, *, evaluate: bool = True) -> DetachedKV | None:
    """Detach a single sequence's caches (as extracted from a batch).

    Returns None for layer kinds that cannot be resumed from an arbitrary
    prefix (rotating windows, recurrent state): those families go through
    session snapshots instead. With ``evaluate=False`` the caller evaluates
    ``arrays()`` itself (with other work, in one go).
    """
    layers = []
    for cache in caches:
        if type(cache) is not KVCache or cache.keys is None:
            return None
        if cache.offset < num_tokens:
            return None
        keys = cache.keys[..., :num_tokens, :]
        values = cache.values[..., :num_tokens, :]
        if keys.shape[2] != cache.keys.shape[2]:
            # Copy so the entry does not pin the larger step-padded buffer.
            keys, values = mx.contiguous(keys), mx.contiguous(values)
        layers.append((keys, values))
    detached = DetachedKV(layers, num_tokens)
    if evaluate:
        mx.eval(detached.arrays())
    return detached


def adopt(detached: DetachedKV, num_tokens: int) -> list[KVCache]:
    """Fresh per-layer caches holding the first ``num_tokens`` stored rows."""
    if not detached.can_adopt(num_tokens):
        raise AdoptError(
            f"cannot adopt {num_tokens} tokens from an entry of {detached.length}"
        )
    caches = []
    for keys, values in detached.layers:
        cache = KVCache()
        cache.keys = keys[..., :num_tokens, :]
        cache.values = values[..., :num_tokens, :]
        cache.offset = num_tokens
        caches.append(cache)
    return caches
