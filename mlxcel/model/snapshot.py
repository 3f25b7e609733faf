"""Whole-state session snapshots: every layer's cache (KV, rotating KV, recurrent arrays).

Device-thread only for ``capture`` and ``restore`` (they touch MLX); the
metadata is plain Python. A snapshot resumes at exactly the point where it
was taken, or, when it is ``cuttable`` (no recurrent layer, and every sliding
layer still holds every token: its window has not wrapped), at any earlier
point; and only into a model whose layers match it. Anything else is a
``SnapshotMismatch`` that names what differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from mlxcel.model.batch_rows import RowView

SUPPORTED_LAYER_KINDS = (KVCache, RotatingKVCache, ArraysCache)


class SnapshotMismatch(Exception):
    """A snapshot cannot be restored into this model: the message names the difference."""


class SessionSnapshot:
    """The per-layer state of one sequence after ``length`` tokens."""

    __slots__ = ("cuttable", "family", "layers", "length", "nbytes")

    def __init__(self, family: str, layers: list[Any], length: int) -> None:
        self.family = family
        self.layers = layers
        self.length = length
        self.nbytes = sum(layer.nbytes for layer in layers)
        self.cuttable = all(_holds_every_token(layer, length) for layer in layers)

    def can_adopt(self, num_tokens: int) -> bool:
        return num_tokens == self.length or (self.cuttable and 0 < num_tokens < self.length)

    def __repr__(self) -> str:
        return f"SessionSnapshot({self.family}, layers={len(self.layers)}, length={self.length}, nbytes={self.nbytes})"


def _own_copy(array: mx.array | None) -> mx.array | None:
    # Extracted recurrent states are views of the batch's arrays; copy them so
    # the snapshot neither pins the whole batch nor depends on it.
    return None if array is None else mx.array(array) * 1


def capture(family: str, caches: Sequence[Any], length: int) -> SessionSnapshot:
    """Take a snapshot of one sequence's caches (as extracted from a batch)."""
    layers: list[Any] = []
    for index, cache in enumerate(caches):
        if not isinstance(cache, SUPPORTED_LAYER_KINDS):
            raise SnapshotMismatch(f"layer {index}: cache kind {type(cache).__name__} cannot be snapshotted")
        # Any: mlx-lm's cache classes type their state lists loosely ([None] * size).
        copy: Any
        if isinstance(cache, ArraysCache):
            copy = ArraysCache(len(cache.cache))
            copy.cache = [_own_copy(array) for array in cache.cache]
        else:
            copy = _clone(cache)
        layers.append(copy)
    mx.eval([state for layer in layers for state in _arrays(layer)])
    return SessionSnapshot(family, layers, length)


def _holds_every_token(cache: Any, length: int) -> bool:
    """Whether a layer's state can be cut back to any earlier length."""
    if isinstance(cache, ArraysCache) or cache.keys is None:
        return False  # recurrent state folds every token in; it cannot be unwound
    if isinstance(cache, RotatingKVCache):
        # In temporal order from token 0, nothing dropped: the window has not wrapped.
        return bool(cache.offset == length == cache.keys.shape[2] == cache._idx)
    return bool(cache.offset == length)


def _cut(cache: Any, num_tokens: int) -> Any:
    """A layer of a cuttable snapshot, resumed after its first num_tokens tokens."""
    copy: Any  # mlx-lm's cache classes type their state loosely
    if isinstance(cache, RotatingKVCache):
        copy = RotatingKVCache(cache.max_size, cache.keep)
        copy._idx = num_tokens
    else:
        copy = KVCache()
    copy.keys = cache.keys[..., :num_tokens, :]
    copy.values = cache.values[..., :num_tokens, :]
    copy.offset = num_tokens
    return copy


def _arrays(cache: Any) -> list[mx.array]:
    if isinstance(cache, ArraysCache):
        states: list[Any] = cache.cache
        return [array for array in states if array is not None]
    return [array for array in (cache.keys, cache.values) if array is not None]


def _clone(cache: Any) -> Any:
    """A new cache object over the same (immutable) arrays."""
    copy: Any  # mlx-lm's cache classes type their state loosely
    if isinstance(cache, ArraysCache):
        copy = ArraysCache(len(cache.cache))
        copy.cache = list(cache.cache)
        return copy
    if isinstance(cache, RotatingKVCache):
        copy = RotatingKVCache(cache.max_size, cache.keep)
        copy.keys, copy.values, copy.offset, copy._idx = cache.keys, cache.values, cache.offset, cache._idx
        return copy
    copy = KVCache()
    if isinstance(cache, RowView):
        # Views of a batch's buffers: copied, so that the snapshot does not pin the batch.
        copy.keys, copy.values = cache.piece(0, cache.offset)
        copy.offset = cache.offset
        return copy
    copy.keys, copy.values, copy.offset = cache.keys, cache.values, cache.offset
    return copy


def restore(snapshot: SessionSnapshot, family: str, fresh: Sequence[Any], num_tokens: int | None = None) -> list[Any]:
    """Caches for a new sequence that resume the snapshot, checked against the model's own.

    ``fresh`` is what the model makes for a new sequence (``make_prompt_cache``):
    layer count, kinds, window sizes and state shapes must all agree.
    ``num_tokens`` below the snapshot's length cuts a cuttable snapshot back
    to that point (the partial restore at a longest common prefix).
    """
    if num_tokens is None:
        num_tokens = snapshot.length
    if num_tokens != snapshot.length and not snapshot.can_adopt(num_tokens):
        raise SnapshotMismatch(
            f"a {snapshot.length}-token snapshot cannot resume at {num_tokens} tokens: "
            "it holds recurrent state or a wrapped window")
    if snapshot.family != family:
        raise SnapshotMismatch(f"snapshot of family {snapshot.family!r} cannot resume a {family!r} model")
    if len(snapshot.layers) != len(fresh):
        raise SnapshotMismatch(f"snapshot has {len(snapshot.layers)} layers, the model {len(fresh)}")
    restored = []
    for index, (stored, expected) in enumerate(zip(snapshot.layers, fresh, strict=True)):
        if type(stored) is not type(expected):
            raise SnapshotMismatch(
                f"layer {index}: snapshot holds {type(stored).__name__}, the model uses {type(expected).__name__}"
            )
        if isinstance(stored, RotatingKVCache) and stored.max_size != expected.max_size:
            raise SnapshotMismatch(
                f"layer {index}: window {stored.max_size} in the snapshot, {expected.max_size} in the model"
            )
        if isinstance(stored, ArraysCache) and len(stored.cache) != len(expected.cache):
            raise SnapshotMismatch(
                f"layer {index}: {len(stored.cache)} state arrays, the model has {len(expected.cache)}"
            )
        restored.append(_clone(stored) if num_tokens == snapshot.length else _cut(stored, num_tokens))
    return restored

