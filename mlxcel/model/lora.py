"""LoRA adapters served unfused: mlx-lm's own LoRA layers, nested, one per adapter.

Each loaded adapter wraps the layers it trained in an mlx-lm ``LoRALinear``
whose ``linear`` is the layer below (the base layer, or the previous
adapter's ``LoRALinear``), so one forward pass adds every adapter's
low-rank update at its own scale. A layer's ``scale`` is the sequence's
multiplier for that adapter times the adapter's trained
`lora_parameters.scale`. The scales are Python floats read when a forward
pass is built, so passes built under different scales do not interfere
even while they are still being evaluated. Only the device thread uses this.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs

from mlxcel.model.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterInfo,
    AdapterSpec,
    file_digest,
)


@attrs.define
class LoadedAdapters:
    """The adapters' layers in the model, per adapter; ``apply_scales`` sets them for the next passes."""

    infos: tuple[AdapterInfo, ...]
    # Per adapter: (its trained scale, its LoRALinear layers).
    layers: list[tuple[float, list[Any]]] = attrs.field(repr=False)
    current: tuple[float, ...] = ()

    def apply_scales(self, scales: Sequence[float]) -> None:
        scales = tuple(scales) or tuple(0.0 for _ in self.infos)
        if scales == self.current:
            return
        for (trained, modules), scale in zip(self.layers, scales, strict=True):
            for module in modules:
                module.scale = trained * scale
        self.current = scales


def load_adapters(model: Any, specs: Sequence[AdapterSpec], *, apply: bool = True) -> LoadedAdapters:
    """Wrap ``model``'s layers in one LoRALinear per adapter and load each adapter's weights.

    ``apply`` false: every adapter starts at scale 0 (`--lora-init-without-apply`).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.lora import LoRALinear

    infos: list[AdapterInfo] = []
    layers: list[tuple[float, list[Any]]] = []
    for index, spec in enumerate(specs):
        config_path = spec.path / ADAPTER_CONFIG
        weights_path = spec.path / ADAPTER_WEIGHTS
        if not config_path.is_file() or not weights_path.is_file():
            raise AdapterError(f"--lora {spec.path}: not an mlx-lm adapter folder (needs {ADAPTER_CONFIG} and "
                               f"{ADAPTER_WEIGHTS})")
        try:
            config = json.loads(config_path.read_text())
            parameters = config["lora_parameters"]
            rank, trained, dropout = int(parameters["rank"]), float(parameters["scale"]), parameters.get("dropout", 0.0)
            num_layers = int(config["num_layers"])
        except (ValueError, KeyError, TypeError) as error:
            raise AdapterError(f"--lora {spec.path}: {ADAPTER_CONFIG} is not an mlx-lm LoRA config ({error})") from None
        if config.get("fine_tune_type", "lora") != "lora":
            raise AdapterError(f"--lora {spec.path}: only LoRA adapters are served (this one is "
                               f"{config.get('fine_tune_type')!r})")
        weights: dict[str, Any] = mx.load(str(weights_path))  # type: ignore[assignment]  # a .safetensors: a dict
        targets = sorted({name.rsplit(".", 1)[0] for name in weights})
        modules = dict(model.named_modules())
        wrapped: list[Any] = []
        updates: list[tuple[str, Any]] = []
        for target in targets:
            below = modules.get(target)
            if below is None:
                raise AdapterError(f"--lora {spec.path}: {target} is not a layer of this model")
            base = below
            while isinstance(base, LoRALinear):
                base = base.linear
            if not isinstance(base, (nn.Linear, nn.QuantizedLinear)):
                raise AdapterError(f"--lora {spec.path}: {target} is a {type(base).__name__}, not a linear layer")
            output_dims, input_dims = base.weight.shape
            if isinstance(base, nn.QuantizedLinear):
                input_dims = input_dims * 32 // base.bits
            layer = LoRALinear(input_dims=input_dims, output_dims=output_dims, r=rank, dropout=float(dropout),
                               scale=trained * (spec.scale if apply else 0.0))
            layer.linear = below
            for leaf in ("lora_a", "lora_b"):
                weight = weights.get(f"{target}.{leaf}")
                expected = getattr(layer, leaf).shape
                if weight is None or tuple(weight.shape) != tuple(expected):
                    raise AdapterError(
                        f"--lora {spec.path}: {target}.{leaf} is {None if weight is None else tuple(weight.shape)},"
                        f" this model needs {tuple(expected)} (rank {rank}, num_layers {num_layers})")
                # As saved (mlx-lm trains them in float32); the update is cast to the activations' dtype.
                setattr(layer, leaf, weight)
            wrapped.append(layer)
            updates.append((target, layer))
        model.update_modules(tree_unflatten(updates))
        mx.eval([(layer.lora_a, layer.lora_b) for layer in wrapped])
        layers.append((trained, wrapped))
        infos.append(AdapterInfo(id=index, path=spec.path, scale=spec.scale if apply else 0.0,
                                 digest=file_digest(weights_path)))
    loaded = LoadedAdapters(infos=tuple(infos), layers=layers)
    loaded.current = tuple(info.scale for info in infos)
    return loaded
