"""The fused dequantize-and-rotate kernel for stored KV: where it applies, and (on CUDA) that it equals MLX's ops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.model import kv_dequant
from mlxcel.model.kv import StoreFormat, _dequantize, _quantize

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel is CUDA-only")


def _stored(dtype, bits: int, group_size: int, tokens: int = 300, heads: int = 8, dim: int = 128):
    mx.random.seed(2)
    rows = (mx.random.normal((1, heads, tokens, dim)) * 3).astype(dtype)
    return _quantize(rows, StoreFormat(bits, group_size))


def _unfused(stored, store_format: StoreFormat, monkeypatch) -> np.ndarray:
    monkeypatch.setattr(kv_dequant, "ENABLED", False)
    try:
        return np.array(_dequantize(stored, store_format).astype(mx.float32))
    finally:
        monkeypatch.setattr(kv_dequant, "ENABLED", True)


@pytest.mark.skipif(mx.cuda.is_available(), reason="on a CPU build")
def test_the_cpu_keeps_mlx_operations() -> None:
    packed, scales, biases = _stored(mx.float32, 8, 64)
    assert not kv_dequant.supported(packed, scales, biases, group_size=64, bits=8)


@cuda
def test_only_layouts_the_kernel_knows_are_taken() -> None:
    packed, scales, biases = _stored(mx.bfloat16, 8, 64)
    assert kv_dequant.supported(packed, scales, biases, group_size=64, bits=8)
    assert not kv_dequant.supported(packed, scales, biases, group_size=64, bits=4)  # the packing disagrees
    assert not kv_dequant.supported(packed, scales, biases, group_size=16, bits=8)
    assert not kv_dequant.supported(packed, scales.astype(mx.float32), biases, group_size=64, bits=8)


@cuda
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (8, 32), (8, 128), (4, 64), (4, 32), (2, 128)])
def test_the_kernel_gives_mlx_operations_rows(dtype, bits, group_size, monkeypatch) -> None:
    store_format = StoreFormat(bits, group_size)
    stored = _stored(dtype, bits, group_size)
    expected = _unfused(stored, store_format, monkeypatch)
    got = _dequantize(stored, store_format)
    assert got.dtype == dtype
    got = np.array(got.astype(mx.float32))
    # Both sum in float32 in another order, then round once: at most one unit in the last place apart.
    ulp = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-20}[dtype]
    assert np.all(np.abs(got - expected) <= ulp * np.maximum(np.abs(expected), 1.0))
    if dtype != mx.float32:  # a 16-bit rounding hides the float32 sums' order almost always
        assert np.mean(got == expected) > 0.95


@cuda
def test_a_slice_of_stored_rows_is_read_as_its_rows(monkeypatch) -> None:
    store_format = StoreFormat(8, 64)
    packed, scales, biases = _stored(mx.bfloat16, 8, 64)
    sliced = (packed[..., 17:230, :], scales[..., 17:230, :], biases[..., 17:230, :])
    expected = _unfused(sliced, store_format, monkeypatch)
    got = np.array(_dequantize(sliced, store_format).astype(mx.float32))
    assert got.shape == (1, 8, 213, 128)
    assert np.max(np.abs(got - expected) / np.maximum(np.abs(expected), 1.0)) <= 2.0**-7
