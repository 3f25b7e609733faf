"""Quantized stored KV (--prompt-cache-kv-bits): bytes, accuracy, sharing, adoption and the disk tier."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from mlxcel.cache.key import CacheContext
from mlxcel.disk.device import DeviceDisk
from mlxcel.disk.directory import DiskSettings
from mlxcel.disk.tier import DiskTier
from mlxcel.model.kv import EXACT, StoreFormat, adopt, adopt_rows, detach, store_format, use_store_format

LAYERS, HEADS, DIM = 2, 2, 64
TOKENS = tuple(range(100, 700))
CONTEXT = CacheContext(model_id="m", template_sig="t")


@pytest.fixture
def stored_as():
    """Sets this (the test's) thread's store format, as the device thread does at start-up."""
    def set_format(bits: int, group_size: int = 64) -> None:
        use_store_format(StoreFormat(bits, group_size))
    yield set_format
    use_store_format(EXACT)


def caches_of(rows: int, dtype=mx.bfloat16, seed: int = 0) -> list[KVCache]:
    generator = np.random.default_rng(seed)
    caches = []
    for _layer in range(LAYERS):
        cache = KVCache()
        keys, values = (mx.array(generator.standard_normal((1, HEADS, rows, DIM), dtype=np.float32)).astype(dtype)
                        for _ in range(2))
        cache.keys, cache.values, cache.offset = keys, values, rows
        caches.append(cache)
    return caches


def dense(caches: list[KVCache], rows: int) -> np.ndarray:
    return np.stack([np.array(cache.keys[..., :rows, :].astype(mx.float32)) for cache in caches])


def test_the_default_stores_exact_rows() -> None:
    assert store_format() == EXACT
    caches = caches_of(40)
    stored = detach(caches, 40)
    assert stored is not None
    assert np.array_equal(dense(adopt(stored, 40), 40), dense(caches, 40))


# Largest error on Gaussian rows: rotated groups spread it (a little larger at most, smaller on average).
@pytest.mark.parametrize(("bits", "ratio", "error"), [(8, 1.88, 0.1), (4, 3.5, 0.5)])
def test_quantized_pieces_take_fewer_bytes_and_adopt_close_to_the_rows(stored_as, bits, ratio, error) -> None:
    caches = caches_of(40)
    exact = detach(caches, 40)
    stored_as(bits)
    quantized = detach(caches, 40)
    assert exact is not None
    assert quantized is not None
    assert quantized.pieces()[0].store_format == StoreFormat(bits, 64)
    # bf16, head_dim 64, groups of 64: 128 bytes a row become 64 + 4 (8 bits) or 32 + 4 (4 bits).
    assert exact.nbytes / quantized.nbytes == pytest.approx(ratio, rel=0.03)
    adopted = adopt(quantized, 33)
    assert all(type(cache) is KVCache and cache.offset == 33 for cache in adopted)
    assert adopted[0].keys.dtype == mx.bfloat16  # a plain cache: it joins the batch like any other
    difference = np.abs(dense(adopted, 33) - dense(caches, 33)).max()
    assert 0 < difference < error


def test_a_quantized_donation_shares_its_base_and_quantizes_only_the_new_rows(stored_as) -> None:
    stored_as(8)
    base = detach(caches_of(64), 32)
    assert base is not None
    grown = detach(caches_of(64), 64, base=base, split_at=48)
    assert grown is not None
    assert grown.pieces()[0] is base.pieces()[0]
    assert [piece.length for piece in grown.pieces()] == [32, 16, 16]
    assert {piece.store_format.bits for piece in grown.pieces()} == {8}
    # Rows across three quantized pieces come back as one dense run.
    rows = grown.rows(10, 60)
    assert rows[0][0].shape == (1, HEADS, 50, DIM)


def test_a_head_dim_that_is_not_a_multiple_of_the_group_is_stored_exact(stored_as) -> None:
    stored_as(8, 128)
    stored = detach(caches_of(16), 16)  # head_dim 64 < 128
    assert stored is not None
    assert stored.pieces()[0].store_format == EXACT


def open_tier(directory: Path, bits: int) -> DiskTier:
    tier = DiskTier(DiskSettings(directory=directory, budget_bytes=1 << 30, write_bytes_per_second=1 << 30,
                                 kv_bits=bits), "model-a")
    tier.open()
    return tier


def test_quantized_pieces_go_to_disk_quantized_and_come_back_bit_for_bit(tmp_path: Path, stored_as) -> None:
    stored_as(8)
    stored = detach(caches_of(len(TOKENS)), len(TOKENS))
    assert stored is not None
    writer = open_tier(tmp_path, 8)
    device = DeviceDisk(writer, LAYERS)
    device.persist(stored, writer.plan_write(CONTEXT, TOKENS), urgent=False)
    while device.has_work():
        device.work()
    writer.close()
    files = sorted(path for path in tmp_path.iterdir() if path.name.startswith("kv-"))
    assert len(files) == 3
    exact_bytes = LAYERS * 2 * HEADS * DIM * 2 * len(TOKENS)
    assert sum(path.stat().st_size for path in files) < exact_bytes * 0.56  # half, plus scales and headers
    reader = open_tier(tmp_path, 8)
    request = (*TOKENS, 1)
    plan = reader.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    loaded = DeviceDisk(reader, LAYERS).load(plan, None)
    assert loaded is not None
    assert loaded.length == 592
    assert {piece.store_format for piece in loaded.pieces()} == {StoreFormat(8, 64)}
    for (keys, values), (want_keys, want_values) in zip(loaded.rows(0, 592), stored.rows(0, 592), strict=True):
        assert np.array_equal(np.array(keys.astype(mx.float32)), np.array(want_keys.astype(mx.float32)))
        assert np.array_equal(np.array(values.astype(mx.float32)), np.array(want_values.astype(mx.float32)))
    # A server that keeps exact KV refuses them (in use their fingerprints differ as well).
    exact = open_tier(tmp_path, 0)
    plan = exact.probe(CONTEXT, request, len(request) - 1, 0)
    assert plan is not None
    assert DeviceDisk(exact, LAYERS).load(plan, None) is None
    assert exact.statistics().refusals["fingerprint"] == 1


def rows_with_a_large_channel(dtype) -> KVCache:
    """Keys-like rows: one channel 40x the others (real keys have a few such), 48 tokens."""
    rows = np.random.default_rng(1).standard_normal((1, HEADS, 48, DIM)).astype(np.float32)
    rows[..., 5] *= 40
    cache = KVCache()
    cache.keys = cache.values = mx.array(rows).astype(dtype)
    cache.offset = 48
    return cache


def rms_error(store_format: StoreFormat, cache: KVCache) -> float:
    use_store_format(store_format)
    stored = detach([cache], 48)
    assert stored is not None
    (adopted,) = adopt(stored, 48)
    assert adopted.keys.dtype == cache.keys.dtype  # one rounding, back to the KV dtype
    error = np.array(adopted.keys.astype(mx.float32)) - np.array(cache.keys.astype(mx.float32))
    return float(np.sqrt(np.mean(error**2)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(("bits", "bound"), [(8, 0.025), (4, 0.35)])
def test_the_default_quantized_format_rotates_each_group_so_a_large_channel_costs_little(
        stored_as, dtype, bits, bound) -> None:
    # The measured choice (benchmarks/kv_quant_agreement.py): Hadamard-rotated groups. Plain groups
    # let the large channel set every scale; rotated, the same bytes keep a third of the error at 8 bits.
    cache = rows_with_a_large_channel(dtype)
    assert StoreFormat(bits).rotated
    rotated, plain = rms_error(StoreFormat(bits), cache), rms_error(StoreFormat(bits, rotated=False), cache)
    assert rotated < bound
    assert rotated < 0.5 * plain
    stored_as(bits)
    quantized = detach([cache], 48)
    assert quantized is not None
    # The rotation costs no bytes: packed words and one scale and bias per group, as before.
    row_bytes = DIM * bits // 8 + 2 * cache.keys.dtype.size
    assert quantized.nbytes == 2 * HEADS * 48 * row_bytes


def test_stored_groups_hold_the_rotated_rows(stored_as) -> None:
    """The layout the disk tier writes: mx.quantize of the Hadamard-rotated rows (fingerprinted as such)."""
    stored_as(8)
    cache = rows_with_a_large_channel(mx.float32)
    stored = detach([cache], 48)
    assert stored is not None
    packed, scales, biases = stored.pieces()[0].layers[0][0]
    plain = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=8))
    rotated = np.array(mx.hadamard_transform(cache.keys, scale=DIM**-0.5))
    assert np.abs(plain - rotated).max() < 0.1
    assert np.abs(plain - np.array(cache.keys)).max() > 10  # not the rows themselves


def test_quantized_prefixes_adopt_into_one_buffer_as_each_adopts_alone(stored_as) -> None:
    stored_as(8)
    first, second = detach(caches_of(64, seed=1), 64), detach(caches_of(64, seed=2), 64)
    assert first is not None
    assert second is not None
    together = adopt_rows([first, second], 64)
    for row, handle in enumerate((first, second)):
        assert np.array_equal(dense([cache for cache in adopt(handle, 64)], 64),
                              np.stack([np.array(cache.keys[row:row + 1].astype(mx.float32)) for cache in together]))
