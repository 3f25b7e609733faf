from __future__ import annotations

import pytest

from mlxcel.model.family import (
    APC_EXCLUDED_MODEL_TYPES,
    FamilyKind,
    ModelFamily,
    detect_family,
    normalize_model_type,
)

LLAMA_3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192},
}

PHI_3_MINI_128K = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "max_position_embeddings": 131072,
    "original_max_position_embeddings": 4096,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [1.5] * 48},
    "sliding_window": 262144,
}

GEMMA_3_VLM = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
    },
}


def test_dense_llama() -> None:
    family = detect_family(LLAMA_3_8B)
    assert family == ModelFamily(
        model_type="llama",
        kind=FamilyKind.DENSE,
        longrope_original_max_positions=None,
        context_size=131072,
        sliding_window=None,
        apc_supported=True,
        snapshot_only=False,
        apc_disabled_reason=None,
    )
    assert not family.uses_longrope
    assert not family.is_recurrent


def test_phi3_longrope_uses_original_max_positions_from_top_level() -> None:
    family = detect_family(PHI_3_MINI_128K)
    assert family.model_type == "phi3"
    assert family.longrope_original_max_positions == 4096
    assert family.uses_longrope
    # A bare sliding_window without a layer pattern is full attention in mlx-lm.
    assert family.kind is FamilyKind.DENSE
    assert family.apc_supported


@pytest.mark.parametrize("rope_type_key", ["type", "rope_type"])
@pytest.mark.parametrize("rope_type", ["longrope", "su", "LongRoPE"])
def test_longrope_in_rope_scaling(rope_type_key: str, rope_type: str) -> None:
    config = {
        "model_type": "phi3",
        "rope_scaling": {rope_type_key: rope_type, "original_max_position_embeddings": 8192},
        "original_max_position_embeddings": 4096,
    }
    # The rope_scaling value wins over the top-level one.
    assert detect_family(config).longrope_original_max_positions == 8192


def test_longrope_in_transformers_5_rope_parameters() -> None:
    config = {"model_type": "phi3", "rope_parameters": {"rope_type": "longrope"}, "original_max_position_embeddings": 512}
    assert detect_family(config).longrope_original_max_positions == 512


def test_longrope_without_original_falls_back_to_mlx_lm_default() -> None:
    config = {"model_type": "phi3", "rope_scaling": {"type": "longrope"}}
    assert detect_family(config).longrope_original_max_positions == 4096


@pytest.mark.parametrize("rope_type", ["linear", "llama3", "yarn", "dynamic"])
def test_other_rope_scaling_is_not_longrope(rope_type: str) -> None:
    config = {"model_type": "llama", "rope_scaling": {"type": rope_type, "original_max_position_embeddings": 4096}}
    assert detect_family(config).longrope_original_max_positions is None


def test_longrope_inside_text_config() -> None:
    config = {
        "model_type": "phi4mm",
        "text_config": {"model_type": "phi3", "rope_scaling": {"type": "longrope"}, "original_max_position_embeddings": 4096},
    }
    family = detect_family(config)
    assert family.model_type == "phi3"
    assert family.longrope_original_max_positions == 4096


def test_gemma3_vlm_packaged() -> None:
    family = detect_family(GEMMA_3_VLM)
    assert family.model_type == "gemma3"
    assert family.kind is FamilyKind.SLIDING_WINDOW
    assert family.sliding_window == 1024
    assert family.context_size == 131072
    assert family.snapshot_only
    assert family.apc_supported


def test_gemma3_text_suffix() -> None:
    family = detect_family({"model_type": "gemma3_text", "sliding_window": 512})
    assert family.model_type == "gemma3"
    assert family.kind is FamilyKind.SLIDING_WINDOW
    assert family.snapshot_only


@pytest.mark.parametrize("model_type", ["gemma4", "gemma4_text", "gemma4_unified", "llama4", "llama4_text", "afmoe"])
def test_snapshot_only_attention_families(model_type: str) -> None:
    family = detect_family({"model_type": model_type})
    assert family.snapshot_only
    assert family.apc_supported
    assert family.kind is FamilyKind.SLIDING_WINDOW


@pytest.mark.parametrize("model_type", ["muse_glimmer", "inkling"])
def test_snapshot_only_families_without_known_sliding_layers(model_type: str) -> None:
    family = detect_family({"model_type": model_type})
    assert family.snapshot_only
    assert family.kind is FamilyKind.DENSE


@pytest.mark.parametrize("model_type", ["gemma2", "cohere2", "gpt_oss"])
def test_sliding_window_families_that_are_not_snapshot_only(model_type: str) -> None:
    family = detect_family({"model_type": model_type, "sliding_window": 4096})
    assert family.kind is FamilyKind.SLIDING_WINDOW
    assert family.sliding_window == 4096
    assert not family.snapshot_only


@pytest.mark.parametrize(
    "pattern",
    [
        {"layer_types": ["sliding_attention", "full_attention"]},
        {"sliding_window_pattern": 6},
        {"use_sliding_window": True},
    ],
)
def test_unknown_model_with_sliding_layer_pattern(pattern: dict) -> None:
    family = detect_family({"model_type": "somenewmodel", "sliding_window": 2048, **pattern})
    assert family.kind is FamilyKind.SLIDING_WINDOW
    assert family.sliding_window == 2048


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "mistral", "sliding_window": 4096},
        {"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False},
        {"model_type": "mistral", "sliding_window": None, "layer_types": ["sliding_attention"]},
        {"model_type": "x", "layer_types": ["full_attention", "full_attention"], "sliding_window": 64},
    ],
)
def test_sliding_window_without_pattern_is_dense(config: dict) -> None:
    family = detect_family(config)
    assert family.kind is FamilyKind.DENSE
    assert family.sliding_window is None


@pytest.mark.parametrize("model_type", sorted(APC_EXCLUDED_MODEL_TYPES))
def test_spec_apc_exclusion_list(model_type: str) -> None:
    family = detect_family({"model_type": model_type})
    assert family.kind is FamilyKind.RECURRENT
    assert not family.apc_supported
    assert family.snapshot_only
    assert family.apc_disabled_reason is not None
    assert model_type in family.apc_disabled_reason


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_5", "qwen3_5_moe", "falcon_h1", "lfm2", "bailing_moe_linear", "granitemoehybrid", "plamo2"],
)
def test_recurrent_snapshot_families(model_type: str) -> None:
    family = detect_family({"model_type": model_type})
    assert family.kind is FamilyKind.RECURRENT
    assert family.snapshot_only
    assert not family.apc_supported


@pytest.mark.parametrize(
    ("architecture", "model_type"),
    [
        ("Qwen3NextForCausalLM", "qwen3_next"),
        ("NemotronHForCausalLM", "nemotron_h"),
        ("MambaForCausalLM", "mamba"),
        ("Mamba2ForCausalLM", "mamba2"),
        ("JambaForCausalLM", "jamba"),
        ("FalconMambaForCausalLM", "falcon_mamba"),
        ("RecurrentGemmaForCausalLM", "recurrent_gemma"),
        ("GraniteMoeHybridForCausalLM", "granitemoehybrid"),
        ("Qwen3_5ForConditionalGeneration", "qwen3_5"),
        ("KimiLinearForCausalLM", "kimi_linear"),
    ],
)
def test_architecture_only_recurrent_matches(architecture: str, model_type: str) -> None:
    family = detect_family({"architectures": [architecture]})
    assert family.model_type == model_type
    assert family.kind is FamilyKind.RECURRENT
    assert not family.apc_supported


def test_architecture_overrides_an_unknown_model_type() -> None:
    family = detect_family({"model_type": "custom_remote_code", "architectures": ["NemotronHForCausalLM"]})
    assert family.kind is FamilyKind.RECURRENT
    assert family.model_type == "nemotron_h"


def test_recurrent_text_config_inside_vlm_wrapper() -> None:
    config = {"model_type": "qwen3_5_vl", "text_config": {"model_type": "qwen3_5_text", "max_position_embeddings": 262144}}
    family = detect_family(config)
    assert family.model_type == "qwen3_5"
    assert family.kind is FamilyKind.RECURRENT
    assert family.context_size == 262144


def test_architectures_as_a_single_string() -> None:
    assert detect_family({"architectures": "JambaForCausalLM"}).kind is FamilyKind.RECURRENT


def test_vlm_with_dense_text_model_takes_text_model_type() -> None:
    family = detect_family({"model_type": "llava", "text_config": {"model_type": "mistral"}})
    assert family.model_type == "mistral"
    assert family.kind is FamilyKind.DENSE


def test_unknown_model_type_is_kept_normalised() -> None:
    family = detect_family({"model_type": "Brand_New_Text"})
    assert family.model_type == "brand_new"
    assert family.kind is FamilyKind.DENSE
    assert family.apc_supported
    assert not family.snapshot_only


def test_empty_and_malformed_configs() -> None:
    assert detect_family({}).model_type == ""
    family = detect_family({"model_type": 7, "text_config": "nope", "architectures": [None, 3], "max_position_embeddings": True})
    assert family.kind is FamilyKind.DENSE
    assert family.context_size is None


@pytest.mark.parametrize(
    ("key", "value"), [("max_position_embeddings", 8192), ("max_sequence_length", 4096), ("n_positions", 1024)]
)
def test_context_size_keys(key: str, value: int) -> None:
    assert detect_family({"model_type": "x", key: value}).context_size == value


def test_text_config_context_size_wins_over_wrapper() -> None:
    config = {"model_type": "gemma3", "max_position_embeddings": 1, "text_config": {"max_position_embeddings": 131072}}
    assert detect_family(config).context_size == 131072


@pytest.mark.parametrize(
    ("raw", "normalized"), [("gemma3_text", "gemma3"), ("  Qwen3_Next ", "qwen3_next"), ("text", "text"), (None, "")]
)
def test_normalize_model_type(raw: object, normalized: str) -> None:
    assert normalize_model_type(raw) == normalized


def test_family_is_a_frozen_value() -> None:
    family = detect_family(LLAMA_3_8B)
    with pytest.raises(AttributeError):
        family.kind = FamilyKind.RECURRENT  # type: ignore[misc]
    assert family == detect_family(dict(LLAMA_3_8B))

