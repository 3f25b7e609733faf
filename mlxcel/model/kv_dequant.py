"""Rotated quantized KV back to plain rows in one CUDA kernel: unpack, scale, rotate back, round.

The quantized store (``mlxcel/model/kv.py``) keeps each group of a row
Hadamard-rotated and affine-quantized. Reading rows back with MLX's own
operations is five kernels per array (the scales and biases to float32,
``mx.dequantize``, ``mx.hadamard_transform``, the cast back), each a pass over
float32 intermediates: on the H200, 0.7 ms per layer's keys of a 24k-token
8B prefix, about 15 ms of a warm 8k-token hit over 32 layers against 2-3 ms
for an exact one. This kernel does it in one pass: one warp per group, each
lane holding ``group_size / 32`` values, the transform's butterflies in
registers and warp shuffles, in float32 as the unfused path, then one
rounding to the KV dtype.

``supported`` takes the arrays of a stored piece on a CUDA device; every
other case goes through MLX's operations unchanged. Only the device thread
calls it. ``ENABLED`` lets a benchmark compare both in one process.
"""

from __future__ import annotations

from typing import Any

# False: always MLX's operations (benchmarks/kv_quant_adopt.py measures both).
ENABLED = True
_GROUP_SIZES = (32, 64, 128)
_BITS = (2, 4, 8)
_THREADS = 256

_SOURCE = """
    constexpr int E = G / 32;
    constexpr int PER_WORD = 32 / BITS;
    constexpr uint32_t LOW_BITS = (1u << BITS) - 1u;

    int64_t num_groups = 1;
    for (int axis = 0; axis < scales_ndim; axis++) {
        num_groups *= scales_shape[axis];
    }
    const int64_t group = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (group >= num_groups) {
        return;  // the whole warp: a group is one warp's
    }
    const float scale = static_cast<float>(scales[group]);
    const float bias = static_cast<float>(biases[group]);
    float v[E];
    for (int j = 0; j < E; j++) {
        const int64_t element = group * G + lane * E + j;
        const uint32_t word = packed[element / PER_WORD];
        const uint32_t q = (word >> ((element % PER_WORD) * BITS)) & LOW_BITS;
        v[j] = scale * static_cast<float>(q) + bias;
    }
    // The Walsh-Hadamard butterflies in natural order: pairs (i, i + h) with i & h == 0 become
    // (x_i + x_{i+h}, x_i - x_{i+h}); within a lane while h < E, across lanes after.
    for (int h = 1; h < G; h <<= 1) {
        if (h < E) {
            for (int j = 0; j < E; j++) {
                if ((j & h) == 0) {
                    const float a = v[j];
                    const float b = v[j + h];
                    v[j] = a + b;
                    v[j + h] = a - b;
                }
            }
        } else {
            const bool upper = ((lane * E) & h) != 0;
            for (int j = 0; j < E; j++) {
                const float other = __shfl_xor_sync(0xffffffffu, v[j], h / E);
                v[j] = upper ? other - v[j] : v[j] + other;
            }
        }
    }
    const float norm = rsqrtf(static_cast<float>(G));
    for (int j = 0; j < E; j++) {
        out[group * G + lane * E + j] = static_cast<T>(v[j] * norm);
    }
"""

_kernel: Any = None


def _dequant_kernel() -> Any:
    global _kernel
    if _kernel is None:
        import mlx.core as mx

        _kernel = mx.fast.cuda_kernel(
            name="mlxcel_rotated_kv_dequantize",
            input_names=["packed", "scales", "biases"],
            output_names=["out"],
            source=_SOURCE,
        )
    return _kernel


def supported(packed: Any, scales: Any, biases: Any, *, group_size: int, bits: int) -> bool:
    """Whether ``dequantize_rotated`` reads these arrays back: a CUDA device, a layout the kernel knows."""
    import mlx.core as mx

    if not ENABLED or mx.default_device() == mx.cpu or not mx.cuda.is_available():
        return False
    return (
        group_size in _GROUP_SIZES and bits in _BITS and packed.dtype == mx.uint32
        and scales.dtype in (mx.float16, mx.bfloat16, mx.float32) and biases.dtype == scales.dtype
        and scales.shape == biases.shape and packed.shape[:-1] == scales.shape[:-1]
        and packed.shape[-1] * 32 == scales.shape[-1] * group_size * bits
    )


def dequantize_rotated(packed: Any, scales: Any, biases: Any, *, group_size: int, bits: int) -> Any:
    """The rows of rotated groups (``kv._quantize``), in the scales' dtype: as ``kv._dequantize`` computes them."""
    num_groups = 1
    for size in scales.shape:
        num_groups *= size
    threads = -(-num_groups * 32 // _THREADS) * _THREADS
    (out,) = _dequant_kernel()(
        inputs=[packed, scales, biases],
        template=[("T", scales.dtype), ("G", group_size), ("BITS", bits)],
        grid=(max(threads, _THREADS), 1, 1),
        threadgroup=(_THREADS, 1, 1),
        output_shapes=[(*scales.shape[:-1], scales.shape[-1] * group_size)],
        output_dtypes=[scales.dtype],
    )
    return out
