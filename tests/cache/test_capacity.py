"""Model-aware capacity defaults."""

from __future__ import annotations

import pytest

from mlxcel.cache.capacity import (
    GIB,
    KV_STORE_FLOOR_BYTES,
    MIB,
    SNAPSHOT_STORE_FLOOR_BYTES,
    estimate_model_bytes,
    kv_bytes_per_token,
    plan_kv_store_capacity,
    plan_store_capacity,
    recommended_store_capacity,
    representative_length,
)

LLAMA_8B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}


def test_floors() -> None:
    assert KV_STORE_FLOOR_BYTES == 2 * GIB
    assert SNAPSHOT_STORE_FLOOR_BYTES == 512 * MIB


def test_representative_length() -> None:
    assert representative_length(None) == 8192
    assert representative_length(4096) == 4096
    assert representative_length(131072) == 8192


def test_kv_bytes_per_token() -> None:
    assert kv_bytes_per_token(LLAMA_8B) == 2 * 32 * 8 * 128 * 2
    float32 = LLAMA_8B | {"torch_dtype": "float32"}
    assert kv_bytes_per_token(float32) == 2 * kv_bytes_per_token(LLAMA_8B)
    no_dtype = {key: value for key, value in LLAMA_8B.items() if key != "torch_dtype"}
    assert kv_bytes_per_token(no_dtype) == kv_bytes_per_token(LLAMA_8B)
    explicit_head = LLAMA_8B | {"head_dim": 256, "dtype": "float16"}
    assert kv_bytes_per_token(explicit_head) == 2 * 32 * 8 * 256 * 2
    no_gqa = {key: value for key, value in LLAMA_8B.items() if key != "num_key_value_heads"}
    assert kv_bytes_per_token(no_gqa) == 4 * kv_bytes_per_token(LLAMA_8B)


def test_text_config_is_read() -> None:
    wrapped = {"model_type": "llava", "torch_dtype": "float32", "text_config": dict(LLAMA_8B, torch_dtype=None)}
    assert kv_bytes_per_token(wrapped) == 2 * kv_bytes_per_token(LLAMA_8B)
    with pytest.raises(ValueError):
        kv_bytes_per_token({"model_type": "mystery"})


def test_estimate_model_bytes_llama_8b() -> None:
    parameters = estimate_model_bytes(LLAMA_8B) / 2
    assert 7.9e9 < parameters < 8.1e9
    quantized = LLAMA_8B | {"quantization": {"bits": 4, "group_size": 64}}
    assert estimate_model_bytes(quantized) == pytest.approx(parameters * 4.5 / 8, rel=1e-6)
    tied = LLAMA_8B | {"tie_word_embeddings": True}
    assert estimate_model_bytes(LLAMA_8B) - estimate_model_bytes(tied) == 128256 * 4096 * 2


@pytest.mark.parametrize(
    ("entry", "left", "floor", "expected"),
    [
        (1 * GIB, 64 * GIB, 2 * GIB, 6 * GIB),  # six entries fit under a quarter
        (1 * GIB, 16 * GIB, 2 * GIB, 4 * GIB),  # the quarter is the ceiling
        (1 * GIB, 4 * GIB, 2 * GIB, 2 * GIB),  # never below the floor
        (3 * GIB, 8 * GIB, 2 * GIB, 3 * GIB),  # raised to one entry: 3 GiB <= 8 / 2
        (5 * GIB, 8 * GIB, 2 * GIB, 2 * GIB),  # one entry needs more than half: not raised
        (1 * MIB, 64 * GIB, 512 * MIB, 512 * MIB),
        (1 * GIB, -5 * GIB, 512 * MIB, 512 * MIB),
    ],
)
def test_recommended_store_capacity(entry: int, left: int, floor: int, expected: int) -> None:
    assert recommended_store_capacity(entry, left, floor) == expected


def test_plan_llama_8b_becomes_6_gib() -> None:
    plan = plan_kv_store_capacity(LLAMA_8B, ctx_size=None, memory_bytes=64 * GIB)
    assert plan.entry_nbytes == 1 * GIB
    assert (plan.previous, plan.recommended, plan.applied, plan.entry_never_fits) == (
        2 * GIB,
        6 * GIB,
        True,
        False,
    )
    assert plan.ceiling == (64 * GIB - estimate_model_bytes(LLAMA_8B)) // 4
    short = plan_kv_store_capacity(LLAMA_8B, ctx_size=2048, memory_bytes=64 * GIB)
    assert short.entry_nbytes == GIB // 4
    assert short.recommended == 2 * GIB


def test_explicit_capacity_is_kept_and_warned_about() -> None:
    plan = plan_kv_store_capacity(LLAMA_8B, ctx_size=None, memory_bytes=64 * GIB, configured=512 * MIB)
    assert (plan.previous, plan.recommended, plan.applied, plan.entry_never_fits) == (
        512 * MIB,
        512 * MIB,
        False,
        True,
    )


def test_entry_that_never_fits_a_small_machine() -> None:
    plan = plan_store_capacity(configured=None, entry_nbytes=4 * GIB, memory_left=6 * GIB, floor=2 * GIB)
    assert plan.recommended == 2 * GIB
    assert plan.entry_never_fits


def test_plan_without_explicit_memory_uses_the_machine() -> None:
    plan = plan_kv_store_capacity(LLAMA_8B, ctx_size=8192)
    assert plan.recommended >= KV_STORE_FLOOR_BYTES
