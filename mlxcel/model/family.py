"""Model family detection from a checkpoint's ``config.json``.

Pure: a config mapping in, a `ModelFamily` out. No MLX, no Trio, no files.

What is matched
    The top-level ``model_type`` and ``text_config.model_type`` (VLM-packaged
    checkpoints keep the language model there), each lower-cased with a
    trailing ``_text`` ignored, plus every ``architectures`` name with its
    ``For...`` suffix removed, compared without underscores or case
    (``Qwen3NextForCausalLM`` matches ``qwen3_next``).

Kinds, checked in this order
    RECURRENT: families whose per-sequence state includes a recurrent (SSM,
        linear-attention, RWKV) part beside any KV cache. Two spec lists meet
        here: the APC exclusion list (jamba ... baichuan_m1) and the recurrent
        half of the snapshot-capacity list (Qwen 3.5/3.8, Falcon-H1, LFM2,
        Bailing linear, Granite 4 hybrid, PLaMo 2). A KV table alone cannot
        restore them, so APC is off and reuse runs through whole snapshots.
    SLIDING_WINDOW: families with local attention layers (sliding or chunked)
        beside global ones: Gemma 2/3/3n/4, Cohere 2, Llama 4, AFMoE, GPT-OSS,
        and any other config that sets a positive ``sliding_window`` together
        with a per-layer pattern (``layer_types`` naming sliding layers,
        ``sliding_window_pattern``, or ``use_sliding_window: true``). A bare
        ``sliding_window`` (Mistral 7B v0.1, Qwen 2 with the flag off) is
        dense: mlx-lm runs those with a plain KV cache on every layer.
    DENSE: everything else.

Snapshot-only families are the recurrent ones plus the attention-cache
families of the spec (Gemma 3, Gemma 4, Gemma 4 unified, Llama 4, AFMoE,
Muse Glimmer, Inkling): they never donate into the prefix KV store.

LongRoPE (Phi-3/Phi-4 ``rope_scaling`` of type ``longrope`` or ``su``) picks
its frequency table from the prompt length, so the family records the
switch-over length (``original_max_position_embeddings``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

__all__ = [
    "APC_EXCLUDED_MODEL_TYPES",
    "FamilyKind",
    "ModelFamily",
    "RECURRENT_MODEL_TYPES",
    "SLIDING_WINDOW_MODEL_TYPES",
    "SNAPSHOT_ONLY_ATTENTION_MODEL_TYPES",
    "detect_family",
    "normalize_model_type",
]


class FamilyKind(enum.Enum):
    DENSE = "dense"
    SLIDING_WINDOW = "sliding_window"
    RECURRENT = "recurrent"


# The spec's list of hybrid SSM model types for which APC is disabled.
APC_EXCLUDED_MODEL_TYPES = frozenset(
    {
        "jamba",
        "mamba",
        "mamba2",
        "nemotron_h",
        "gated_delta",
        "kimi_linear",
        "kimi_k3",
        "qwen3_next",
        "falcon_mamba",
        "longcat_flash",
        "longcat_flash_ngram",
        "rwkv7",
        "recurrent_gemma",
        "baichuan_m1",
    }
)

# Recurrent families named by the snapshot-capacity section, plus mlx-lm's
# other gated-delta hybrid (olmo_hybrid), which has the same restore problem.
RECURRENT_MODEL_TYPES = APC_EXCLUDED_MODEL_TYPES | frozenset(
    {
        "qwen3_5",
        "qwen3_5_moe",
        "qwen4_exp",
        "falcon_h1",
        "lfm2",
        "lfm2_moe",
        "lfm2-vl",
        "bailing_moe_linear",
        "bailing_hybrid",
        "granitemoehybrid",
        "plamo2",
        "olmo_hybrid",
    }
)

# Attention-cache families the spec restores through session snapshots only.
SNAPSHOT_ONLY_ATTENTION_MODEL_TYPES = frozenset(
    {
        "gemma3",
        "gemma4",
        "gemma4_unified",
        "llama4",
        "afmoe",
        "muse_glimmer",
        "inkling",
    }
)

SLIDING_WINDOW_MODEL_TYPES = frozenset(
    {
        "gemma2",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4_unified",
        "cohere2",
        "llama4",
        "afmoe",
        "gpt_oss",
    }
)

_KNOWN_MODEL_TYPES = (
    RECURRENT_MODEL_TYPES
    | SNAPSHOT_ONLY_ATTENTION_MODEL_TYPES
    | SLIDING_WINDOW_MODEL_TYPES
    | frozenset({"phi3", "llama", "mistral", "qwen2", "qwen3", "gemma"})
)

_LONGROPE_TYPES = frozenset({"longrope", "su"})

# mlx-lm's phi3 assumes this switch-over length when a config omits it.
_DEFAULT_LONGROPE_ORIGINAL_MAX_POSITIONS = 4096

_ARCHITECTURE_SUFFIX = re.compile(r"(For[A-Z]\w*|LMHeadModel|Model)$")


@attrs.frozen(kw_only=True)
class ModelFamily:
    model_type: str
    kind: FamilyKind
    longrope_original_max_positions: int | None = None
    context_size: int | None = None
    sliding_window: int | None = None
    apc_supported: bool = True
    snapshot_only: bool = False
    apc_disabled_reason: str | None = None

    @property
    def is_recurrent(self) -> bool:
        return self.kind is FamilyKind.RECURRENT

    @property
    def uses_longrope(self) -> bool:
        return self.longrope_original_max_positions is not None


def normalize_model_type(model_type: object) -> str:
    """Lower-case a model_type and drop a trailing ``_text``; "" if not a str."""
    if not isinstance(model_type, str):
        return ""
    normalized = model_type.strip().lower()
    if normalized.endswith("_text"):
        normalized = normalized[: -len("_text")]
    return normalized


def _squash(name: str) -> str:
    return name.replace("_", "").replace("-", "").lower()


_KNOWN_BY_SQUASHED = {_squash(model_type): model_type for model_type in _KNOWN_MODEL_TYPES}


def _architecture_model_types(architectures: object) -> list[str]:
    if isinstance(architectures, str):
        architectures = [architectures]
    if not isinstance(architectures, Iterable):
        return []
    found = []
    for architecture in architectures:
        if not isinstance(architecture, str):
            continue
        stem = _ARCHITECTURE_SUFFIX.sub("", architecture)
        model_type = _KNOWN_BY_SQUASHED.get(_squash(stem))
        if model_type is not None:
            found.append(model_type)
    return found


def _sub_mapping(config: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = config.get(key)
    return value if isinstance(value, Mapping) else {}


def _first_int(mappings: Iterable[Mapping[str, Any]], keys: Iterable[str]) -> int | None:
    keys = tuple(keys)
    for mapping in mappings:
        for key in keys:
            value = mapping.get(key)
            # bool is an int subclass; a flag is never a size.
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _rope_scaling(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    # transformers 5 renamed rope_scaling to rope_parameters.
    for key in ("rope_scaling", "rope_parameters"):
        value = mapping.get(key)
        if isinstance(value, Mapping):
            return value
    return {}


def _longrope_original_max_positions(scopes: list[Mapping[str, Any]]) -> int | None:
    for scope in scopes:
        scaling = _rope_scaling(scope)
        rope_type = scaling.get("type", scaling.get("rope_type"))
        if isinstance(rope_type, str) and rope_type.lower() in _LONGROPE_TYPES:
            original = _first_int(
                [scaling, scope, *scopes], ["original_max_position_embeddings"]
            )
            return original or _DEFAULT_LONGROPE_ORIGINAL_MAX_POSITIONS
    return None


def _has_sliding_layer_pattern(scope: Mapping[str, Any]) -> bool:
    layer_types = scope.get("layer_types")
    if isinstance(layer_types, (list, tuple)) and any(
        isinstance(layer_type, str) and "sliding" in layer_type for layer_type in layer_types
    ):
        return True
    if scope.get("use_sliding_window") is True:
        return True
    pattern = scope.get("sliding_window_pattern")
    return isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1


def detect_family(config: Mapping[str, Any]) -> ModelFamily:
    """Classify a model from its config.json contents."""
    text_config = _sub_mapping(config, "text_config")
    # The text model's settings win over a VLM wrapper's where both exist.
    scopes = [text_config, config] if text_config else [config]

    declared = [
        normalize_model_type(config.get("model_type")),
        normalize_model_type(text_config.get("model_type")),
    ]
    candidates = [model_type for model_type in declared if model_type]
    candidates += _architecture_model_types(config.get("architectures"))
    candidates += _architecture_model_types(text_config.get("architectures"))

    known = [model_type for model_type in candidates if model_type in _KNOWN_MODEL_TYPES]
    model_type = (known or candidates or [""])[0]

    sliding_window = _first_int(scopes, ["sliding_window"])
    recurrent = [name for name in candidates if name in RECURRENT_MODEL_TYPES]
    if recurrent:
        model_type = recurrent[0]
        kind = FamilyKind.RECURRENT
    elif any(name in SLIDING_WINDOW_MODEL_TYPES for name in candidates) or (
        sliding_window is not None and any(_has_sliding_layer_pattern(scope) for scope in scopes)
    ):
        kind = FamilyKind.SLIDING_WINDOW
    else:
        kind = FamilyKind.DENSE

    snapshot_only = kind is FamilyKind.RECURRENT or any(
        name in SNAPSHOT_ONLY_ATTENTION_MODEL_TYPES for name in candidates
    )
    apc_supported = kind is not FamilyKind.RECURRENT
    apc_disabled_reason = (
        None
        if apc_supported
        else f"{model_type} carries recurrent state that KV blocks alone cannot restore"
    )

    return ModelFamily(
        model_type=model_type,
        kind=kind,
        longrope_original_max_positions=_longrope_original_max_positions(scopes),
        context_size=_first_int(
            scopes, ["max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"]
        ),
        sliding_window=sliding_window if kind is FamilyKind.SLIDING_WINDOW else None,
        apc_supported=apc_supported,
        snapshot_only=snapshot_only,
        apc_disabled_reason=apc_disabled_reason,
    )
