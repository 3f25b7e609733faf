"""The ragged decode attention kernel: where it applies, and (on CUDA) that it equals MLX's masked attention."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel.model import ragged_attention

cuda = pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel is CUDA-only")


def _inputs(batch: int, heads: int, kv_heads: int, dim: int, length: int, dtype=mx.float32, queries: int = 1):
    """Rows with their own left padding; with several queries, the mask is also causal (a verify pass)."""
    mx.random.seed(1)
    count = queries
    queries = mx.random.normal((batch, heads, count, dim)).astype(dtype)
    # Slices of a longer buffer, as mlx-lm's caches hand them over.
    keys = mx.random.normal((batch, kv_heads, length + 9, dim)).astype(dtype)[..., 3:3 + length, :]
    values = mx.random.normal((batch, kv_heads, length + 9, dim)).astype(dtype)[..., 3:3 + length, :]
    padding = mx.array([(row * 7) % max(1, length - 1) for row in range(batch)])
    mask = mx.expand_dims(padding, (1, 2, 3)) <= mx.arange(length)[None, None, None]
    if count > 1:
        mask = mask & (mx.arange(length - count, length)[:, None] >= mx.arange(length)[None])
    return queries, keys, values, mask


def test_only_one_token_queries_with_a_per_row_boolean_mask_are_taken():
    queries, keys, values, mask = _inputs(3, 8, 2, 64, 20)
    assert ragged_attention.supported(queries, keys, values, mask)
    assert not ragged_attention.supported(queries, keys, values, None)
    assert not ragged_attention.supported(queries, keys, values, "causal")
    assert not ragged_attention.supported(queries, keys, values, mask.astype(mx.float32))
    prefill = mx.concatenate([queries] * (ragged_attention.MAX_QUERIES + 1), axis=2)
    assert not ragged_attention.supported(prefill, keys, values, mask)
    odd_head = mx.zeros((3, 8, 1, 80))
    assert not ragged_attention.supported(odd_head, mx.zeros((3, 2, 20, 80)), mx.zeros((3, 2, 20, 80)), mask)
    assert not ragged_attention.supported(queries, keys, values, mask[..., :-1])
    # Few rows of long keys stay on MLX's path (see _MIN_BLOCKS_FOR_LONG_ROWS).
    long_rows = _inputs(1, 8, 2, 64, 3000)
    assert not ragged_attention.supported(*long_rows)
    assert ragged_attention.supported(*_inputs(40, 8, 2, 64, 3000))


def test_verify_passes_of_a_few_queries_are_taken_whatever_the_key_length():
    # MLX would build a cuDNN plan for each (queries, keys) pair of a verify pass.
    for count in (2, ragged_attention.MAX_QUERIES):
        assert ragged_attention.supported(*_inputs(3, 8, 2, 64, 20, queries=count))
        assert ragged_attention.supported(*_inputs(1, 8, 2, 64, 3000, queries=count))
    queries, keys, values, mask = _inputs(3, 8, 2, 64, 20, queries=4)
    assert ragged_attention.supported(queries, keys, values, mask[:, :, :1])  # one mask row for every query
    assert not ragged_attention.supported(queries, keys, values, mask[:, :, :2])
    assert not ragged_attention.supported(queries, keys[:, :, :3], values[:, :, :3], mask[..., :3])


@pytest.mark.skipif(mx.cuda.is_available(), reason="checks the CPU path")
def test_install_leaves_the_model_alone_off_cuda():
    from mlx_lm.models import llama
    from mlx_lm.models.base import scaled_dot_product_attention

    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-5, vocab_size=50, num_key_value_heads=2))
    assert ragged_attention.install(model) == []
    assert llama.scaled_dot_product_attention is scaled_dot_product_attention


@cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(1, 32, 8, 128, 37), (6, 32, 8, 128, 700), (20, 14, 2, 64, 4100), (2, 4, 4, 96, 9)])
@pytest.mark.parametrize("queries", [1, 3, 8])
def test_the_kernel_equals_masked_attention(dtype, shape, queries):
    queries, keys, values, mask = _inputs(*shape, dtype=dtype, queries=queries)
    scale = shape[3] ** -0.5
    expected = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
    got = ragged_attention.ragged_attention(queries, keys, values, scale=scale, mask=mask)
    tolerance = 2e-5 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), expected.astype(mx.float32), atol=tolerance).item()


@cuda
def test_a_batched_model_decodes_and_verifies_as_with_mlx_masked_attention():
    from mlx_lm.models import llama
    from mlx_lm.models.cache import BatchKVCache

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(
        model_type="llama", hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
        rms_norm_eps=1e-5, vocab_size=300, num_key_value_heads=2))
    prompts = mx.array([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])

    def decode() -> mx.array:
        cache = [BatchKVCache([2, 0]) for _ in model.layers]
        logits = model(prompts, cache=cache)[:, -1]
        out = []
        for _ in range(4):
            token = mx.argmax(logits, axis=-1)
            logits = model(token[:, None], cache=cache)[:, -1]
            out.append(logits)
        # A verify pass: three tokens a row against the padded cache.
        verify = model(mx.array([[7, 8, 9], [10, 11, 12]]), cache=cache)
        out.extend(verify[:, position] for position in range(3))
        return mx.stack(out)

    expected = decode()
    ragged_attention.install(model)
    try:
        got = decode()
    finally:
        ragged_attention.uninstall(model)
    assert mx.allclose(got, expected, atol=1e-4).item()
