"""What the rest of the engine knows of the loaded model: plain values, no arrays."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from mlxcel.model.adapters import AdapterInfo
from mlxcel.model.family import ModelFamily
from mlxcel.vision.processing import VisionSpec


@attrs.frozen(kw_only=True)
class ModelInfo:
    """What the rest of the engine needs to know of the loaded model (no arrays)."""

    model_id: str
    path: Path
    config: dict[str, Any] = attrs.field(repr=False)
    family: ModelFamily
    tokenizer: Any = attrs.field(repr=False, eq=False)
    chat_template: str = attrs.field(repr=False)
    eos_token_ids: frozenset[int]
    context_size: int
    prefill_step_size: int = 2048
    # Starts in bucketed shapes and long prompts prefilled alone (CUDA with plain KV caches).
    bucket_starts: bool = False
    # The LoRA adapters loaded, ids 0, 1, ... (their scales here: the ones they started with).
    adapters: tuple[AdapterInfo, ...] = ()
    # A vision-language model's image handling (None: text only).
    vision: VisionSpec | None = None
