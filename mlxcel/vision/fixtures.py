"""Random-weight vision-language model folders that mlx-lm (text) and mlx-vlm (vision) both load.

Tiny float32 shapes of four families mlx-vlm serves: ``llava`` (a CLIP
tower, 16 tokens an image), ``mistral3`` (Pixtral's tower with a 2x2 patch
merger, rows of ``[IMG]`` tokens), ``qwen2_vl`` and ``qwen2_5_vl`` (their
towers, the latter with windowed attention, and the M-RoPE text model; 16
or more ``<|image_pad|>`` tokens an image). The tokenizer is the text fixtures' Qwen
BPE with the families' image tokens added; the image processors are
transformers' own (CLIP's, Pixtral's, Qwen2-VL's for both Qwen families), configured by the folder's
``preprocessor_config.json``. Written once into the fixture cache
(`mlxcel.model.fixtures.cache_dir`) or wherever the caller asks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel.model import fixtures

VISION_FAMILIES = ("llava", "mistral3", "qwen2_vl", "qwen2_5_vl")
VISION_FIXTURE_VERSION = "v1"
_FIRST_ADDED_ID = fixtures.VOCAB_SIZE  # 151,646
_IMAGE_TOKENS = {"llava": ("<image>",), "mistral3": ("[IMG]", "[IMG_BREAK]", "[IMG_END]"),
                 "qwen2_vl": ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"),
                 "qwen2_5_vl": ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>")}
VOCAB_SIZE = _FIRST_ADDED_ID + 3
_QWEN_VOCAB_SIZE = _FIRST_ADDED_ID + 4
_CLIP_MEAN, _CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]

_TEXT: dict[str, Any] = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-6, "vocab_size": VOCAB_SIZE, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "tie_word_embeddings": True,
}


def vision_fixture_config(family: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``config.json`` and ``preprocessor_config.json`` of a vision fixture family."""
    common = {"vocab_size": VOCAB_SIZE, "torch_dtype": "float32", "eos_token_id": fixtures.SPECIAL_TOKENS["<|im_end|>"],
              "tie_word_embeddings": True, "image_token_index": _FIRST_ADDED_ID}
    if family == "llava":
        config = {**common, "model_type": "llava", "architectures": ["LlavaForConditionalGeneration"],
                  "text_config": {**_TEXT, "model_type": "llama"},
                  "vision_config": {"model_type": "clip_vision_model", "num_hidden_layers": 2, "hidden_size": 32,
                                    "intermediate_size": 64, "num_attention_heads": 2, "image_size": 56,
                                    "patch_size": 14, "projection_dim": 32, "layer_norm_eps": 1e-5},
                  "vision_feature_select_strategy": "default", "vision_feature_layer": -2}
        processor = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 56},
                     "do_center_crop": True, "crop_size": {"height": 56, "width": 56}, "do_rescale": True,
                     "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _CLIP_MEAN,
                     "image_std": _CLIP_STD, "do_convert_rgb": True}
        return config, processor
    if family == "mistral3":
        config = {**common, "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
                  "text_config": {**_TEXT, "model_type": "mistral"},
                  "vision_config": {"model_type": "pixtral", "num_hidden_layers": 2, "hidden_size": 32, "head_dim": 16,
                                    "intermediate_size": 64, "num_attention_heads": 2, "image_size": 64,
                                    "patch_size": 8, "rope_theta": 10000.0},
                  "spatial_merge_size": 2, "vision_feature_layer": -1, "multimodal_projector_bias": False}
        processor = {"image_processor_type": "PixtralImageProcessor", "do_resize": True, "size": {"longest_edge": 64},
                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _CLIP_MEAN,
                     "image_std": _CLIP_STD, "do_convert_rgb": True}
        return config, processor
    if family in ("qwen2_vl", "qwen2_5_vl"):
        # The Qwen families keep the text model's fields at the root of their config.
        vision: dict[str, Any] = {"model_type": family, "depth": 2, "num_heads": 2, "patch_size": 14,
                                  "spatial_patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                  "in_channels": 3}
        if family == "qwen2_vl":
            vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        else:
            # Windowed attention in block 0, full attention in block 1, as Qwen2.5-VL alternates them.
            vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
                          fullatt_block_indexes=[1])
        architecture = "Qwen2VLForConditionalGeneration" if family == "qwen2_vl" else (
            "Qwen2_5_VLForConditionalGeneration")
        config = {**common, **_TEXT, "vocab_size": _QWEN_VOCAB_SIZE, "model_type": family,
                  "architectures": [architecture],
                  "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
                  "vision_config": vision,
                  "image_token_id": _FIRST_ADDED_ID, "vision_start_token_id": _FIRST_ADDED_ID + 1,
                  "vision_end_token_id": _FIRST_ADDED_ID + 2, "video_token_id": _FIRST_ADDED_ID + 3}
        del config["image_token_index"], config["head_dim"]
        processor = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 112 * 112,
                     "max_pixels": 112 * 112 * 4, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
                     "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _CLIP_MEAN,
                     "image_std": _CLIP_STD, "do_convert_rgb": True}
        return config, processor
    raise ValueError(f"unknown vision fixture family {family!r}; choose one of {', '.join(VISION_FAMILIES)}")


def _tokenizer_files(family: str, out_dir: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(fixtures.tokenizer_json_path()))
    names = _IMAGE_TOKENS[family]
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in names])
    for offset, name in enumerate(names):
        if tokenizer.token_to_id(name) != _FIRST_ADDED_ID + offset:
            raise RuntimeError(f"{name} got id {tokenizer.token_to_id(name)}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = fixtures._tokenizer_config()
    for offset, name in enumerate(names):
        config["added_tokens_decoder"][str(_FIRST_ADDED_ID + offset)] = {
            "content": name, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
            "special": True}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_vision_fixture(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write the folder of ``family`` into ``out_dir``: mlx-vlm's module tree with random float32 weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config, processor = vision_fixture_config(family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(processor, indent=2) + "\n")
    _tokenizer_files(family, out_dir)
    model_module, _ = get_model_and_args(json.loads(json.dumps(config)))
    settings = json.loads(json.dumps(config))
    model_config = model_module.ModelConfig.from_dict(settings)
    model_config = update_module_configs(model_config, model_module, settings, ["text", "vision", "projector"])
    mx.random.seed(seed)
    model = model_module.Model(model_config)
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    weights = {name: value.astype(mx.float32) for name, value in flat if not name.endswith("lm_head.weight")}
    mx.eval(weights)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out_dir


def vision_fixture_path(family: str, *, seed: int = 0) -> Path:
    """A cached folder of the vision fixture ``family``."""
    vision_fixture_config(family)  # reject unknown names before touching the disk
    name = f"vision-{family}-{VISION_FIXTURE_VERSION}-seed{seed}"
    return fixtures._cached_folder(name, lambda staging: write_vision_fixture(family, staging, seed=seed))
