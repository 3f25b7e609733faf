"""The scheduler actor alone: hand-built channels, the test plays the device and the cache store."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from mlxcel.actors.messages import (
    CancelRequest,
    DonateSequence,
    GetSchedulerStats,
    LookupPrefix,
    PrefixFound,
    PrefixMissing,
    RequestFailed,
    RequestFinished,
    RunStep,
    SchedulerStats,
    StreamEvent,
    SubmitRequest,
)
from mlxcel.actors.scheduler import ARRIVAL_WINDOW_SECONDS, SchedulerActor
from mlxcel.cache.key import CacheContext
from mlxcel.config import SchedulerConfig
from mlxcel.core.cache_plan import CACHE_OFF, CacheMode, CachePlan
from mlxcel.core.output import StopMatcher
from mlxcel.core.plan import Capabilities, DetachedSequence, Removal, SampledToken, StartDirect, StepResult
from mlxcel.core.scheduler import NewRequest
from mlxcel.types import Delta, SamplingParams, ServerBusy, Usage
from tests.support import LetterTokenizer as FakeTokenizer

EOS = 999
CONTEXT = CacheContext(model_id="fake-model", template_sig="sig", session_key="session-1")


@attrs.define
class FakePayload:
    adoptable: bool = True
    asked: list[int] = attrs.Factory(list)

    def can_adopt(self, num_tokens: int) -> bool:
        self.asked.append(num_tokens)
        return self.adoptable


@attrs.define
class Harness:
    """A running scheduler and the far ends of its channels."""

    actor: SchedulerActor
    inbox: trio.MemorySendChannel[Any]
    device: trio.MemoryReceiveChannel[RunStep]
    store: trio.MemoryReceiveChannel[Any] | None
    metrics: trio.MemoryReceiveChannel[Any]
    warmer: trio.MemoryReceiveChannel[Any]
    step_number: int = 0

    async def submit(
        self,
        request_id: str,
        prompt: tuple[int, ...] = (1, 2, 3),
        *,
        max_tokens: int = 8,
        stop: tuple[str, ...] = (),
        logprobs: bool = False,
        context: CacheContext | None = None,
        buffer: int = 64,
        more_pending: bool = False,
    ) -> trio.MemoryReceiveChannel[StreamEvent]:
        events_send, events = trio.open_memory_channel[StreamEvent](buffer)
        await self.inbox.send(SubmitRequest(request=NewRequest(
            request_id=request_id,
            prompt_tokens=prompt,
            sampling=SamplingParams(temperature=0.0, stop=stop, logprobs=logprobs),
            max_tokens=max_tokens,
            cache_context=context,
            more_pending=more_pending,
        ), events=events_send))
        await trio.testing.wait_all_tasks_blocked()
        return events

    async def step(self) -> RunStep:
        with trio.fail_after(2):
            return await self.device.receive()

    async def reply(self, step: RunStep, **fields: Any) -> None:
        """Answer a step as the device would, and let the scheduler take it in."""
        self.step_number += 1
        step.reply_to.send_nowait(StepResult(step_number=self.step_number, **fields))
        await trio.testing.wait_all_tasks_blocked()

    async def settle(self) -> None:
        await trio.testing.wait_all_tasks_blocked()

    async def assert_idle(self) -> None:
        """No step is being offered to the device."""
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            self.device.receive_nowait()

    async def stats(self) -> SchedulerStats:
        reply_to, replies = trio.open_memory_channel[SchedulerStats](1)
        await self.inbox.send(GetSchedulerStats(reply_to=reply_to))
        with trio.fail_after(2), replies:
            return await replies.receive()


def token(sequence_id: int, value: int, finish_reason: str | None = None, logprob: float = -0.5) -> SampledToken:
    return SampledToken(sequence_id=sequence_id, token=value, logprob=logprob, finish_reason=finish_reason)


def available(events: trio.MemoryReceiveChannel[StreamEvent]) -> tuple[list[StreamEvent], bool]:
    """The events delivered so far, and whether the stream has ended."""
    received: list[StreamEvent] = []
    while True:
        try:
            received.append(events.receive_nowait())
        except trio.WouldBlock:
            return received, False
        except trio.EndOfChannel:
            return received, True


def drain(channel: trio.MemoryReceiveChannel[Any]) -> list[Any]:
    items = []
    while True:
        try:
            items.append(channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return items


def text_of(events: list[StreamEvent]) -> str:
    return "".join(event.text for event in events if isinstance(event, Delta))


StartScheduler = Callable[..., Any]


@pytest.fixture
def start_scheduler(nursery: trio.Nursery) -> StartScheduler:
    async def start(*, with_store: bool = False, actor_options: dict[str, Any] | None = None,
                    **config: Any) -> Harness:
        inbox_send, inbox = trio.open_memory_channel[Any](64)
        # Unbuffered: each RunStep waits for the test to take it, as with one step in flight.
        to_device, device = trio.open_memory_channel[RunStep](0)
        to_store, store = trio.open_memory_channel[Any](64)
        to_metrics, metrics = trio.open_memory_channel[Any](64)
        to_warmer, warmer = trio.open_memory_channel[Any](64)
        # Lockstep unless a test asks otherwise: most tests check each plan against the last result.
        config.setdefault("steps_ahead", 1)
        scheduler_config = SchedulerConfig(**config)
        actor = SchedulerActor(
            config=scheduler_config,
            capabilities=Capabilities(prefill_step_size=scheduler_config.prefill_step_size or 2048,
                                      context_size=4096, max_batch_size=scheduler_config.max_batch_size),
            inbox=inbox,
            to_device=to_device,
            to_cache_store=to_store if with_store else None,
            to_metrics=to_metrics,
            to_warmer=to_warmer,
            tokenizer=FakeTokenizer(),
            eos_token_ids=frozenset({EOS}),
            **{"cache": CachePlan(mode=CacheMode.PREFIX) if with_store else CACHE_OFF, **(actor_options or {})},
        )
        await nursery.start(actor.run)
        return Harness(
            actor=actor, inbox=inbox_send, device=device,
            store=store if with_store else None, metrics=metrics, warmer=warmer,
        )

    return start


async def answer_lookups(
    store: trio.MemoryReceiveChannel[Any],
    answer: Callable[[LookupPrefix], PrefixFound | PrefixMissing],
    lookups: list[LookupPrefix],
    donations: list[DonateSequence],
) -> None:
    """A fake cache store: answers lookups with ``answer`` and records donations."""
    async for message in store:
        match message:
            case LookupPrefix():
                lookups.append(message)
                with message.reply_to:
                    message.reply_to.send_nowait(answer(message))
            case DonateSequence():
                donations.append(message)


# --- admission and streaming ----------------------------------------------------


async def test_request_streams_deltas_then_usage(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", (5, 6, 7), max_tokens=3)

    step = await harness.step()
    assert step.plan.removals == ()
    (admission,) = step.plan.starts
    assert admission.sequence_id == 0
    assert admission.prompt_tokens == (5, 6, 7)
    assert admission.cached_tokens == ()
    assert admission.adopted is None
    assert admission.max_tokens == 3
    assert admission.donate_on_finish is False
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)

    step = await harness.step()
    assert step.plan.starts == ()
    assert step.plan.removals == ()
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 2, "length"),), decode_batch_size=1)
    # The device already dropped a sequence it finished: no removal step follows.
    await harness.assert_idle()

    received, ended = available(events)
    assert ended
    assert received == [
        Delta(text="a", token_ids=(0,)),
        Delta(text="b", token_ids=(1,)),
        Delta(text="c", token_ids=(2,)),
        Delta(finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=3, cached_tokens=0)),
    ]
    stats = await harness.stats()
    assert stats.num_running == 0
    assert stats.num_completed == 1
    assert stats.num_steps == 3
    (finished,) = drain(harness.metrics)
    assert isinstance(finished, RequestFinished)
    assert (finished.finish_reason, finished.prompt_tokens, finished.completion_tokens) == ("length", 3, 3)
    assert finished.seconds_to_first_token is not None
    assert finished.seconds_to_first_token >= 0
    # No cache context, so no session for the warmer.
    assert drain(harness.warmer) == []


async def test_eos_token_is_not_emitted_as_text(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1")
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, EOS, "stop"),), decode_batch_size=1)
    received, ended = available(events)
    assert ended
    assert text_of(received) == "a"
    # The end-of-sequence token is not counted, as OpenAI counts.
    assert received[-1] == Delta(finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=1))


async def test_eos_token_has_no_logprob_and_is_not_counted(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", logprobs=True)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, EOS, "stop"),), decode_batch_size=1)
    received, ended = available(events)
    assert ended
    logprobs = [item for event in received for item in event.logprobs]
    assert [item.token for item in logprobs] == ["a", "b"]
    assert [item.token_id for item in logprobs] == [0, 1]
    assert [tid for event in received for tid in event.token_ids] == [0, 1]
    assert received[-1].usage.completion_tokens == len(logprobs) == 2
    assert received[-1].stop_string is None
    usage = received[-1].usage
    assert usage.prompt_seconds >= 0
    assert usage.decode_seconds >= 0


async def test_logprobs_are_decoded_with_the_tokenizer(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", logprobs=True)
    step = await harness.step()
    step.reply_to.send_nowait(StepResult(step_number=1, sampled=(SampledToken(
        sequence_id=0, token=2, logprob=-0.25, top_logprobs=((2, -0.25), (3, -1.5)), finish_reason="length",
    ),)))
    await harness.settle()
    received, _ = available(events)
    (logprob,) = received[0].logprobs
    assert (logprob.token, logprob.logprob, logprob.top) == ("c", -0.25, (("c", -0.25), ("d", -1.5)))


# --- cancellation and departed clients -------------------------------------------


async def test_cancel_mid_stream_removes_without_donating(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", context=CONTEXT)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()  # in flight when the cancel lands

    await harness.inbox.send(CancelRequest(request_id="r1"))
    await harness.settle()
    # A token for the cancelled sequence still in flight is dropped.
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)

    step = await harness.step()
    assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
    assert step.plan.starts == ()
    await harness.reply(step)
    await harness.assert_idle()

    received, ended = available(events)
    assert ended
    # Messages are taken between steps: the token in flight still went out; no final usage delta.
    assert received == [Delta(text="a", token_ids=(0,)), Delta(text="b", token_ids=(1,))]
    stats = await harness.stats()
    assert stats.num_running == 0
    assert stats.num_cancelled == 1
    assert stats.num_completed == 0
    assert stats.running_request_ids == ()
    assert drain(harness.warmer) == []
    assert not [event for event in drain(harness.metrics) if isinstance(event, RequestFinished)]


async def test_cancel_of_a_queued_request_closes_its_stream(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(max_batch_size=1)
    await harness.submit("r1")
    step = await harness.step()  # r1 admitted; r2 must wait for a slot
    events = await harness.submit("r2")
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()  # r2 was taken in between the steps, and waits
    assert step.plan.starts == ()
    await harness.inbox.send(CancelRequest(request_id="r2"))
    await harness.reply(step, sampled=(token(0, 1, "length"),), decode_batch_size=1)
    assert available(events) == ([], True)
    stats = await harness.stats()
    assert (stats.num_waiting, stats.num_cancelled) == (0, 1)
    await harness.assert_idle()


async def test_cancel_before_submit_is_honoured(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    await harness.inbox.send(CancelRequest(request_id="r1"))
    events = await harness.submit("r1")
    assert available(events) == ([], True)
    await harness.assert_idle()


async def test_departed_client_gets_its_sequence_removed(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", context=CONTEXT)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    events.close()  # the client went away
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)

    step = await harness.step()
    assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
    await harness.reply(step)
    await harness.assert_idle()
    stats = await harness.stats()
    assert (stats.num_running, stats.num_cancelled, stats.num_completed) == (0, 1, 0)


async def test_slow_client_with_a_full_buffer_is_dropped(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", buffer=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)  # buffer full: dropped
    step = await harness.step()
    assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
    await harness.reply(step)
    await harness.assert_idle()
    assert available(events) == ([Delta(text="a", token_ids=(0,))], True)
    assert (await harness.stats()).num_cancelled == 1


# --- decode steps planned ahead (steps_ahead=2) -----------------------------------


async def test_decode_steps_are_planned_while_one_runs(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(steps_ahead=2)
    events = await harness.submit("r1", (5, 6, 7), max_tokens=4)
    start = await harness.step()
    assert len(start.plan.starts) == 1
    # A start is planned alone: nothing more is offered until it reports.
    await harness.assert_idle()
    await harness.reply(start, sampled=(token(0, 0),), decode_batch_size=1)
    first = await harness.step()
    second = await harness.step()  # offered before the first reports
    assert first.plan.run_batch
    assert second.plan.run_batch
    assert first.plan.starts == second.plan.starts == ()
    await harness.assert_idle()  # at most two in flight
    await harness.reply(first, sampled=(token(0, 1),), decode_batch_size=1)
    third = await harness.step()
    await harness.reply(second, sampled=(token(0, 2),), decode_batch_size=1)
    # The core cannot know the device ends the sequence in the third step: a fourth goes ahead.
    fourth = await harness.step()
    await harness.reply(third, sampled=(token(0, 3, "length"),), decode_batch_size=1)
    await harness.reply(fourth)
    await harness.assert_idle()
    received, ended = available(events)
    assert ended
    assert text_of(received) == "abcd"


async def test_a_stop_string_found_a_step_late_is_never_sent(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(steps_ahead=2)
    events = await harness.submit("r1", stop=("b",), context=CONTEXT)
    start = await harness.step()
    await harness.reply(start, sampled=(token(0, 0),), decode_batch_size=1)
    first, second = await harness.step(), await harness.step()
    await harness.reply(first, sampled=(token(0, 1),), decode_batch_size=1)  # "b": the stop string
    # The step already in flight decoded one more token: it is dropped, and the removal follows.
    await harness.reply(second, sampled=(token(0, 2),), decode_batch_size=1)
    removal = await harness.step()
    assert removal.plan.removals == (Removal(sequence_id=0, donate=True),)
    await harness.reply(removal)
    await harness.assert_idle()
    received, ended = available(events)
    assert ended
    assert text_of(received) == "a"
    assert (await harness.stats()).num_completed == 1


async def test_an_arrival_that_starts_directly_is_planned_while_a_step_runs(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(steps_ahead=2)
    await harness.submit("r1", max_tokens=8)
    start = await harness.step()
    await harness.reply(start, sampled=(token(0, 0),), decode_batch_size=1)
    first, second = await harness.step(), await harness.step()
    late = await harness.submit("r2", (7, 8), max_tokens=2)
    await harness.reply(first, sampled=(token(0, 1),), decode_batch_size=1)
    # r2's start reads nothing the step in flight reports: it goes ahead of that step's result.
    joined = await harness.step()
    (admission,) = joined.plan.starts
    assert admission.prompt_tokens == (7, 8)
    assert joined.plan.run_batch
    await harness.reply(second, sampled=(token(0, 2),), decode_batch_size=1)
    ahead = await harness.step()
    assert ahead.plan.starts == ()
    await harness.reply(joined, sampled=(token(0, 3), token(1, 4)), decode_batch_size=1)
    await harness.step()  # planned ahead once ``joined`` reported
    await harness.reply(ahead, sampled=(token(0, 4), token(1, 5, "length")), decode_batch_size=2)
    received, ended = available(late)
    assert ended
    assert text_of(received) == "ef"


async def test_an_arrival_during_a_start_is_planned_before_the_start_reports(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(steps_ahead=2)
    first_events = await harness.submit("r1", max_tokens=2)
    start = await harness.step()
    await harness.assert_idle()  # the only step in flight: nothing else to plan
    late = await harness.submit("r2", (7, 8), max_tokens=1)
    # r2 is looked up and placed while r1's start runs, not after it reports.
    joined = await harness.step()
    (admission,) = joined.plan.starts
    assert admission.prompt_tokens == (7, 8)
    assert not joined.plan.run_batch  # the core does not know yet that r1 is in the batch
    await harness.assert_idle()  # two in flight
    await harness.reply(start, sampled=(token(0, 0),), decode_batch_size=0)
    decode = await harness.step()
    assert decode.plan.run_batch
    await harness.reply(joined, sampled=(token(1, 5, "length"),))
    ahead = await harness.step()  # decoding goes ahead once r2's start reported
    await harness.reply(decode, sampled=(token(0, 1, "length"),), decode_batch_size=1)
    await harness.reply(ahead)
    for events, text in ((first_events, "ab"), (late, "f")):
        received, ended = available(events)
        assert ended
        assert text_of(received) == text


async def test_a_chunked_arrival_is_started_once_every_step_has_reported(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(steps_ahead=2, prefill_step_size=4)
    await harness.submit("r1", max_tokens=8)
    start = await harness.step()
    await harness.reply(start, sampled=(token(0, 0),), decode_batch_size=1)
    first, second = await harness.step(), await harness.step()
    await harness.submit("r2", (7, 8, 9, 10, 11, 12), max_tokens=2)
    await harness.reply(first, sampled=(token(0, 1),), decode_batch_size=1)
    # r2 is longer than a chunk: it prefills in the batch, whose state the step in flight changes.
    await harness.assert_idle()
    await harness.reply(second, sampled=(token(0, 2),), decode_batch_size=1)
    joined = await harness.step()
    (admission,) = joined.plan.starts
    assert admission.prompt_tokens == (7, 8, 9, 10, 11, 12)
    assert not isinstance(admission, StartDirect)


async def test_departed_client_at_a_stop_string_is_only_cancelled(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", stop=("b",), context=CONTEXT)
    step = await harness.step()
    events.close()  # gone before the token that ends the reply
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)

    step = await harness.step()
    await harness.reply(step)
    await harness.assert_idle()
    assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
    stats = await harness.stats()
    assert (stats.num_cancelled, stats.num_completed) == (1, 0)
    assert drain(harness.warmer) == []


async def test_departed_client_at_a_natural_finish_is_not_donated(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    donations: list[DonateSequence] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixMissing(), [], donations)
        events = await harness.submit("r1", context=CONTEXT)
        step = await harness.step()
        events.close()
        await harness.reply(step, sampled=(token(0, 0, "length"),), decode_batch_size=1, detached=(
            DetachedSequence(sequence_id=0, tokens=(1, 2, 3, 0), payload="kv", nbytes=10),
        ))
        await harness.settle()
        nursery.cancel_scope.cancel()
    stats = await harness.stats()
    assert (stats.num_cancelled, stats.num_completed) == (1, 0)
    assert donations == []


async def test_cancel_during_cache_lookup_is_honoured(start_scheduler: StartScheduler) -> None:
    """A cancel that lands while the request's lookup is awaited applies before the step is planned:
    the request never reaches the device, its stream ends with no final delta, and it counts as cancelled."""
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    events = await harness.submit("r1", context=CONTEXT)
    with trio.fail_after(2):
        lookup = await harness.store.receive()  # the scheduler now awaits the reply
    assert isinstance(lookup, LookupPrefix)
    await harness.inbox.send(CancelRequest(request_id="r1"))
    await harness.settle()
    lookup.reply_to.send_nowait(PrefixMissing())
    await harness.settle()
    # The one step planned removes what was admitted; nothing starts.
    step = await harness.step()
    assert step.plan.starts == ()
    assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
    await harness.reply(step)
    await harness.assert_idle()
    assert available(events) == ([], True)
    stats = await harness.stats()
    assert (stats.num_cancelled, stats.num_completed) == (1, 0)
    assert stats.running_request_ids == ()
    assert drain(harness.store) == []  # no donation


async def test_a_request_submitted_during_the_lookups_of_an_idle_device_starts_in_the_same_step(
        start_scheduler: StartScheduler) -> None:
    """With the device idle, a request that arrives while the step's lookups are answered is looked up and
    started in that step: 20 of a wave of 64 arrived during the first step's lookups and waited it out."""
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    await harness.submit("r1", context=CONTEXT)
    with trio.fail_after(2):
        first = await harness.store.receive()  # the scheduler now awaits the reply
    assert isinstance(first, LookupPrefix)
    await harness.submit("r2", prompt=(4, 5, 6), context=CONTEXT)
    first.reply_to.send_nowait(PrefixMissing())
    with trio.fail_after(2):
        second = await harness.store.receive()
    assert isinstance(second, LookupPrefix)
    assert second.tokens == (4, 5, 6)
    second.reply_to.send_nowait(PrefixMissing())
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [0, 1]


# --- stop strings ------------------------------------------------------------------


async def test_stop_string_split_across_tokens_is_never_emitted(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", stop=("bc",), context=CONTEXT)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)  # "a"
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)  # "b": may start "bc", held
    received, _ = available(events)
    assert text_of(received) == "a"
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 2),), decode_batch_size=1)  # "c" completes "bc"

    step = await harness.step()
    assert step.plan.removals == (Removal(sequence_id=0, donate=True),)
    await harness.reply(step)
    await harness.assert_idle()
    more, ended = available(events)
    received += more
    assert ended
    assert text_of(received) == "a"
    assert not any("b" in event.text or "c" in event.text for event in received if isinstance(event, Delta))
    assert received[-1] == Delta(finish_reason="stop", usage=Usage(prompt_tokens=3, completion_tokens=3), stop_string="bc")
    # A dense family has no snapshot to warm: the warmer hears nothing.
    assert drain(harness.warmer) == []


async def test_held_text_that_is_not_a_stop_string_is_flushed(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    events = await harness.submit("r1", stop=("bc",))
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)  # "b" held
    assert available(events) == ([], False)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 3, "length"),), decode_batch_size=1)  # "d": "bd" is safe
    received, ended = available(events)
    assert ended
    assert text_of(received) == "bd"


@pytest.mark.parametrize(
    ("stop", "held", "new", "expected"),
    [
        (("bc",), "", "ab", ("a", "b", False)),
        (("bc",), "b", "c", ("", "", True)),
        (("bc",), "b", "d", ("bd", "", False)),
        (("xyz", "yz!"), "", "axy", ("a", "xy", False)),
        (("end",), "", "the end here", ("the ", "", True)),
        ((), "", "abc", ("abc", "", False)),
    ],
)
def test_stop_matcher(stop: tuple[str, ...], held: str, new: str, expected: tuple[str, str, bool]) -> None:
    assert StopMatcher(stop).feed(held, new) == expected


# --- backpressure ---------------------------------------------------------------------


async def test_full_queue_answers_server_busy(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(max_batch_size=1, max_queued_requests=1)
    await harness.submit("r1")
    step = await harness.step()  # r1 runs; its step is held open
    await harness.submit("r2")  # waits for the slot
    events = await harness.submit("r3")
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)  # both are taken in now
    received, ended = available(events)
    assert ended
    (failed,) = received
    assert isinstance(failed, RequestFailed)
    assert isinstance(failed.error, ServerBusy)
    assert failed.error.status == 503
    assert failed.error.code == "server_busy"
    # r2 still waits, and runs once r1's slot frees.
    step = await harness.step()
    assert step.plan.starts == ()
    await harness.reply(step, sampled=(token(0, 1, "length"),), decode_batch_size=1)
    step = await harness.step()
    assert [start.sequence_id for start in step.plan.starts] == [1]


async def test_waiting_request_is_admitted_when_a_slot_frees(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(max_batch_size=1)
    await harness.submit("r1")
    step = await harness.step()
    events = await harness.submit("r2")
    await harness.reply(step, sampled=(token(0, 0, "length"),), decode_batch_size=1)
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [1]
    await harness.reply(step, sampled=(token(1, 4, "length"),), decode_batch_size=1)
    received, ended = available(events)
    assert ended
    assert text_of(received) == "e"


# --- the prompt cache ---------------------------------------------------------------


async def test_prefix_hit_splits_admission_and_usage(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    payload = FakePayload()
    lookups: list[LookupPrefix] = []
    prompt = tuple(range(10, 20))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixFound(
            matched_len=6, payload=payload, cross_session=False, partial=False,
        ), lookups, [])
        events = await harness.submit("r1", prompt, context=CONTEXT)
        step = await harness.step()
        nursery.cancel_scope.cancel()

    (lookup,) = lookups
    assert lookup.context == CONTEXT
    assert lookup.tokens == prompt
    assert lookup.max_len == len(prompt) - 1  # at least one token is always prefilled
    assert payload.asked == [6]
    (admission,) = step.plan.starts
    assert admission.cached_tokens == prompt[:6]
    assert admission.prompt_tokens == prompt[6:]
    assert admission.adopted is payload
    assert admission.donate_on_finish is True
    await harness.reply(step, sampled=(token(0, 0, "length"),), decode_batch_size=1)
    received, ended = available(events)
    assert ended
    assert received[-1].usage == Usage(prompt_tokens=10, completion_tokens=1, cached_tokens=6)
    (finished,) = drain(harness.metrics)
    assert finished.cached_tokens == 6


async def test_unadoptable_payload_falls_back_to_cold_prefill(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    prompt = tuple(range(10))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixFound(
            matched_len=6, payload=FakePayload(adoptable=False), cross_session=True, partial=True,
        ), [], [])
        events = await harness.submit("r1", prompt, context=CONTEXT)
        step = await harness.step()
        nursery.cancel_scope.cancel()
    (admission,) = step.plan.starts
    assert (admission.cached_tokens, admission.prompt_tokens, admission.adopted) == ((), prompt, None)
    await harness.reply(step, sampled=(token(0, 0, "length"),), decode_batch_size=1)
    received, _ = available(events)
    assert received[-1].usage == Usage(prompt_tokens=10, completion_tokens=1, cached_tokens=0)


async def test_no_lookup_without_a_cache_context(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    await harness.submit("r1", tuple(range(10)))
    step = await harness.step()
    assert step.plan.starts[0].donate_on_finish is False
    assert drain(harness.store) == []


async def test_natural_finish_donates_the_detached_sequence(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    donations: list[DonateSequence] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixMissing(), [], donations)
        await harness.submit("r1", (1, 2, 3), context=CONTEXT)
        step = await harness.step()
        assert step.plan.starts[0].donate_on_finish is True
        await harness.reply(step, sampled=(token(0, 4, "length"),), decode_batch_size=1, detached=(
            DetachedSequence(sequence_id=0, tokens=(1, 2, 3, 4), payload="kv-0", nbytes=123),
        ))
        await harness.assert_idle()
        nursery.cancel_scope.cancel()
    assert donations == [DonateSequence(context=CONTEXT, tokens=(1, 2, 3, 4), payload="kv-0", nbytes=123, prompt_len=3)]


async def test_stop_string_finish_donates_what_the_removal_detaches(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    donations: list[DonateSequence] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixMissing(), [], donations)
        await harness.submit("r1", (1, 2, 3), stop=("b",), context=CONTEXT)
        step = await harness.step()
        await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)
        step = await harness.step()
        assert step.plan.removals == (Removal(sequence_id=0, donate=True),)
        await harness.reply(step, detached=(DetachedSequence(sequence_id=0, tokens=(1, 2, 3, 1), payload="kv", nbytes=7),))
        await harness.assert_idle()
        nursery.cancel_scope.cancel()
    assert [donation.payload for donation in donations] == ["kv"]


async def test_cancelled_request_never_donates(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler(with_store=True)
    assert harness.store is not None
    donations: list[DonateSequence] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixMissing(), [], donations)
        await harness.submit("r1", (1, 2, 3), context=CONTEXT)
        step = await harness.step()
        await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
        step = await harness.step()
        await harness.inbox.send(CancelRequest(request_id="r1"))
        await harness.settle()
        await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1)
        step = await harness.step()
        assert step.plan.removals == (Removal(sequence_id=0, donate=False),)
        # Even a device that detached it anyway gets no donation out of it.
        await harness.reply(step, detached=(DetachedSequence(sequence_id=0, tokens=(1, 2, 3, 0), payload="kv", nbytes=7),))
        await harness.assert_idle()
        nursery.cancel_scope.cancel()
    assert donations == []


# --- device failures ------------------------------------------------------------------


async def test_failed_step_fails_its_requests_and_serving_continues(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    first = await harness.submit("r1")
    step = await harness.step()
    second = await harness.submit("r2")  # admitted in the next step
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [1]
    await harness.reply(step, error="RuntimeError: injected", failed_sequences=(0, 1))
    await harness.assert_idle()

    for events in (first, second):
        received, ended = available(events)
        assert ended
        failed = received[-1]
        assert isinstance(failed, RequestFailed)
        assert failed.error.status == 500
        assert failed.error.code == "generation_failed"
        assert failed.error.error_type == "server_error"
        assert "injected" in failed.error.message
    stats = await harness.stats()
    assert (stats.num_failed, stats.num_running, stats.num_cancelled) == (2, 0, 0)

    events = await harness.submit("r3")
    step = await harness.step()
    assert step.plan.removals == ()  # the device already dropped the failed sequences
    (admission,) = step.plan.starts
    await harness.reply(step, sampled=(token(admission.sequence_id, 0, "length"),), decode_batch_size=1)
    received, ended = available(events)
    assert ended
    assert received[-1].finish_reason == "length"
    assert (await harness.stats()).num_completed == 1


# --- statistics -------------------------------------------------------------------------


async def test_decode_batch_sizes_are_reported(start_scheduler: StartScheduler) -> None:
    harness = await start_scheduler()
    await harness.submit("r1")
    step = await harness.step()
    await harness.reply(step, prefill_tokens=3, prefilling=(0,))  # a prefill-only step
    step = await harness.step()
    await harness.submit("r2")  # arrives while step 2 is in flight
    await harness.reply(step, sampled=(token(0, 0),), decode_batch_size=1)
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [1]
    # r1 decodes while r2 prefills: an interleaved step.
    await harness.reply(step, sampled=(token(0, 1),), decode_batch_size=1, prefilling=(1,))
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 2), token(1, 3)), decode_batch_size=2)
    step = await harness.step()
    await harness.reply(step, sampled=(token(0, 4, "length"), token(1, 5)), decode_batch_size=2)
    step = await harness.step()
    await harness.reply(step, sampled=(token(1, 6, "length"),), decode_batch_size=1)
    await harness.assert_idle()

    stats = await harness.stats()
    assert stats.decode_batch_sizes == {1: 3, 2: 2}
    assert stats.max_decode_batch_size == 2
    assert stats.num_interleaved_steps == 1
    assert stats.num_steps == 6
    assert stats.num_completed == 2
    assert harness.actor.statistics() == stats


async def test_requests_queued_behind_the_first_join_its_step(
    start_scheduler: StartScheduler, autojump_clock: trio.testing.MockClock,
) -> None:
    harness = await start_scheduler()
    await harness.submit("r1", more_pending=True)
    # The device is idle, but the router said more is coming: no step within the window.
    with trio.move_on_after(ARRIVAL_WINDOW_SECONDS * 0.9):
        await harness.device.receive()
        raise AssertionError("the scheduler did not wait for the queued arrivals")
    await harness.submit("r2", more_pending=False)
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [0, 1]


async def test_the_arrival_window_is_bounded(
    start_scheduler: StartScheduler, autojump_clock: trio.testing.MockClock,
) -> None:
    harness = await start_scheduler()
    submitted_at = trio.current_time()
    await harness.submit("r1", more_pending=True)  # the promised request never comes
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [0]
    # The clock moves only when every task waits: the step came when the window closed, not later.
    assert trio.current_time() - submitted_at == pytest.approx(ARRIVAL_WINDOW_SECONDS)


async def test_the_arrival_window_closes_once_the_arrivals_fill_the_batch(
    start_scheduler: StartScheduler, autojump_clock: trio.testing.MockClock,
) -> None:
    harness = await start_scheduler(max_batch_size=2)
    submitted_at = trio.current_time()
    await harness.submit("r1", more_pending=True)
    await harness.submit("r2", more_pending=True)  # more behind, but no row for them in this step
    step = await harness.step()
    assert [admission.sequence_id for admission in step.plan.starts] == [0, 1]
    assert trio.current_time() - submitted_at < ARRIVAL_WINDOW_SECONDS / 10


async def test_a_one_chunk_prompt_donates_its_prompt_kv_only_to_requests_parked_on_it(
    start_scheduler: StartScheduler,
) -> None:
    """Such a prompt is done within its admitting step; its final KV comes a few tokens later."""
    harness = await start_scheduler(
        with_store=True, prefill_step_size=64,
        # The plan of a plain KV model with the default cache settings.
        actor_options={"cache": CachePlan(mode=CacheMode.PREFIX, prompt_donation=True, cross_session=True,
                                          share_threshold=32)},
    )
    assert harness.store is not None
    short, long = tuple(range(100, 140)), tuple(range(200, 300))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer_lookups, harness.store, lambda _: PrefixMissing(), [], [])
        await harness.submit("short", short, context=CONTEXT, more_pending=True)
        await harness.submit("long", long, context=CONTEXT)
        step = await harness.step()
        assert [(a.sequence_id, a.donate_prompt) for a in step.plan.starts] == [(0, False), (1, True)]
        await harness.reply(step, sampled=(token(0, 0, "length"),), prefilling=(1,))
        await harness.reply(await harness.step(), prompts_done=(1,), sampled=(token(1, 0, "length"),))
        await harness.assert_idle()

        # A request that shares 40 tokens with a one-chunk prompt admitted with it parks on it.
        await harness.submit("leader", short + (1, 2), context=CONTEXT, more_pending=True)
        await harness.submit("follower", short + (3, 4), context=CONTEXT)
        step = await harness.step()
        (leader,) = step.plan.starts  # the follower parked on it
        assert leader.donate_prompt is True
        await harness.reply(step, prompts_done=(leader.sequence_id,), sampled=(token(leader.sequence_id, 0),))
        # Released when the leader's prompt is done: its lookup comes after the donation.
        step = await harness.step()
        assert [start.sequence_id for start in step.plan.starts] == [3]
        await harness.reply(step, sampled=(token(2, 0, "length"), token(3, 0, "length")))
        assert (await harness.stats()).num_shared_prefills == 1
        nursery.cancel_scope.cancel()


def test_a_plan_with_a_prompt_cache_needs_a_cache_store_to_ask() -> None:
    to_device, _device = trio.open_memory_channel[RunStep](0)
    _send, inbox = trio.open_memory_channel[Any](1)
    with pytest.raises(ValueError, match="a prefix cache plan needs a cache store"):
        SchedulerActor(config=SchedulerConfig(), capabilities=Capabilities(prefill_step_size=64, context_size=4096),
                       inbox=inbox, to_device=to_device, to_cache_store=None, to_metrics=None, to_warmer=None,
                       tokenizer=FakeTokenizer(), eos_token_ids=frozenset({EOS}),
                       cache=CachePlan(mode=CacheMode.PREFIX))


async def test_disk_writes_ride_a_plan_and_are_handed_to_the_device_when_the_scheduler_stops() -> None:
    from mlxcel.actors.messages import WriteToDisk
    from mlxcel.core.plan import DiskWrite

    inbox_send, inbox = trio.open_memory_channel[Any](64)
    to_device, device = trio.open_memory_channel[RunStep](8)
    actor = SchedulerActor(config=SchedulerConfig(steps_ahead=1),
                           capabilities=Capabilities(prefill_step_size=64, context_size=4096),
                           inbox=inbox, to_device=to_device, to_cache_store=None, to_metrics=None, to_warmer=None,
                           tokenizer=FakeTokenizer(), eos_token_ids=frozenset({EOS}))
    first, second = DiskWrite(payload="kv-1", pieces=("a",)), DiskWrite(payload="kv-2", pieces=("b",))
    async with trio.open_nursery() as nursery:
        await nursery.start(actor.run)
        inbox_send.send_nowait(WriteToDisk(writes=(first,)))
        step = await device.receive()  # idle: a plan of the writes alone
        assert step.plan.only_writes
        assert step.plan.disk_writes == (first,)
        # That step is not answered yet when another write comes in and the engine stops.
        inbox_send.send_nowait(WriteToDisk(writes=(second,)))
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    handed = device.receive_nowait()
    assert handed.plan.only_writes
    assert handed.plan.disk_writes == (second,)
