"""Every actor's run(): it calls task_status.started() and returns once its inbox is closed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio

from mlxcel.actors.cache_store import CacheStoreActor
from mlxcel.actors.device import DeviceActor, DeviceSettings, ModelInfo
from mlxcel.actors.messages import SubmitRequest
from mlxcel.actors.metrics import MetricsActor
from mlxcel.actors.router import RouterActor
from mlxcel.actors.scheduler import SchedulerActor
from mlxcel.actors.warmer import WarmerActor
from mlxcel.cache.store import PromptCacheStore, StoreLimits
from mlxcel.config import SchedulerConfig
from mlxcel.core.plan import Capabilities, StepResult
from mlxcel.core.scheduler import NewRequest
from mlxcel.fixtures import fixture_path
from mlxcel.model.family import FamilyKind, ModelFamily
from mlxcel.model.prompt import PromptRenderer
from mlxcel.types import SamplingParams

pytestmark = pytest.mark.slow

# Outgoing channels an actor owns and must close when it stops, by name.
Built = tuple[Any, trio.MemorySendChannel[Any], dict[str, trio.MemoryReceiveChannel[Any]]]


class NoTokenizer:
    """The scheduler and router only use the tokenizer once tokens arrive."""

    detokenizer = None


def fake_model() -> ModelInfo:
    return ModelInfo(
        model_id="fake", path=fixture_path("llama"), config={}, family=ModelFamily(model_type="llama", kind=FamilyKind.DENSE),
        tokenizer=NoTokenizer(), chat_template="", eos_token_ids=frozenset({0}), context_size=64,
    )


def build_scheduler() -> Built:
    send, inbox = trio.open_memory_channel[Any](4)
    to_device, device = trio.open_memory_channel[Any](1)
    actor = SchedulerActor(
        config=SchedulerConfig(), capabilities=Capabilities(prefill_step_size=256, context_size=64), inbox=inbox, to_device=to_device, to_cache_store=None, to_metrics=None,
        to_warmer=None, tokenizer=NoTokenizer(), eos_token_ids=frozenset(),
    )
    return actor, send, {"to_device": device}


def build_cache_store(enabled: bool) -> Callable[[], Built]:
    def build() -> Built:
        send, inbox = trio.open_memory_channel[Any](4)
        store = PromptCacheStore(StoreLimits(capacity_bytes=1 << 20)) if enabled else None
        return CacheStoreActor(store=store, inbox=inbox), send, {}

    return build


def build_metrics() -> Built:
    send, inbox = trio.open_memory_channel[Any](4)
    return MetricsActor(inbox=inbox), send, {}


def build_warmer() -> Built:
    send, inbox = trio.open_memory_channel[Any](4)
    return WarmerActor(inbox=inbox), send, {}


def build_router() -> Built:
    send, inbox = trio.open_memory_channel[Any](4)
    to_scheduler, scheduler = trio.open_memory_channel[Any](4)
    model = fake_model()
    actor = RouterActor(
        model=model, renderer=PromptRenderer(model, default_template_kwargs={}, cache_enabled=True),
        cache_enabled=True, inbox=inbox, to_scheduler=to_scheduler,
    )
    return actor, send, {"to_scheduler": scheduler}


@pytest.mark.parametrize("build", [
    pytest.param(build_scheduler, id="scheduler"),
    pytest.param(build_cache_store(True), id="cache-store"),
    pytest.param(build_cache_store(False), id="cache-store-disabled"),
    pytest.param(build_metrics, id="metrics"),
    pytest.param(build_warmer, id="warmer"),
    pytest.param(build_router, id="router"),
])
async def test_actor_starts_and_returns_when_its_inbox_closes(build: Callable[[], Built]) -> None:
    actor, send, outgoing = build()
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            # nursery.start raises if run() returns without calling started().
            await nursery.start(actor.run)
            send.close()
    for _name, receive in outgoing.items():
        # The actor closed the channel it owns, so its peer sees the end.
        with pytest.raises(trio.EndOfChannel):
            receive.receive_nowait()


async def test_scheduler_stops_after_the_step_in_flight_when_its_inbox_closes() -> None:
    actor, send, outgoing = build_scheduler()
    events_send, events = trio.open_memory_channel[Any](4)
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            await nursery.start(actor.run)
            await send.send(SubmitRequest(request=NewRequest(
                request_id="r1", prompt_tokens=(1, 2), sampling=SamplingParams(), max_tokens=4,
                cache_context=None), events=events_send,
            ))
            step = await outgoing["to_device"].receive()
            assert len(step.plan.starts) == 1
            send.close()
            # The one task notices the closed inbox once the device answers; it plans no other step.
            step.reply_to.send_nowait(StepResult(step_number=1))
    with pytest.raises(trio.EndOfChannel):
        outgoing["to_device"].receive_nowait()


async def test_device_starts_with_the_model_and_returns_when_its_inbox_closes() -> None:
    send, inbox = trio.open_memory_channel[Any](0)
    actor = DeviceActor(DeviceSettings(model_path=fixture_path("llama")), inbox)
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            info = await nursery.start(actor.run)
            assert isinstance(info, ModelInfo)
            send.close()
