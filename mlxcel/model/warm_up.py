"""The device's warm-up: the shapes real requests will run, once, before the server says it is ready.

A GPU backend compiles its kernels on first use, and MLX's CUDA backend
builds a plan for each new attention shape (0.06-0.16 s each on the H200):
seconds for the first requests otherwise. The plans come from a scheduling
core of the real capabilities, so the warm-up runs what real requests will:
a direct start, a chunked prefill, decoding, and on bucketed backends the
batched cold starts of each power-of-two row count up to the batch size, at
each cold row width (core/placement.py).
Runs on the device thread.
"""

from __future__ import annotations

import time
from typing import Any

import attrs

from mlxcel.core.placement import COLD_QUERY_BUCKETS, START_QUERY_BUCKET
from mlxcel.core.plan import Capabilities
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.model.executor import COLD_GROUP_POSITIONS, StepExecutor
from mlxcel.model.info import ModelInfo
from mlxcel.types import SamplingParams


class _NoClients:
    """The warm-up's requests go nowhere."""

    def send(self, request_id: str, delta: Any) -> bool:
        return True

    def fail(self, request_id: str, error: Any) -> None:
        raise RuntimeError(f"the device warm-up failed: {error.message}")

    def close(self, request_id: str) -> None:
        pass


def warm_up(executor: StepExecutor, info: ModelInfo) -> float:
    """Run the warm-up's plans on ``executor``; returns the seconds it took. The executor is fresh afterwards."""
    import mlx.core as mx

    started = time.perf_counter()
    settings = executor.settings
    assert settings.prefill_step_size is not None
    assert settings.context_size is not None
    executor.settings = attrs.evolve(settings, fail_step=None)
    core = SchedulerCore(
        Capabilities(prefill_step_size=settings.prefill_step_size, context_size=settings.context_size,
                     max_batch_size=settings.max_batch_size, bucket_starts=executor.bucket_starts),
        tokenizer=info.tokenizer, eos_token_ids=info.eos_token_ids,
    )
    clients = _NoClients()
    rounds: list[list[int]] = [[8, settings.prefill_step_size + 8]]  # one chunk; two chunks
    if executor.bucket_starts:
        # Waves of short prompts: one batched pass of `count` rows, at each cold row width.
        for width in (*COLD_QUERY_BUCKETS, START_QUERY_BUCKET):
            if width - 4 > settings.prefill_step_size:
                break  # longer prompts are prefilled alone, not in a batched pass
            count = 2
            while count <= min(settings.max_batch_size, COLD_GROUP_POSITIONS // width):
                rounds.append([width - 4] * count)
                count *= 2
    number = 0
    for lengths in rounds:
        for length in lengths:
            prompt = tuple(10 + (number + i) % 1000 for i in range(length))
            core.add(NewRequest(request_id=f"warm-up-{number}", prompt_tokens=prompt, max_tokens=3,
                                sampling=SamplingParams(temperature=0.0), cache_context=None), clients)
            number += 1
        for _ in range(64):
            if not core.has_work():
                break
            assert core.next_lookup(0.0) is None
            plan = core.schedule()
            core.update(plan, executor.run_step(plan), clients, 0.0)
            executor.after_reply()
    executor.settings = settings
    executor.reset()
    executor.prefill_seconds_per_token = executor.time_a_prefill_chunk()
    mx.clear_cache()
    return time.perf_counter() - started
