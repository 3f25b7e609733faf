"""LoRA adapters served unfused, each row of a forward pass at its own scales.

Each loaded adapter wraps the layers it trained in mlx-lm's ``LoRALinear``
(``RowScaledLoRA``, which takes its scale per row) whose ``linear`` is the
layer below (the base layer, or the previous adapter's), so one forward
pass runs the base matmul once for the batch and adds every adapter's
low-rank update. An adapter's scale is a (rows, 1, 1) array, broadcast
over each row's tokens: the row's multiplier for that adapter times the
adapter's trained `lora_parameters.scale`, 0 for rows not using it.
``LoadedAdapters.set_rows`` sets it from the rows' configurations (one
tuple of multipliers per row, in the batch's row order) before a pass is
built; an adapter no row uses is skipped. A pass holds the arrays it was
built with, so passes built for other rows do not interfere even while they
are still being evaluated. Only the device thread uses this.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
from mlx_lm.tuner.lora import LoRALinear

from mlxcel.model.adapters import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    AdapterInfo,
    AdapterSpec,
    file_digest,
)

# A row's adapter configuration: its multiplier per loaded adapter, in load order (() is every adapter off).
Config = tuple[float, ...]


class RowScales:
    """One adapter's scales for the pass being built, shared by its layers: (rows, 1, 1), or None when off."""

    def __init__(self) -> None:
        self.scale: Any = None


class RowScaledLoRA(LoRALinear):  # type: ignore[misc]  # mlx-lm is untyped
    """mlx-lm's ``LoRALinear`` whose scale is read per row from its adapter's ``RowScales``."""

    # Set by load_adapters; the underscore keeps it out of the model's parameters.
    _rows: RowScales

    def __call__(self, x: mx.array) -> mx.array:
        scale = self._rows.scale
        if scale is None:
            return self.linear(x)
        if scale.shape[0] != x.shape[0]:
            raise ValueError(f"LoRA scales were set for {scale.shape[0]} rows; this pass has {x.shape[0]}")
        # LoRALinear's own update, with one scale per row.
        z = (self.dropout(x) @ self.lora_a) @ self.lora_b
        return self.linear(x) + (scale * z).astype(x.dtype)


@attrs.define
class LoadedAdapters:
    """The adapters' layers in the model; ``set_rows`` sets their per-row scales for the passes built next."""

    infos: tuple[AdapterInfo, ...]
    # Per adapter: its trained scale (lora_parameters.scale) and the scales its layers read.
    trained: tuple[float, ...]
    rows: tuple[RowScales, ...] = attrs.field(repr=False)
    # The configurations the scales were last set for: the decode batch keeps its rows from step to step.
    current: tuple[Config, ...] | None = None

    def set_rows(self, configs: Sequence[Config]) -> None:
        """Scales for a pass whose rows run under ``configs``, in row order (empty: every adapter off)."""
        configs = tuple(configs)
        if configs == self.current:
            return
        for index, (trained, shared) in enumerate(zip(self.trained, self.rows, strict=True)):
            column = [trained * config[index] if config else 0.0 for config in configs]
            shared.scale = mx.array(column, dtype=mx.float32).reshape(-1, 1, 1) if any(column) else None
        self.current = configs


def load_adapters(model: Any, specs: Sequence[AdapterSpec], *, apply: bool = True) -> LoadedAdapters:
    """Wrap ``model``'s layers in one LoRA layer per adapter and load each adapter's weights.

    ``apply`` false: the server-wide scales start at 0 (`--lora-init-without-apply`). Every layer
    starts off until ``set_rows`` names the rows of a pass.
    """
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    infos: list[AdapterInfo] = []
    trained_scales: list[float] = []
    shared_rows: list[RowScales] = []
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
        shared = RowScales()
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
            layer = RowScaledLoRA(input_dims=input_dims, output_dims=output_dims, r=rank, dropout=float(dropout),
                                  scale=trained)
            layer.linear = below
            layer._rows = shared
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
        trained_scales.append(trained)
        shared_rows.append(shared)
        infos.append(AdapterInfo(id=index, path=spec.path, scale=spec.scale if apply else 0.0,
                                 digest=file_digest(weights_path)))
    return LoadedAdapters(infos=tuple(infos), trained=tuple(trained_scales), rows=tuple(shared_rows))
