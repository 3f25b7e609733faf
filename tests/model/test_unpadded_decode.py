"""A batch with no padding and no gaps decodes without a mask; the host copy of the padding stays true."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel.fixtures import fixture_path
from mlxcel.model import batch_rows, unpadded_decode
from mlxcel.model.gapped_cache import GappedBatchKVCache, from_shared_pass, keep_written
from mlxcel.model.loader import load_model

HEADS, DIM = 2, 4


@pytest.fixture(autouse=True)
def patched():
    batch_rows.install()
    unpadded_decode.install()
    yield
    unpadded_decode.uninstall()


def _kv(rows: int, length: int, rng: np.random.Generator) -> tuple[Any, Any]:
    return tuple(mx.array(rng.standard_normal((rows, HEADS, length, DIM)).astype(np.float32)) for _ in range(2))


def _check(cache: Any) -> None:
    """The host copy is known and equals the device's padding."""
    known = unpadded_decode.host_padding(cache)
    assert known is not None
    assert known == cache.left_padding.tolist()


def test_the_host_padding_follows_every_change_of_the_device_padding():
    rng = np.random.default_rng(0)
    cache = BatchKVCache([0, 0, 0])
    _check(cache)
    cache.prepare(left_padding=[2, 0, 1], right_padding=[0, 3, 1])  # in place, as mlx-lm adds it
    _check(cache)
    cache.update_and_fetch(*_kv(3, 6, rng))
    cache.finalize()  # the right padding rolled into the left, in place
    assert cache.left_padding.tolist() == [2, 3, 2]
    _check(cache)
    other = BatchKVCache([1, 0])
    other.update_and_fetch(*_kv(2, 9, rng))
    cache.extend(other)  # right-justified to the longer
    assert cache.left_padding.tolist() == [5, 6, 5, 1, 0]
    _check(cache)
    cache.filter([0, 2, 3])  # batch_rows.filter_by_slices: the common padding dropped
    assert cache.left_padding.tolist() == [4, 4, 0]
    _check(cache)
    merged = BatchKVCache.merge([_single(4, rng), _single(7, rng)])
    _check(merged)
    assert merged.left_padding.tolist() == [3, 0]


def test_a_padding_set_on_the_device_is_not_claimed():
    rng = np.random.default_rng(1)
    cache = BatchKVCache([0, 0])
    cache.update_and_fetch(*_kv(2, 5, rng))
    cache.left_padding = cache.left_padding + mx.array([1, 0])  # a change no patch saw
    assert unpadded_decode.host_padding(cache) is None
    assert isinstance(cache.make_mask(1), mx.array)
    # A finalize whose right padding no patched prepare recorded forgets the copy.
    known = BatchKVCache([0, 0])
    known.update_and_fetch(*_kv(2, 5, rng))
    known._right_padding = mx.array([1, 0])
    known.finalize()
    assert unpadded_decode.host_padding(known) is None


def _single(length: int, rng: np.random.Generator) -> KVCache:
    cache = KVCache()
    cache.update_and_fetch(*_kv(1, length, rng))
    return cache


def test_only_an_unpadded_gapless_one_token_step_goes_without_a_mask():
    rng = np.random.default_rng(2)
    cache = BatchKVCache([0, 0])
    cache.update_and_fetch(*_kv(2, 5, rng))
    assert cache.make_mask(1) is None
    assert isinstance(cache.make_mask(3, return_array=True), mx.array)  # a verify pass: causal
    assert isinstance(cache.make_mask(1, window_size=4), mx.array)
    padded = BatchKVCache.merge([_single(3, rng), _single(5, rng)])
    assert isinstance(padded.make_mask(1), mx.array)
    keep_written([cache], 2, [2, 1])  # rows keep different counts: a gap in the second
    cache.update_and_fetch(*_kv(2, 2, rng))
    assert isinstance(cache, GappedBatchKVCache)
    assert cache.has_gaps()
    assert isinstance(cache.make_mask(1), mx.array)


def test_a_pass_row_alone_has_no_gap_and_the_longest_row_none():
    rng = np.random.default_rng(3)
    layer = KVCache()
    layer.update_and_fetch(*_kv(2, 16, rng))  # a start pass of two rows, 16 positions with the filler
    (alone,) = from_shared_pass([layer], [1], [9])
    assert (alone._idx, alone.gaps) == (9, [[]])
    assert alone.make_mask(1) is None
    np.testing.assert_array_equal(np.asarray(alone.update_and_fetch(*_kv(1, 1, rng))[0][:, :, :9]),
                                  np.asarray(layer.keys[1:2, :, :9]))
    (both,) = from_shared_pass([layer], [0, 1], [12, 9])
    assert (both._idx, both.gaps) == (12, [[], [(9, 12)]])


def test_decoding_without_the_mask_gives_the_masked_steps_logits():
    """The llama fixture (float32), two rows of equal length decoding four steps: with the patch (no mask,
    MLX's fused attention) and without it (mlx-lm's all-true mask), the same logits."""
    model = load_model(fixture_path("llama")).model
    prompt = mx.array([[5, 9, 14, 3, 200, 17], [8, 8, 31, 2, 90, 11]])

    def run(unmasked: bool) -> list[np.ndarray]:
        caches = [BatchKVCache([0, 0]) for _ in model.layers]
        logits = model(prompt, cache=caches)[:, -1, :]
        assert (caches[0].make_mask(1) is None) == unmasked
        seen = []
        for _ in range(4):
            tokens = mx.argmax(logits, axis=-1)
            logits = model(tokens[:, None], cache=caches)[:, -1, :]
            seen.append(np.array(logits))
        return seen

    without = run(unmasked=True)
    unpadded_decode.uninstall()
    masked = run(unmasked=False)
    for ours, theirs in zip(without, masked, strict=True):
        np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=1e-5)
