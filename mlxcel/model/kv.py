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

With ``--prompt-cache-kv-bits`` a piece keeps its rows quantized (``mx.quantize``
along head_dim, each of keys and values a (packed, scales, biases) triple, as
mlx-lm's ``QuantizedKVCache`` keeps them): the store's byte budget then holds
about 1.9x (8 bits) or 3.6x (4 bits) the tokens of bf16 KV. Adoption
dequantizes once into a plain ``KVCache``: mlx-lm's ``QuantizedKVCache`` has no
``merge``, so a quantized live cache could not join the batch.

Each group of a row is quantized after an orthonormal Hadamard rotation
(``mx.hadamard_transform`` over the group, in float32) and rotated back after
dequantizing, in float32, rounded once to the KV dtype. A few large channels
(keys have them) otherwise set every group's scale; rotated, their energy is
spread over the group: at the same bytes a hit's greedy reply equalled the cold
run's in 97.7% of 220 real-model hits at 8 bits, against 95.0% with plain
groups (benchmarks/kv_quant_agreement.py, docs/prompt-cache.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxcel.model import kv_dequant
from mlxcel.model.batch_rows import RowView


@attrs.frozen
class StoreFormat:
    """How stored pieces keep their rows: exact (bits 0), or quantized with bits and group_size."""

    bits: int = 0
    group_size: int = 64
    # Quantized groups are Hadamard-rotated (the default; False: plain mx.quantize, kept for measuring).
    rotated: bool = True

    @property
    def quantized(self) -> bool:
        return self.bits != 0

    def fits(self, head_dim: int) -> bool:
        return self.quantized and head_dim % self.group_size == 0


EXACT = StoreFormat()
# The device thread's format for what it detaches (one device thread per engine, so one per engine).
_device_format = threading.local()


def use_store_format(store_format: StoreFormat) -> None:
    """Set, on the calling (device) thread, the format ``detach`` stores new pieces in."""
    _device_format.value = store_format


def store_format() -> StoreFormat:
    return getattr(_device_format, "value", EXACT)


# One stored tensor: a plain array, or a quantized (packed, scales, biases) triple.
Stored = Any


def _rows_of(stored: Stored, begin: int, stop: int) -> Stored:
    if isinstance(stored, tuple):
        return tuple(part[..., begin:stop, :] for part in stored)
    return stored[..., begin:stop, :]


def _nbytes(stored: Stored) -> int:
    return sum(part.nbytes for part in stored) if isinstance(stored, tuple) else stored.nbytes


def _rotate(array: mx.array, group_size: int) -> mx.array:
    """Each group of ``group_size`` along the last axis times the orthonormal Hadamard matrix (its own inverse)."""
    shape = array.shape
    grouped = array.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    return mx.hadamard_transform(grouped, scale=group_size**-0.5).reshape(shape)


def _quantize(array: mx.array, store_format: StoreFormat) -> Stored:
    if store_format.rotated:
        # Rotated in float32, rounded once to the KV dtype, whose scales mx.quantize then computes itself.
        array = _rotate(array.astype(mx.float32), store_format.group_size).astype(array.dtype)
    packed, scales, biases = mx.quantize(array, group_size=store_format.group_size, bits=store_format.bits)
    return packed, scales, biases


def _dequantize(stored: tuple[mx.array, mx.array, mx.array], store_format: StoreFormat) -> mx.array:
    packed, scales, biases = stored
    group_size, bits = store_format.group_size, store_format.bits
    if store_format.rotated and kv_dequant.supported(packed, scales, biases, group_size=group_size, bits=bits):
        return kv_dequant.dequantize_rotated(packed, scales, biases, group_size=group_size, bits=bits)
    if not store_format.rotated:
        return mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
    # In float32 and rotated back there, then one rounding to the KV dtype (the scales' dtype).
    rows = mx.dequantize(packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                         bits=bits)
    return _rotate(rows, group_size).astype(scales.dtype)


class AdoptError(Exception):
    """A stored payload cannot seed a new sequence at the requested length."""


class KvPiece:
    """Per-layer keys and values of ``length`` consecutive tokens, in a buffer of their own.

    With a quantized ``store_format`` each of a layer's keys and values is a
    (packed, scales, biases) triple; ``dense`` reads rows back as plain arrays.
    """

    __slots__ = ("layers", "length", "nbytes", "store_format")

    def __init__(self, layers: list[tuple[Stored, Stored]], length: int, store_format: StoreFormat = EXACT) -> None:
        self.layers = layers
        self.length = length
        self.store_format = store_format
        self.nbytes = sum(_nbytes(keys) + _nbytes(values) for keys, values in layers)

    def dense(self, stored: Stored) -> mx.array:
        if not isinstance(stored, tuple):
            return stored
        return _dequantize(stored, self.store_format)

    def __repr__(self) -> str:
        kind = f", kv_bits={self.store_format.bits}" if self.store_format.quantized else ""
        return f"KvPiece(length={self.length}, nbytes={self.nbytes}{kind})"


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
        return [array for piece in self.pieces() for pair in piece.layers for stored in pair
                for array in (stored if isinstance(stored, tuple) else (stored,))]

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

    @property
    def store_format(self) -> StoreFormat:
        return self.segments[0][0].store_format if self.segments else EXACT

    def _spans(self, start: int, end: int) -> list[tuple[KvPiece, int, int]]:
        if not 0 <= start <= end <= self.length:
            raise AdoptError(f"no rows [{start}, {end}) in an entry of {self.length}")
        spans: list[tuple[KvPiece, int, int]] = []
        offset = 0
        for piece, used in self.segments:
            begin, stop = max(start, offset), min(end, offset + used)
            if begin < stop:
                spans.append((piece, begin - offset, stop - offset))
            offset += used
        return spans

    def stored_rows(self, start: int, end: int, layers: range | None = None) -> list[tuple[Stored, Stored]]:
        """Per layer, token rows [start, end) as stored (quantized triples stay quantized; for disk)."""
        spans = self._spans(start, end)
        if len({piece.store_format for piece, _begin, _stop in spans}) > 1:
            raise AdoptError("the rows span pieces of different store formats")
        chosen = []
        for layer in layers if layers is not None else range(len(self.segments[0][0].layers)):
            parts = [(_rows_of(piece.layers[layer][0], begin, stop), _rows_of(piece.layers[layer][1], begin, stop))
                     for piece, begin, stop in spans]
            if len(parts) == 1:
                chosen.append(parts[0])
                continue
            keys, values = zip(*parts, strict=True)
            chosen.append((_concatenated(list(keys)), _concatenated(list(values))))
        return chosen

    def rows(self, start: int, end: int, layers: range | None = None, *, spare: int = 0
             ) -> list[tuple[mx.array, mx.array]]:
        """Per layer (all, or those in ``layers``), the keys and values of token rows [start, end).

        Views where the rows lie in one exact piece, else one concatenation per layer, followed by
        ``spare`` zero rows (room for rows to be written next). Quantized rows are dequantized.
        """
        spans = self._spans(start, end)
        chosen = []
        for layer in layers if layers is not None else range(len(self.segments[0][0].layers)):
            parts = [(piece.dense(_rows_of(piece.layers[layer][0], begin, stop)),
                      piece.dense(_rows_of(piece.layers[layer][1], begin, stop)))
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

    The new pieces take the device thread's ``store_format()``: quantized,
    the copy out of the cache is the quantization itself (one kernel, run
    with the step's other work when not evaluated here).
    """
    chosen_format = store_format()
    start = 0
    if base is not None and base.length > 0:
        start = min(base.length, num_tokens)
        base = base.cut(start)
    edges = [start, num_tokens]
    if split_at is not None and start < split_at < num_tokens:
        edges.insert(1, split_at)
    runs: list[list[tuple[mx.array, mx.array]]] = [[] for _ in edges[1:]]
    for cache in caches:
        if not (type(cache) is KVCache or isinstance(cache, RowView)) or cache.keys is None:
            return None
        if cache.offset < num_tokens:
            return None
        if chosen_format.quantized and not chosen_format.fits(cache.keys.shape[-1]):
            chosen_format = EXACT  # head_dim not a multiple of the group: the engine warned at start-up
        for run, begin, end in zip(runs, edges, edges[1:], strict=False):
            if isinstance(cache, RowView) and not chosen_format.quantized:
                keys, values = cache.piece(begin, end)  # copied straight out of the batch's buffers
            else:
                keys = cache.keys[..., begin:end, :]
                values = cache.values[..., begin:end, :]
                if keys.shape[2] != cache.keys.shape[2] and not chosen_format.quantized:
                    # A copy, so the piece owns its buffer instead of pinning the larger step-padded one.
                    keys, values = mx.contiguous(keys), mx.contiguous(values)
            run.append((keys, values))
    segments = list(base.segments) if base is not None and start else []
    for run, begin, end in zip(runs, edges, edges[1:], strict=False):
        if begin < end:
            if chosen_format.quantized:
                run = [(_quantize(keys, chosen_format), _quantize(values, chosen_format)) for keys, values in run]
            segments.append((KvPiece(run, end - begin, chosen_format), end - begin))
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


def adopt_rows(handles: Sequence[DetachedKV], num_tokens: int, *, room: int = 0) -> list[KVCache]:
    """Per layer one cache of ``len(handles)`` rows: row i holds the first ``num_tokens`` rows of ``handles[i]``.

    Each layer's keys and values are written into one buffer with ``room``
    rows more, so the tokens the rows run next are written in place (a batch
    of hits on prefixes cut to one length shares a forward pass).
    """
    for handle in handles:
        if not handle.can_adopt(num_tokens):
            raise AdoptError(f"cannot adopt {num_tokens} tokens from an entry of {handle.length}")
    spans = [handle._spans(0, num_tokens) for handle in handles]
    caches = []
    for layer in range(len(handles[0].segments[0][0].layers)):
        buffers: list[mx.array] = []
        for side in (0, 1):
            buffer = None
            for row, row_spans in enumerate(spans):
                position = 0
                for piece, begin, stop in row_spans:
                    rows = piece.dense(_rows_of(piece.layers[layer][side], begin, stop))
                    if buffer is None:
                        _one, heads, _length, dim = rows.shape
                        buffer = mx.zeros((len(handles), heads, num_tokens + room, dim), rows.dtype)
                    buffer[row:row + 1, :, position:position + stop - begin] = rows
                    position += stop - begin
            assert buffer is not None, "can_adopt: at least one row"
            buffers.append(buffer)
        cache = KVCache()
        cache.keys, cache.values = buffers
        cache.offset = num_tokens
        caches.append(cache)
    return caches


def _concatenated(parts: list[Stored]) -> Stored:
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(list(components), axis=2) for components in zip(*parts, strict=True))
    return mx.concatenate(parts, axis=2)


def _joined(parts: list[mx.array], spare: int) -> mx.array:
    if spare:
        batch, heads, _, dim = parts[0].shape
        parts = [*parts, mx.zeros((batch, heads, spare, dim), parts[0].dtype)]
    return mx.concatenate(parts, axis=2)
