"""The fixture families run through mlx-lm: forward, cache kinds, generation."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

pytestmark = pytest.mark.slow

EXPECTED_CACHE_KINDS = {
    "llama": [KVCache, KVCache],
    "phi3-longrope": [KVCache, KVCache],
    "gemma3": [RotatingKVCache, KVCache],
    "hybrid": [ArraysCache, KVCache],
}

PROMPT_LENGTH = 300


def prompt_ids(tokenizer, length: int) -> list[int]:
    text = " ".join(f"token{index}" for index in range(length))
    ids = tokenizer.encode(text, add_special_tokens=False)[:length]
    assert len(ids) == length
    return ids


def test_forward_and_cache_kinds(loaded_model, family: str) -> None:
    loaded = loaded_model(family)
    cache = make_prompt_cache(loaded.model)
    assert [type(layer_cache) for layer_cache in cache] == EXPECTED_CACHE_KINDS[family]

    ids = prompt_ids(loaded.tokenizer, PROMPT_LENGTH)
    logits = loaded.model(mx.array([ids]), cache=cache)
    mx.eval(logits)
    assert logits.shape == (1, PROMPT_LENGTH, loaded.config["vocab_size"])
    assert logits.dtype == mx.float32
    assert mx.all(mx.isfinite(logits[:, -1, :])).item()

    for layer_cache in cache:
        if isinstance(layer_cache, (KVCache, RotatingKVCache)):
            assert layer_cache.offset == PROMPT_LENGTH
        else:
            # Conv window and recurrent state of the linear-attention layer.
            assert all(state is not None for state in layer_cache.cache)

    # One decode step: the sliding layer drops back to its window.
    mx.eval(loaded.model(mx.array([ids[:1]]), cache=cache))
    for layer_cache in cache:
        if isinstance(layer_cache, RotatingKVCache):
            assert layer_cache.offset == PROMPT_LENGTH + 1
            assert layer_cache.keys.shape[2] == loaded.config["sliding_window"]


def test_weights_are_float32(loaded_model, family: str) -> None:
    from mlx.utils import tree_flatten

    parameters = tree_flatten(loaded_model(family).model.parameters())
    assert {value.dtype for _, value in parameters} == {mx.float32}


def test_batch_generation(loaded_model, family: str) -> None:
    loaded = loaded_model(family)
    generator = BatchGenerator(loaded.model, max_tokens=4, stop_tokens=[[token] for token in loaded.eos_token_ids])
    try:
        prompts = [prompt_ids(loaded.tokenizer, 40), prompt_ids(loaded.tokenizer, 17)]
        uids = generator.insert(prompts)
        tokens: dict[int, list[int]] = {uid: [] for uid in uids}
        finished: set[int] = set()
        for _ in range(50):
            _, responses = generator.next()
            for response in responses:
                tokens[response.uid].append(response.token)
                if response.finish_reason is not None:
                    finished.add(response.uid)
            if finished == set(uids):
                break
    finally:
        generator.close()
    assert finished == set(uids)
    for uid in uids:
        assert 1 <= len(tokens[uid]) <= 4
        assert all(0 <= token < loaded.config["vocab_size"] for token in tokens[uid])


def test_phi3_longrope_rope_uses_long_factor_at_every_length(loaded_model) -> None:
    """mlx-lm 0.32.2's SuScaledRoPE builds one table from long_factor and never
    switches to short_factor below original_max_position_embeddings. This pins
    that behaviour: if mlx-lm starts switching, the rope_regime tag matters here.
    """
    loaded = loaded_model("phi3-longrope")
    rope = loaded.model.model.layers[0].self_attn.rope
    assert rope.original_max_position_embeddings == 512
    head_dim = loaded.config["head_dim"]
    base_frequencies = loaded.config["rope_theta"] ** (mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    long_factor = mx.array(loaded.config["rope_scaling"]["long_factor"], dtype=mx.float32)
    assert mx.allclose(rope._freqs, long_factor * base_frequencies).item()


def test_same_prompt_same_logits(loaded_model) -> None:
    loaded = loaded_model("llama")
    ids = mx.array([prompt_ids(loaded.tokenizer, 32)])
    first = loaded.model(ids)
    second = loaded.model(ids)
    assert mx.array_equal(first, second).item()


@pytest.mark.slow
def test_a_lora_fixture_is_the_same_bytes_each_time_it_is_written(tmp_path) -> None:
    """Its lora_a came unseeded from mlx-lm's layer init: two machines (or two cache folders) held different
    adapters under one name, and one draw made two configurations answer alike."""
    from mlxcel.fixtures import fixture_path
    from mlxcel.fixtures.text import write_lora_fixture

    first = write_lora_fixture(fixture_path("llama"), tmp_path / "first", seed=1)
    mx.random.seed(12345)  # whatever the generator held before
    second = write_lora_fixture(fixture_path("llama"), tmp_path / "second", seed=1)
    assert (first / "adapters.safetensors").read_bytes() == (second / "adapters.safetensors").read_bytes()
    other = write_lora_fixture(fixture_path("llama"), tmp_path / "other", seed=2)
    assert (other / "adapters.safetensors").read_bytes() != (first / "adapters.safetensors").read_bytes()
