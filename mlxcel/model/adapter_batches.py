"""One mlx-lm BatchGenerator per LoRA adapter configuration, behind the generator's own interface.

A LoRA layer's scale is a single number for every row of a forward pass, so
sequences under different adapter scales cannot share a decode batch. Each
configuration (a tuple of per-adapter scales) gets its own BatchGenerator,
made on first use; a step runs each non-empty one in turn, after setting the
adapters' scales to its configuration. Sequences under one configuration
batch together as before; each further configuration in use costs one more
forward pass per step. Without adapters there is one configuration, ``()``,
and this is a plain BatchGenerator with renamed uids.

Only the device thread uses it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from mlxcel.model.lora import LoadedAdapters

Config = tuple[float, ...]


@dataclasses.dataclass
class _Stats:
    prompt_tokens: int = 0


class AdapterBatches:
    def __init__(self, make_generator: Callable[[], Any], adapters: LoadedAdapters | None) -> None:
        self._make_generator = make_generator
        self._adapters = adapters
        self._generators: dict[Config, Any] = {}
        # Our uid -> (configuration, the generator's uid), and back.
        self._inner: dict[int, tuple[Config, int]] = {}
        self._outer: dict[tuple[Config, int], int] = {}
        self._next_uid = 0
        self._stats: _Stats | None = None

    @property
    def stream(self) -> Any:
        return self._generator(()).stream

    def apply(self, config: Config) -> None:
        """Set the adapters' scales for the forward passes built next (outside the batches too)."""
        if self._adapters is not None:
            self._adapters.apply_scales(config)

    def insert(self, *args: Any, config: Config = (), **kwargs: Any) -> list[int]:
        return self._register(config, self._generator(config).insert(*args, **kwargs))

    def insert_segments(self, *args: Any, config: Config = (), **kwargs: Any) -> list[int]:
        return self._register(config, self._generator(config).insert_segments(*args, **kwargs))

    def join(self, joiners: list[Any], config: Config = ()) -> list[int]:
        """Sequences with their first token sampled join the decode batch (mlxcel/model/batch_join.py)."""
        from mlxcel.model.batch_join import join_decoding

        return self._register(config, join_decoding(self._generator(config), joiners))

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        # One remove per generator: each call filters (copies) its whole batch cache.
        by_config: dict[Config, list[tuple[int, int]]] = {}
        for uid in uids:
            config, inner = self._inner.pop(uid)
            del self._outer[(config, inner)]
            by_config.setdefault(config, []).append((uid, inner))
        found: dict[int, Any] = {}
        for config, pairs in by_config.items():
            caches = self._generators[config].remove([inner for _uid, inner in pairs],
                                                     return_prompt_caches=return_prompt_caches)
            found.update((uid, caches[inner]) for uid, inner in pairs if inner in caches)
        return found

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        found = {}
        for uid in uids:
            config, inner = self._inner[uid]
            found[uid] = self._generators[config].extract_cache([inner])[inner]
        return found

    @contextlib.contextmanager
    def stats(self) -> Iterator[_Stats]:
        self._stats = _Stats()
        try:
            yield self._stats
        finally:
            self._stats = None

    def next(self) -> tuple[list[Any], list[Any]]:
        """One step of every configuration that holds sequences; responses carry our uids."""
        prompt_responses: list[Any] = []
        generation_responses: list[Any] = []
        configs = {config for config, _inner in self._inner.values()}
        for config in sorted(configs):
            generator = self._generators[config]
            self.apply(config)
            with generator.stats() as stats:
                prompts, generated = generator.next()
            if self._stats is not None:
                self._stats.prompt_tokens += stats.prompt_tokens
            prompt_responses += [renamed for response in prompts
                                 if (renamed := self._renamed(config, response)) is not None]
            generation_responses += [renamed for response in generated
                                     if (renamed := self._renamed(config, response)) is not None]
        for config in [config for config in self._generators if config not in configs and config != ()]:
            # An idle configuration's generator holds nothing; let it go.
            self._generators.pop(config).close()
        return prompt_responses, generation_responses

    def close(self) -> None:
        for generator in self._generators.values():
            generator.close()
        self._generators.clear()

    def _generator(self, config: Config) -> Any:
        generator = self._generators.get(config)
        if generator is None:
            generator = self._generators[config] = self._make_generator()
        return generator

    def _register(self, config: Config, inner_uids: list[int]) -> list[int]:
        uids = []
        for inner in inner_uids:
            uid = self._next_uid
            self._next_uid += 1
            self._inner[uid] = (config, inner)
            self._outer[(config, inner)] = uid
            uids.append(uid)
        return uids

    def _renamed(self, config: Config, response: Any) -> Any | None:
        uid = self._outer.get((config, response.uid))
        if uid is None:
            return None
        if getattr(response, "finish_reason", None) is not None:
            # mlx-lm drops a finished sequence itself.
            del self._outer[(config, response.uid)]
            del self._inner[uid]
        return dataclasses.replace(response, uid=uid)
