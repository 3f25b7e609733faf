"""One mlx-lm BatchGenerator for every LoRA adapter configuration, each row at its own scales.

A sequence's configuration (a tuple of per-adapter multipliers, ``()`` for
none) is recorded by uid when it enters the generator. mlx-lm's batches call
the model with their rows in their own order and name no rows, so with
adapters loaded the generator gets the model behind ``_RowScaledModel``:
each call first reads the calling batch's uids (the decode batch, the prompt
batch, or the rows moving from one to the other) and sets every adapter's
per-row scales for them (``mlxcel/model/lora.py``). The base matmuls run
once for the batch whatever the mix. The executor's own passes outside the
generator (starts, chunks prefilled alone) set their rows with ``apply``.
Without adapters the generator gets the model itself.

Only the device thread uses it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

from mlxcel.model.lora import Config, LoadedAdapters


class _RowScaledModel:
    """The model as the generator's batches call it: each call sets the adapters' scales for its rows first."""

    def __init__(self, model: Any, adapters: LoadedAdapters, config_of: dict[int, Config]) -> None:
        self._model = model
        self._adapters = adapters
        self._config_of = config_of

    def __getattr__(self, name: str) -> Any:
        # make_prompt_cache and the rest of mlx-lm see the model's own attributes.
        return getattr(self._model, name)

    def __call__(self, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # mlx-lm's batches call ``self.model(...)`` from their own methods: the caller's self holds the rows.
        batch = sys._getframe(1).f_locals.get("self")
        if not isinstance(batch, (GenerationBatch, PromptProcessingBatch)) or len(batch.uids) != inputs.shape[0]:
            raise RuntimeError("the adapters' per-row scales need the calling mlx-lm batch's rows")
        self._adapters.set_rows([self._config_of[uid] for uid in batch.uids])
        return self._model(inputs, *args, **kwargs)


class AdapterBatches:
    def __init__(self, make_generator: Callable[[Any], Any], model: Any, adapters: LoadedAdapters | None) -> None:
        self._adapters = adapters
        # The generator's uid -> its sequence's configuration.
        self._config_of: dict[int, Config] = {}
        batched = model if adapters is None else _RowScaledModel(model, adapters, self._config_of)
        self._generator = make_generator(batched)
        self.apply(())

    @property
    def stream(self) -> Any:
        return self._generator.stream

    def apply(self, configs: Sequence[Config]) -> None:
        """Set the adapters' per-row scales for the pass built next, one configuration per row in row order.

        Every forward pass outside mlx-lm's batches calls this first (a pass whose rows do not match raises).
        """
        if self._adapters is not None:
            self._adapters.set_rows(configs)

    def configs_of(self, uids: Sequence[int]) -> list[Config]:
        """The configurations of the generator's sequences ``uids``, in that order (for ``apply``)."""
        return [self._config_of[uid] for uid in uids]

    def insert(self, *args: Any, config: Config = (), **kwargs: Any) -> list[int]:
        return self._register(config, self._generator.insert(*args, **kwargs))

    def insert_segments(self, *args: Any, config: Config = (), **kwargs: Any) -> list[int]:
        return self._register(config, self._generator.insert_segments(*args, **kwargs))

    def join(self, joiners: list[Any], config: Config = ()) -> list[int]:
        """Sequences with their first token sampled join the decode batch (mlxcel/model/batch_join.py)."""
        from mlxcel.model.batch_join import join_decoding

        return self._register(config, join_decoding(self._generator, joiners))

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        for uid in uids:
            del self._config_of[uid]
        # One call: each remove filters (copies) the whole batch cache.
        found: dict[int, Any] = self._generator.remove(uids, return_prompt_caches=return_prompt_caches)
        return found

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        found: dict[int, Any] = self._generator.extract_cache(uids)
        return found

    def prompt_tokens(self) -> int:
        """Prompt tokens the generator has prefilled so far. Read from its counters: its ``stats()`` window
        copies every counter with ``dataclasses.asdict`` (a deep copy) on entry and exit, twice a step."""
        return int(self._generator._counters.prompt_tokens)

    def next(self) -> tuple[list[Any], list[Any]]:
        """One step of the whole batch, whatever configurations its rows run under."""
        prompt_responses, generation_responses = self._generator.next()
        for response in generation_responses:
            if response.finish_reason is not None:
                # mlx-lm drops a finished sequence itself.
                self._config_of.pop(response.uid, None)
        return prompt_responses, generation_responses

    def close(self) -> None:
        self._generator.close()
        self._config_of.clear()
        self.apply(())

    def _register(self, config: Config, uids: list[int]) -> list[int]:
        for uid in uids:
            self._config_of[uid] = config
        return uids
