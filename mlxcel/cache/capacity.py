"""Model-aware byte budgets for the prefix store and the snapshot store.

A budget is a cap on what a store may hold, not an allocation. These
functions only read a model's config.json mapping; the caller decides which
store a family uses and logs the decision.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

GIB = 1024**3
MIB = 1024**2
KV_STORE_FLOOR_BYTES = 2 * GIB
SNAPSHOT_STORE_FLOOR_BYTES = 512 * MIB
REPRESENTATIVE_LENGTH_CAP = 8192
ENTRIES_PER_STORE = 6

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}
DEFAULT_DTYPE_BYTES = 2


def representative_length(ctx_size: int | None) -> int:
    """Tokens an entry is sized at: the context size, at most 8192."""
    if ctx_size is None:
        return REPRESENTATIVE_LENGTH_CAP
    return min(ctx_size, REPRESENTATIVE_LENGTH_CAP)


def _lookup(config: Mapping, *names: str) -> object | None:
    """First of names found in text_config, then at the top level."""
    text_config = config.get("text_config")
    scopes = (text_config, config) if isinstance(text_config, Mapping) else (config,)
    for scope in scopes:
        for name in names:
            value = scope.get(name)
            if value is not None:
                return value
    return None


def _required_int(config: Mapping, *names: str) -> int:
    value = _lookup(config, *names)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config has no positive integer {' or '.join(names)}")
    return value


def dtype_bytes(config: Mapping) -> int:
    name = _lookup(config, "torch_dtype", "dtype")
    if isinstance(name, str):
        return _DTYPE_BYTES.get(name.removeprefix("torch.").lower(), DEFAULT_DTYPE_BYTES)
    return DEFAULT_DTYPE_BYTES


def _attention_shape(config: Mapping) -> tuple[int, int, int, int]:
    """(num_layers, num_heads, num_kv_heads, head_dim)."""
    num_layers = _required_int(config, "num_hidden_layers", "num_layers", "n_layer")
    num_heads = _required_int(config, "num_attention_heads", "n_head")
    num_kv_heads = _lookup(config, "num_key_value_heads")
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0:
        num_kv_heads = num_heads
    head_dim = _lookup(config, "head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        head_dim = _required_int(config, "hidden_size", "n_embd") // num_heads
    return num_layers, num_heads, num_kv_heads, head_dim


def kv_head_dim(config: Mapping) -> int:
    return _attention_shape(config)[3]


def kv_bytes_per_token(config: Mapping) -> int:
    """Bytes of keys and values one token adds to a dense KV cache."""
    num_layers, _, num_kv_heads, head_dim = _attention_shape(config)
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(config)


def _bytes_per_weight(config: Mapping) -> float:
    quantization = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantization, Mapping) and isinstance(quantization.get("bits"), int):
        group_size = quantization.get("group_size")
        group_size = group_size if isinstance(group_size, int) and group_size > 0 else 64
        # MLX affine quantization keeps a 16-bit scale and bias per group.
        return (quantization["bits"] + 32 / group_size) / 8
    return float(dtype_bytes(config))


def estimate_model_bytes(config: Mapping) -> int:
    """Rough weight footprint of a transformer from its config.

    parameters = vocab * hidden * (1 if tied else 2)
               + layers * (attention + mlp)
    attention  = hidden * head_dim * (2 * heads + 2 * kv_heads)   (q, o, k, v)
    mlp        = 3 * hidden * intermediate * max(1, experts)     (gated MLP)
    bytes      = parameters * bytes per weight (dtype, or quantized bits)
    Norms, biases and routers are left out; they are a small fraction.
    """
    num_layers, num_heads, num_kv_heads, head_dim = _attention_shape(config)
    hidden = _required_int(config, "hidden_size", "n_embd")
    vocab = _required_int(config, "vocab_size")
    intermediate = _lookup(config, "moe_intermediate_size", "intermediate_size", "n_inner")
    if not isinstance(intermediate, int) or intermediate <= 0:
        intermediate = 4 * hidden
    experts = _lookup(config, "num_local_experts", "num_experts", "n_routed_experts")
    experts = experts if isinstance(experts, int) and experts > 0 else 1
    tied = bool(_lookup(config, "tie_word_embeddings"))
    embeddings = vocab * hidden * (1 if tied else 2)
    attention = hidden * head_dim * (2 * num_heads + 2 * num_kv_heads)
    mlp = 3 * hidden * intermediate * experts
    parameters = embeddings + num_layers * (attention + mlp)
    return int(parameters * _bytes_per_weight(config))


def recommended_store_capacity(entry_nbytes: int, memory_left: int, floor: int) -> int:
    """max(floor, min(6 entries, a quarter of memory_left)), at least one entry
    whenever one entry fits in half of memory_left."""
    memory_left = max(memory_left, 0)
    capacity = max(floor, min(ENTRIES_PER_STORE * entry_nbytes, memory_left // 4))
    if capacity < entry_nbytes <= memory_left // 2:
        capacity = entry_nbytes
    return capacity


@attrs.frozen(kw_only=True)
class CapacityDecision:
    """What startup chose for one store, with what it needs to log."""

    previous: int
    recommended: int
    entry_nbytes: int
    # A quarter of the memory left after the model's weights.
    ceiling: int
    # False when an explicit value was kept as it was.
    applied: bool
    # One entry is larger than the whole store, so nothing is ever kept.
    entry_never_fits: bool


def plan_store_capacity(
    *, configured: int | None, entry_nbytes: int, memory_left: int, floor: int
) -> CapacityDecision:
    """The budget of one store: an explicit value as is, else the model-aware default."""
    ceiling = max(memory_left, 0) // 4
    if configured is not None:
        capacity, previous, applied = configured, configured, False
    else:
        capacity = recommended_store_capacity(entry_nbytes, memory_left, floor)
        previous, applied = floor, True
    return CapacityDecision(
        previous=previous,
        recommended=capacity,
        entry_nbytes=entry_nbytes,
        ceiling=ceiling,
        applied=applied,
        entry_never_fits=entry_nbytes > capacity,
    )


def physical_memory_bytes() -> int | None:
    """Installed memory as the OS reports it, or None where it cannot say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _plan_for_model(
    config: Mapping, *, ctx_size: int | None, memory_bytes: int | None, configured: int | None, floor: int
) -> CapacityDecision:
    entry_nbytes = kv_bytes_per_token(config) * representative_length(ctx_size)
    if memory_bytes is None:
        memory_bytes = physical_memory_bytes()
    if memory_bytes is None:
        # Unknown memory: no ceiling beyond six entries.
        memory_left = 4 * ENTRIES_PER_STORE * entry_nbytes
    else:
        memory_left = memory_bytes - estimate_model_bytes(config)
    return plan_store_capacity(
        configured=configured, entry_nbytes=entry_nbytes, memory_left=memory_left, floor=floor
    )


def plan_kv_store_capacity(
    config: Mapping,
    *,
    ctx_size: int | None,
    memory_bytes: int | None = None,
    configured: int | None = None,
) -> CapacityDecision:
    """The KV store budget of a dense-KV model.

    memory_bytes defaults to the installed memory; on Apple silicon the
    caller should pass MLX's recommended working-set size instead.
    """
    return _plan_for_model(
        config, ctx_size=ctx_size, memory_bytes=memory_bytes, configured=configured, floor=KV_STORE_FLOOR_BYTES
    )


def plan_snapshot_store_capacity(
    config: Mapping,
    *,
    ctx_size: int | None,
    memory_bytes: int | None = None,
    configured: int | None = None,
) -> CapacityDecision:
    """The session snapshot budget of a snapshot-only family.

    The entry is sized with every attention layer at the representative
    length, sliding ones included: the history-boundary snapshot is taken
    before a sliding window wraps. Recurrent state is small beside that, so
    counting recurrent layers as attention errs on the generous side.
    """
    return _plan_for_model(
        config, ctx_size=ctx_size, memory_bytes=memory_bytes, configured=configured,
        floor=SNAPSHOT_STORE_FLOOR_BYTES,
    )
