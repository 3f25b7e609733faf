"""LoRA adapters: what the rest of the engine knows of them, without MLX.

An adapter is an mlx-lm adapter folder (`adapter_config.json` and
`adapters.safetensors`, what `mlx_lm.lora` writes). A sequence's *adapter
scales* are one multiplier per loaded adapter, in load order (llama.cpp's
`--lora` meaning: 1 is the adapter as trained, 0 is off). This module parses
`--lora`, checks adapters against a model's weights from the files' headers,
and digests the scales into the cache key's `lora_id`; mlxcel.model.lora
loads them into the model (MLX, on the device thread).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import blake3

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"


class AdapterError(Exception):
    """An adapter that cannot be served; the message is one line for the user."""


@attrs.frozen(kw_only=True)
class AdapterSpec:
    """One `--lora PATH[=SCALE]`."""

    path: Path
    scale: float = 1.0


@attrs.frozen(kw_only=True)
class AdapterInfo:
    """A loaded adapter as the rest of the engine knows it (no arrays)."""

    id: int
    path: Path
    # The server-wide scale it starts with (0 with --lora-init-without-apply).
    scale: float
    # blake3 of its weights file: part of every cache key built under it.
    digest: str


def parse_adapter_spec(text: str) -> AdapterSpec:
    """`PATH` or `PATH=SCALE` (a finite number)."""
    path, separator, scale_text = text.rpartition("=") if "=" in text else (text, "", "")
    scale = 1.0
    if separator:
        try:
            scale = float(scale_text)
        except ValueError:
            raise ValueError(f"--lora {text!r}: the scale after '=' must be a number") from None
        if not math.isfinite(scale):
            raise ValueError(f"--lora {text!r}: the scale must be finite")
    if not path:
        raise ValueError("--lora needs an adapter folder")
    return AdapterSpec(path=Path(path), scale=scale)


def adapter_cache_id(adapters: Sequence[AdapterInfo], scales: Sequence[float]) -> str:
    """The cache key's `lora_id`: a digest of the adapters in effect and their scales.

    Empty when no adapter is in effect (none loaded, or every scale 0: the
    forward pass is then the base model's exactly), so such requests share
    the base model's entries.
    """
    active = [(adapter, scale) for adapter, scale in zip(adapters, scales, strict=True) if scale != 0.0]
    if not active:
        return ""
    hasher = blake3.blake3(b"mlxcel.lora.v1")
    for adapter, scale in active:
        hasher.update(json.dumps([adapter.id, adapter.digest, repr(float(scale))]).encode())
    return hasher.hexdigest()


def file_digest(path: Path) -> str:
    hasher = blake3.blake3()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()


def _safetensors_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a .safetensors header (8-byte length, then JSON), without reading tensors."""
    with path.open("rb") as stream:
        length = int.from_bytes(stream.read(8), "little")
        if not 0 < length < 1 << 28:
            raise AdapterError(f"{path} is not a safetensors file")
        header = json.loads(stream.read(length))
    return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}


def check_adapters(model_folder: Path, config: dict[str, Any], specs: Sequence[AdapterSpec]) -> None:
    """Refuse, before anything loads, an adapter that is not an mlx-lm LoRA folder or does not fit the model.

    Shapes come from the files' headers: each adapted layer must exist in the
    model's weights with lora_a (its input width, rank) and lora_b (rank, its
    output width). Raises AdapterError with one line.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for weights_file in sorted(model_folder.glob("*.safetensors")):
        shapes.update(_safetensors_shapes(weights_file))
    bits = (config.get("quantization") or {}).get("bits")
    for spec in specs:
        config_path, weights_path = spec.path / ADAPTER_CONFIG, spec.path / ADAPTER_WEIGHTS
        if not config_path.is_file() or not weights_path.is_file():
            raise AdapterError(f"--lora {spec.path}: not an mlx-lm adapter folder (needs {ADAPTER_CONFIG} and "
                               f"{ADAPTER_WEIGHTS})")
        try:
            adapter_config = json.loads(config_path.read_text())
            rank = int(adapter_config["lora_parameters"]["rank"])
            float(adapter_config["lora_parameters"]["scale"])
        except (ValueError, KeyError, TypeError) as error:
            raise AdapterError(f"--lora {spec.path}: {ADAPTER_CONFIG} is not an mlx-lm LoRA config "
                               f"(missing or bad {error})") from None
        if adapter_config.get("fine_tune_type", "lora") != "lora":
            raise AdapterError(f"--lora {spec.path}: only LoRA adapters are served (this one is "
                               f"{adapter_config.get('fine_tune_type')!r})")
        for name, shape in _safetensors_shapes(weights_path).items():
            target, _, leaf = name.rpartition(".")
            if leaf not in ("lora_a", "lora_b"):
                raise AdapterError(f"--lora {spec.path}: {name} is not a LoRA weight (lora_a, lora_b)")
            base = shapes.get(f"{target}.weight")
            if base is None or len(base) != 2:
                raise AdapterError(f"--lora {spec.path}: {target} is not a linear layer of this model")
            output_dims, input_dims = base
            if f"{target}.scales" in shapes and bits:
                input_dims = input_dims * 32 // int(bits)
            expected = (input_dims, rank) if leaf == "lora_a" else (rank, output_dims)
            if shape != expected:
                raise AdapterError(f"--lora {spec.path}: {name} is {shape}, this model needs {expected} "
                                   f"(rank {rank})")
