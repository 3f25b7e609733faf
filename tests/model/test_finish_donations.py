"""A finished row's KV copy is queued with the next decode step, or after the step's reply when none is left.

The llama fixture (float32) through the executor and a scheduling core, every start marked to donate its KV at
the end (as a cached conversation's is). Queued alone while a step is in flight, each copy waited for that step
on CUDA: queueing a 64-row wave's copies took 0.2 s of its 0.34 s last step on an H100 (finish_step_probe.py).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
import pytest

from mlxcel.core.plan import Capabilities, InsertBatch, StartDirect
from mlxcel.core.scheduler import NewRequest, SchedulerCore
from mlxcel.fixtures import fixture_path
from mlxcel.model.executor import DeviceSettings, StepExecutor
from mlxcel.model.loader import LoadedModel, load_model
from mlxcel.types import SamplingParams
from tests.support import Recorder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(fixture_path("llama"))


def test_finished_rows_copies_ride_the_next_step_or_follow_the_reply(loaded, monkeypatch):
    queued: list[set[int]] = []  # the ids of the arrays each async_eval call queued
    held: list[Any] = []  # ... kept alive, so that no later array takes one of those ids
    real = mx.async_eval

    def flatten(value: Any) -> list[Any]:
        if isinstance(value, (list, tuple)):
            return [array for item in value for array in flatten(item)]
        return [value] if isinstance(value, mx.array) else []

    def recording(*arrays: Any) -> None:
        held.append(flatten(arrays))
        queued.append({id(array) for array in held[-1]})
        real(*arrays)

    monkeypatch.setattr(mx, "async_eval", recording)
    settings = DeviceSettings(model_path=fixture_path("llama"), prefill_step_size=512, context_size=4096,
                              max_batch_size=4)
    executor = StepExecutor(loaded.model, loaded.eos_token_ids, settings, loaded.family.model_type,
                            tokenizer=loaded.tokenizer)
    core = SchedulerCore(Capabilities(prefill_step_size=512, context_size=4096, max_batch_size=4),
                         tokenizer=loaded.tokenizer, eos_token_ids=frozenset())
    clients = Recorder()
    for name, max_tokens in (("short", 3), ("long", 6)):
        prompt = tuple(300 + 13 * len(name) + step for step in range(12))
        core.add(NewRequest(request_id=name, prompt_tokens=prompt, max_tokens=max_tokens,
                            sampling=SamplingParams(temperature=0.0), cache_context=None), clients)
    rode = False
    finished_at: dict[int, tuple[int, set[int]]] = {}  # sequence -> (the step it finished in, its copies' ids)
    for step in range(20):
        if not core.has_work():
            break
        assert core.next_lookup(0.0) is None
        plan = core.schedule()
        plan = attrs.evolve(plan, starts=tuple(
            attrs.evolve(start, donate_on_finish=True) if isinstance(start, (StartDirect, InsertBatch)) else start
            for start in plan.starts))
        before = len(queued)
        result = executor.run_step(plan)
        core.update(plan, result, clients, 0.0)
        queued_in_step = set().union(*queued[before:])
        for item in result.detached:
            if item.final:
                ids = {id(array) for array in item.payload.arrays()}
                assert not ids & queued_in_step, "queued alone, behind the step in flight"
                finished_at[item.sequence_id] = (step, ids)
        replied = len(queued)
        executor.after_reply()
        for at, ids in finished_at.values():
            if at == step - 1:
                # The row finished a step ago with another still decoding: its copies rode this step's queue,
                # together with the step's tokens.
                assert any(ids <= call and len(call) > len(ids) for call in queued[before:replied])
                rode = True
        if result.detached and not executor._by_uid:
            # Nothing left to decode: queued once the reply is out, in one call.
            ((call),) = queued[replied:]
            assert {i for item in result.detached for i in (id(a) for a in item.payload.arrays())} <= call
    assert len(finished_at) == 2
    assert rode, "the short row finished while the long one still decoded"
    assert {name: sum(len(delta.token_ids) for delta in deltas)
            for name, deltas in clients.deltas.items()} == {"short": 3, "long": 6}
