"""Decode and verify attention for a batch whose rows have different lengths, without MLX's unfused fallback.

mlx-lm's ``BatchKVCache`` keeps rows of different lengths in one buffer and
masks each row's padding with a boolean array. MLX's CUDA backend has no fused
kernel for a one-token query with an array mask (neither its vector kernel nor
cuDNN's decode path take one), so every layer of every decode step falls back
to separate matmul, mask and softmax kernels: on the H200 that made mlx-lm's
batched step ~1.9x the plain-cache step (8B shape, 64 rows; see
docs/benchmarks.md). This module adds that missing kernel: MLX's own one-pass
vector attention (``kernel_sdpav_1pass``), with the mask read per key.

A speculative verify pass has a few queries per row (the token in flight and
the proposal, ``MAX_QUERIES`` at most) and a key length one step longer each
time: cuDNN builds a plan for every such pair (about 0.2 s a verify step on
the H200). The kernel takes those too, one block per (row, head, query),
each query reading its own row of the (causal and padding) mask.

``install(model)`` points the model's modules at ``attention`` on CUDA only;
every other case (the CPU, prefill, quantized caches, attention sinks, other
head sizes or mask shapes) goes to mlx-lm's function unchanged. Only the
device thread calls it.
"""

from __future__ import annotations

import sys
from typing import Any

_HEAD_DIMS = (64, 96, 128)
# The widest verify pass taken (the token in flight and up to 7 proposed tokens); wider is a prefill.
MAX_QUERIES = 8
# One block per (row, head) reads all of a row's keys: with few blocks and long rows the GPU is mostly
# idle and MLX's fallback is faster (H200: 1 row x 32 heads x 8,192 keys, 0.25 ms against 0.21 ms;
# 16 rows, 0.80 against 1.40 ms).
_MIN_BLOCKS_FOR_LONG_ROWS = 256
_LONG_ROW = 2048

_SOURCE = """
    constexpr int BN = 32;
    constexpr int BD = 32;
    constexpr int VPT = D / BD;

    __shared__ float outputs[BN][BD + 1];
    __shared__ float max_scores[BN];
    __shared__ float sum_exp_scores[BN];

    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const int lane = warp.thread_rank();
    const int warp_idx = warp.meta_group_rank();

    const int batch = blockIdx.z;
    const int query = blockIdx.y;
    const int head = blockIdx.x;
    const int kv_head = head / GQA;
    const int num_heads = queries_shape[1];
    const int num_queries = queries_shape[2];
    const int num_keys = keys_shape[2];

    const T* q_row = queries + batch * queries_strides[0] + head * queries_strides[1]
        + query * queries_strides[2];
    const T* k_row = keys + batch * keys_strides[0] + kv_head * keys_strides[1];
    const T* v_row = values + batch * values_strides[0] + kv_head * values_strides[1];
    const bool* m_row = mask + (MASK_ROWS ? batch * mask_strides[0] : 0)
        + (MASK_QUERIES ? query * mask_strides[2] : 0);
    const int64_t k_step = keys_strides[2];
    const int64_t v_step = values_strides[2];
    const int64_t m_step = mask_strides[3];
    const int64_t q_dim = queries_strides[3];
    const int64_t k_dim = keys_strides[3];
    const int64_t v_dim = values_strides[3];

    const float scale_log2 = scale[0] * 1.44269504088896340736f;
    float q[VPT];
    float o[VPT];
    for (int i = 0; i < VPT; i++) {
        q[i] = scale_log2 * static_cast<float>(q_row[(VPT * lane + i) * q_dim]);
        o[i] = 0.f;
    }

    float max_score = -3.402823466e+38f;
    float sum_exp_score = 0.f;
    for (int key = warp_idx; key < num_keys; key += BN) {
        if (m_row[key * m_step]) {
            const T* k_at = k_row + key * k_step;
            const T* v_at = v_row + key * v_step;
            float score = 0.f;
            for (int j = 0; j < VPT; j++) {
                score += q[j] * static_cast<float>(k_at[(VPT * lane + j) * k_dim]);
            }
            score = cg::reduce(warp, score, cg::plus<float>());
            float new_max = fmaxf(max_score, score);
            float factor = exp2f(max_score - new_max);
            float exp_score = exp2f(score - new_max);
            max_score = new_max;
            sum_exp_score = sum_exp_score * factor + exp_score;
            for (int j = 0; j < VPT; j++) {
                o[j] = o[j] * factor + exp_score * static_cast<float>(v_at[(VPT * lane + j) * v_dim]);
            }
        }
    }

    if (lane == 0) {
        max_scores[warp_idx] = max_score;
        sum_exp_scores[warp_idx] = sum_exp_score;
    }
    block.sync();
    max_score = max_scores[lane];
    float new_max = cg::reduce(warp, max_score, cg::greater<float>());
    float factor = exp2f(max_score - new_max);
    sum_exp_score = cg::reduce(warp, sum_exp_scores[lane] * factor, cg::plus<float>());
    sum_exp_score = sum_exp_score == 0 ? 0 : __frcp_rn(sum_exp_score);

    for (int i = 0; i < VPT; i++) {
        outputs[lane][warp_idx] = o[i];
        block.sync();
        float part = outputs[warp_idx][lane] * factor;
        o[i] = cg::reduce(warp, part, cg::plus<float>()) * sum_exp_score;
        block.sync();
    }
    if (lane == 0) {
        T* out_row = out + ((static_cast<int64_t>(batch) * num_heads + head) * num_queries + query) * D;
        for (int i = 0; i < VPT; i++) {
            out_row[VPT * warp_idx + i] = static_cast<T>(o[i]);
        }
    }
"""

_kernel: Any = None
# The scale of each head size as a device scalar (one per model), made once.
_scales: dict[float, Any] = {}


def _ragged_kernel() -> Any:
    global _kernel
    if _kernel is None:
        import mlx.core as mx

        _kernel = mx.fast.cuda_kernel(
            name="mlxcel_ragged_decode_attention",
            input_names=["queries", "keys", "values", "mask", "scale"],
            output_names=["out"],
            source=_SOURCE,
            header="#include <cooperative_groups/reduce.h>\n",
            ensure_row_contiguous=False,
        )
    return _kernel


def supported(queries: Any, keys: Any, values: Any, mask: Any) -> bool:
    """Whether ``ragged_attention`` computes this call: at most ``MAX_QUERIES`` queries a row, a boolean mask.

    The mask is (1 or rows, 1, 1 or queries, keys). One-token queries over long keys with few rows stay on
    MLX's path, which is faster there; several queries always come here (MLX would build a cuDNN plan).
    """
    import mlx.core as mx

    if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim != 4:
        return False
    batch, heads, length, dim = queries.shape
    return (
        1 <= length <= MAX_QUERIES and dim in _HEAD_DIMS and values.shape[-1] == dim and keys.shape[-1] == dim
        and heads % keys.shape[1] == 0 and keys.shape[0] == batch
        and mask.shape[0] in (1, batch) and mask.shape[1] == 1 and mask.shape[2] in (1, length)
        and mask.shape[3] == keys.shape[2] and length <= keys.shape[2]
        and queries.dtype in (mx.float16, mx.bfloat16, mx.float32)
        and (length > 1 or keys.shape[2] <= _LONG_ROW or batch * heads >= _MIN_BLOCKS_FOR_LONG_ROWS)
    )


def ragged_attention(queries: Any, keys: Any, values: Any, *, scale: float, mask: Any) -> Any:
    """``mx.fast.scaled_dot_product_attention(queries, keys, values, scale, mask)`` for a ``supported`` call."""
    import mlx.core as mx

    batch, heads, length, dim = queries.shape
    (out,) = _ragged_kernel()(
        inputs=[queries, keys, values, mask, _scales.setdefault(scale, mx.array(scale, dtype=mx.float32))],
        template=[("T", queries.dtype), ("D", dim), ("GQA", heads // keys.shape[1]),
                  ("MASK_ROWS", mask.shape[0] != 1), ("MASK_QUERIES", mask.shape[2] != 1)],
        grid=(heads * 1024, length, batch),
        threadgroup=(1024, 1, 1),
        output_shapes=[queries.shape],
        output_dtypes=[queries.dtype],
    )
    return out


def attention(queries: Any, keys: Any, values: Any, cache: Any, scale: float, mask: Any,
              sinks: Any = None) -> Any:
    """mlx-lm's ``scaled_dot_product_attention``, with masked decode and verify queries on the ragged kernel."""
    from mlx_lm.models.base import scaled_dot_product_attention

    if sinks is None and not hasattr(cache, "bits") and supported(queries, keys, values, mask):
        return ragged_attention(queries, keys, values, scale=scale, mask=mask)
    return scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks)


def install(model: Any) -> list[str]:
    """On CUDA, route the model's attention through ``attention``; the names of the modules changed."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    if not mx.cuda.is_available() or mx.default_device() == mx.cpu:
        return []
    changed = []
    for name in sorted({type(module).__module__ for module in model.modules()}):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is scaled_dot_product_attention:
            module.scaled_dot_product_attention = attention  # type: ignore[attr-defined]
            changed.append(name)
    return changed


def uninstall(model: Any) -> None:
    """Undo ``install`` (benchmarks compare both)."""
    from mlx_lm.models.base import scaled_dot_product_attention

    for name in {type(module).__module__ for module in model.modules()}:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "scaled_dot_product_attention", None) is attention:
            module.scaled_dot_product_attention = scaled_dot_product_attention  # type: ignore[attr-defined]
