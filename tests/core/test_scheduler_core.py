"""The scheduling policy alone: SchedulerCore with no model, no Trio, no device.

A small simulated device carries plans out (a batch that prefills a chunk
per step and then decodes, direct starts that give their first token at
once), so each test reads as: these requests arrive, these plans come out.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from mlxcel.cache.key import CacheContext
from mlxcel.core import placement
from mlxcel.core.cache_plan import CacheMode, CachePlan
from mlxcel.core.effects import DonateSequence, RequestFinished
from mlxcel.core.plan import (
    Capabilities,
    DetachedSequence,
    InsertBatch,
    Removal,
    SampledToken,
    SnapshotPoint,
    StartAlone,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.core.scheduler import MAX_BATCH_HOLDS, Hit, Miss, NewRequest, SchedulerCore, WarmSession
from mlxcel.errors import MlxcelError
from mlxcel.types import Delta, SamplingParams
from tests.support import LetterTokenizer

GREEDY = SamplingParams(temperature=0.0)
CONTEXT = CacheContext(model_id="m", template_sig="sig", session_key="s")


class Clients:
    def __init__(self) -> None:
        self.deltas: dict[str, list[Delta]] = {}
        self.failed: dict[str, MlxcelError] = {}
        self.closed: list[str] = []

    def send(self, request_id: str, delta: Delta) -> bool:
        self.deltas.setdefault(request_id, []).append(delta)
        return True

    def fail(self, request_id: str, error: MlxcelError) -> None:
        self.failed[request_id] = error

    def close(self, request_id: str) -> None:
        self.closed.append(request_id)


@attrs.define
class _Simulated:
    prefill_left: int
    tokens_left: int
    awaiting_first: bool = False
    # A warm-up: its prefill ends with its snapshot, and it stops there.
    warm: bool = False


class SimulatedDevice:
    """Carries out plans the way the real device does, with counts instead of arrays."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.batch: dict[int, _Simulated] = {}
        self.steps = 0

    def run(self, plan: StepPlan) -> StepResult:
        self.steps += 1
        sampled, prompts_done, prefilling, prefill_tokens, warmed = [], [], [], 0, []
        for removal in plan.removals:
            self.batch.pop(removal.sequence_id, None)
        for start in plan.starts:
            if isinstance(start, InsertBatch):
                self.batch[start.sequence_id] = _Simulated(prefill_left=len(start.prompt_tokens),
                                                           tokens_left=start.max_tokens, warm=start.warm)
        if plan.alone_chunk is not None:
            prefill_tokens += plan.alone_chunk.end - plan.alone_chunk.start
            if plan.alone_rest is None:
                prefilling.append(plan.alone_chunk.sequence_id)
        decode_batch = 0
        if plan.run_batch:
            for sequence_id, sequence in list(self.batch.items()):
                if sequence.prefill_left == 0:
                    decode_batch += 1
                    sequence.awaiting_first = False
                    sequence.tokens_left -= 1
                    finish = "length" if sequence.tokens_left == 0 else None
                    sampled.append(SampledToken(sequence_id=sequence_id, token=1, logprob=-1.0, finish_reason=finish))
                    if finish:
                        del self.batch[sequence_id]
            for sequence_id, sequence in self.batch.items():
                if sequence.prefill_left:
                    ran = min(self.step, sequence.prefill_left)
                    sequence.prefill_left -= ran
                    prefill_tokens += ran
                    if sequence.prefill_left == 0 and sequence.warm:
                        warmed.append(sequence_id)  # snapshotted; the real device drops it here
                        del self.batch[sequence_id]
                    else:
                        (prompts_done if sequence.prefill_left == 0 else prefilling).append(sequence_id)
                    break  # one prompt's chunk per step
        for start in plan.direct_starts:
            prefill_tokens += len(start.prompt_tokens)
            prompts_done.append(start.sequence_id)
            finish = "length" if start.max_tokens <= 1 else None
            sampled.append(SampledToken(sequence_id=start.sequence_id, token=0, logprob=-1.0, finish_reason=finish))
            if finish is None:
                self.batch[start.sequence_id] = _Simulated(prefill_left=0, tokens_left=start.max_tokens - 1)
        return StepResult(step_number=self.steps, sampled=tuple(sampled), prompts_done=tuple(prompts_done),
                          prefilling=tuple(prefilling), prefill_tokens=prefill_tokens, decode_batch_size=decode_batch,
                          warmed=tuple(warmed))


class Harness:
    def __init__(self, *, snapshots: bool = False, **capabilities: Any) -> None:
        capabilities.setdefault("prefill_step_size", 16)
        capabilities.setdefault("context_size", 4096)
        cache = CachePlan(mode=CacheMode.SNAPSHOTS if snapshots else CacheMode.PREFIX)
        self.core = SchedulerCore(Capabilities(**capabilities), tokenizer=LetterTokenizer(),
                                  eos_token_ids=frozenset({999}), cache=cache)
        self.device = SimulatedDevice(capabilities["prefill_step_size"])
        self.clients = Clients()
        self.plans: list[StepPlan] = []
        self.found: dict[str, Hit] = {}

    def add(self, request_id: str, length: int, max_tokens: int = 4, *, first: int = 0,
            context: CacheContext | None = None, retain_seconds: float = 0.0) -> None:
        prompt = tuple(range(first, first + length))
        self.core.add(NewRequest(request_id=request_id, prompt_tokens=prompt, sampling=GREEDY,
                                 max_tokens=max_tokens, cache_context=context, retain_seconds=retain_seconds),
                      self.clients)

    def step(self) -> StepPlan:
        while (lookup := self.core.next_lookup(0.0)) is not None:
            self.core.resolve(lookup, self.found.pop(lookup.tokens.__repr__(), Miss()))
        plan = self.core.schedule()
        self.plans.append(plan)
        self.core.update(plan, self.device.run(plan), self.clients, 0.0)
        return plan

    def run_until_idle(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.core.has_work():
                return
            self.step()
        raise AssertionError("still busy")


def started(plan: StepPlan) -> list[int]:
    """Sequences whose first token this plan's direct starts give."""
    return [start.sequence_id for start in plan.direct_starts]


def test_short_prompts_start_directly_a_chunk_of_tokens_per_step() -> None:
    harness = Harness()
    harness.add("r0", 8, max_tokens=40)
    harness.step()
    for index in (1, 2, 3):
        harness.add(f"r{index}", 10)
    # 10 + 10 tokens would pass the 16-token chunk: one start per step; the others wait.
    plans = [harness.step() for _ in range(3)]
    assert [started(plan) for plan in plans] == [[1], [2], [3]]
    assert all(isinstance(start, StartDirect) for plan in plans for start in plan.starts)
    harness.run_until_idle()
    assert {request_id: len(deltas) for request_id, deltas in harness.clients.deltas.items()} == {
        "r0": 41, "r1": 5, "r2": 5, "r3": 5}  # every token, then the final delta


def test_waiting_starts_hold_decoding_back_for_a_bounded_number_of_steps() -> None:
    harness = Harness()
    harness.add("decoding", 8, max_tokens=60)
    harness.step()
    for index in range(1, 8):
        harness.add(f"burst{index}", 10, max_tokens=2)
    plans = [harness.step() for _ in range(MAX_BATCH_HOLDS + 1)]
    assert [started(plan) for plan in plans] == [[1], [2], [3], [4], [5]]
    # MAX_BATCH_HOLDS steps in a row held the decoding sequence back; the next decodes although starts wait.
    assert [plan.run_batch for plan in plans] == [False] * MAX_BATCH_HOLDS + [True]


def test_a_first_token_the_batch_owes_is_never_held_back() -> None:
    harness = Harness()
    harness.add("long", 40)  # more than a chunk: prefilled in the batch
    (insert,) = harness.step().starts
    assert isinstance(insert, InsertBatch)
    while harness.device.batch[0].prefill_left:
        harness.step()
    for index in range(1, 6):
        harness.add(f"burst{index}", 10, max_tokens=2)
    plan = harness.step()
    # One start (a 16-token budget), the rest wait, and the batch runs for the long prompt's first token.
    assert started(plan) == [1]
    assert plan.run_batch
    assert started(plan := harness.step()) == [2]
    assert not plan.run_batch


def test_a_hit_in_bucketed_shapes_cuts_the_prefix_and_pads_its_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(placement, "START_PREFIX_ALIGN", 8)
    monkeypatch.setattr(placement, "START_QUERY_BUCKET", 32)

    def start_of_a_hit(bucket: bool, context_size: int = 4096) -> StartDirect:
        harness = Harness(bucket_starts=bucket, context_size=context_size)
        harness.found[repr(tuple(range(40)))] = Hit(length=30, payload=_Payload(length=40))
        harness.add("hit", 40, context=CONTEXT)
        (start,) = harness.step().starts
        assert isinstance(start, StartDirect)
        return start

    plain, bucketed = start_of_a_hit(False), start_of_a_hit(True)
    assert (plain.kept, plain.padding, len(plain.prompt_tokens)) == (30, 0, 10)
    # 30 cached tokens cut to 24; the 6 cut and 10 new tokens run, padded to 32.
    assert (bucketed.kept, bucketed.padding, len(bucketed.cached_tokens)) == (24, 16, 30)
    assert bucketed.adopted is not None
    # No padding where it would run past the context.
    assert start_of_a_hit(True, context_size=50).padding == 0


def test_a_long_prompt_in_bucketed_shapes_is_prefilled_alone_then_starts_its_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(placement, "START_PREFIX_ALIGN", 8)
    harness = Harness(bucket_starts=True)
    harness.add("long", 45)
    plans = [harness.step() for _ in range(3)]
    assert isinstance(plans[0].starts[0], StartAlone)
    # Chunks end on multiples of the chunk size, the last on an align multiple (40 of 45 tokens) ...
    assert [(plan.alone_chunk.start, plan.alone_chunk.end, plan.alone_chunk.last) for plan in plans
            if plan.alone_chunk] == [(0, 16, False), (16, 32, False), (32, 40, True)]
    # ... and the last 5 tokens start directly in the step of the last chunk, from its KV.
    rest = plans[2].alone_rest
    assert rest is not None
    assert rest.from_alone
    assert (rest.kept, len(rest.prompt_tokens)) == (40, 5)
    assert harness.clients.deltas["long"][0].text  # its first token came in that step

    # A last chunk in a step whose starts already took the budget: its rest starts in the next step.
    harness = Harness(bucket_starts=True)
    harness.add("long", 45)
    harness.step()
    harness.step()
    harness.add("short", 16)
    third = harness.step()
    assert third.alone_chunk is not None
    assert third.alone_chunk.last
    assert third.alone_rest is None
    assert started(third) == [1]
    assert started(harness.step()) == [0]


def test_bucketed_direct_starts_are_charged_for_their_own_forward_pass() -> None:
    """On CUDA a forward pass costs beyond its tokens: hits that keep the same prefix length share one pass
    on the device (charged once), hits that keep other lengths each pay for their own."""
    def per_step(bucket: bool, kept: Callable[[int], int]) -> list[list[int]]:
        harness = Harness(bucket_starts=bucket, prefill_step_size=1024)
        for index in range(6):
            length = kept(index) + 100
            prompt = tuple(range(1000 * index, 1000 * index + length))
            harness.found[repr(prompt)] = Hit(length=kept(index), payload=_Payload(length=length))
            harness.add(f"r{index}", length, first=1000 * index, context=CONTEXT)
        return [started(harness.step()) for _ in range(3)]

    assert placement.DIRECT_START_TOKENS == 256
    assert per_step(False, lambda index: 256) == [[0, 1, 2, 3, 4, 5], [], []]
    # One pass of 256 plus 100 new tokens each: all six fit, and the pass runs four rows (a power of two).
    assert per_step(True, lambda index: 256) == [[0, 1, 2, 3], [4, 5], []]
    # Two passes (256 and 384 kept): 2 x 256 + 100 each, and the sixth is over the 1024-token step; the
    # 256-kept pass (0, 2, 4) runs two rows.
    assert per_step(True, lambda index: 256 + 128 * (index % 2)) == [[0, 1, 2, 3], [4, 5], []]


def test_a_steps_hits_keep_at_most_the_devices_kept_bound_of_stored_prefix() -> None:
    """Each hit's stored prefix is copied twice on its way into the batch: a step's hits keep at most
    Capabilities.hit_kept_tokens of it in all (the first always goes)."""
    harness = Harness(bucket_starts=True, prefill_step_size=4096, hit_kept_tokens=600)
    for index in range(5):
        prompt = tuple(range(1000 * index, 1000 * index + 356))
        harness.found[repr(prompt)] = Hit(length=256, payload=_Payload(length=356))
        harness.add(f"r{index}", 356, first=1000 * index, context=CONTEXT)
    assert [started(harness.step()) for _ in range(3)] == [[0, 1], [2, 3], [4]]


def test_cold_direct_starts_share_one_charged_pass() -> None:
    """Starts from nothing stored run in one forward pass on the device: the pass is charged once."""
    harness = Harness(bucket_starts=True, prefill_step_size=700)
    for index in range(8):
        harness.add(f"r{index}", 100, first=1000 * index)
    # 256 for the pass, then 100 tokens each: four fit the 700-token step, the others wait.
    assert [started(harness.step()) for _ in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_shared_pass_runs_a_power_of_two_rows_and_the_rest_next() -> None:
    """The device pads a bucketed pass's rows to a power of two: the rest of a wave waits a step instead of
    running as padding (placement.Placement.rows_now), the earliest arrivals first."""
    def per_step(bucket: bool, count: int) -> list[list[int]]:
        harness = Harness(bucket_starts=bucket, prefill_step_size=4096)
        for index in range(count):
            harness.add(f"r{index}", 40, first=1000 * index)
        return [started(harness.step()) for _ in range(4)]

    assert per_step(False, 7) == [[0, 1, 2, 3, 4, 5, 6], [], [], []]
    assert per_step(True, 7) == [[0, 1, 2, 3], [4, 5], [6], []]
    assert per_step(True, 8) == [[0, 1, 2, 3, 4, 5, 6, 7], [], [], []]
    # Waiting rows go ahead of a later arrival that joins them in the next pass.
    harness = Harness(bucket_starts=True, prefill_step_size=4096)
    for index in range(6):
        harness.add(f"r{index}", 40, first=1000 * index)
    assert started(harness.step()) == [0, 1, 2, 3]
    harness.add("late", 40, first=9000)
    assert started(harness.step()) == [4, 5]
    assert started(harness.step()) == [6]


def test_the_rest_of_a_shared_pass_is_planned_before_the_pass_in_flight_reports() -> None:
    """Starts that share a pass read nothing the device reports: the next pass goes to the device while the
    one before runs (no host round trip between a wave's passes). A start that needs the device's report
    (here a prompt longer than a chunk, which prefills in the batch) waits for it."""
    harness = Harness(bucket_starts=True, prefill_step_size=4096)
    for index in range(7):
        harness.add(f"r{index}", 40, first=1000 * index)
    assert harness.core.next_lookup(0.0) is None
    first = harness.core.schedule()
    assert started(first) == [0, 1, 2, 3]
    assert harness.core.can_plan_ahead()
    assert harness.core.next_lookup(0.0) is None
    second = harness.core.schedule()
    assert started(second) == [4, 5]
    assert not second.run_batch  # the first pass's rows wait for the rest (the batch hold)
    for plan in (first, second):
        harness.core.update(plan, harness.device.run(plan), harness.clients, 0.0)
    assert started(harness.step()) == [6]

    harness = Harness(bucket_starts=True, prefill_step_size=64)
    harness.add("decoding", 8, max_tokens=60)
    harness.step()
    assert harness.core.can_plan_ahead()  # only decoding
    harness.add("long", 100, first=500)
    assert harness.core.next_lookup(0.0) is None
    assert not harness.core.can_plan_ahead()


def test_a_start_removed_before_it_ran_never_reaches_the_device() -> None:
    harness = Harness()
    harness.add("r0", 10)
    harness.add("r1", 10)
    assert started(harness.step()) == [0]  # r1 waits for the next step's budget
    harness.core.abort("r1", harness.clients, 0.0)
    plan = harness.step()
    assert started(plan) == []
    assert [removal.sequence_id for removal in plan.removals] == [1]
    assert "r1" in harness.clients.closed
    assert "r1" not in harness.clients.deltas
    assert harness.core.statistics().num_cancelled == 1


def test_a_failed_step_fails_the_starts_waiting_on_it() -> None:
    harness = Harness()
    harness.add("r0", 10)
    harness.add("r1", 10)
    assert harness.core.next_lookup(0.0) is None
    plan = harness.core.schedule()
    assert started(plan) == [0]
    harness.core.update(plan, StepResult(step_number=1, error="boom", failed_sequences=(0,)), harness.clients, 0.0)
    assert set(harness.clients.failed) == {"r0", "r1"}
    assert harness.clients.failed["r0"].status == 500
    assert not harness.core.has_work()


def test_warm_ups_run_only_while_idle_and_give_way_to_requests() -> None:
    harness = Harness(snapshots=True)
    harness.core.warm(WarmSession(context=CONTEXT, tokens=tuple(range(30))))
    plan = harness.step()
    (warm,) = plan.starts
    assert isinstance(warm, InsertBatch)
    assert warm.warm
    assert warm.snapshots == (SnapshotPoint(after=30),)
    harness.add("foreground", 10)
    plan = harness.step()
    # The warm-up is dropped at once, storing nothing; the request starts.
    assert [removal.sequence_id for removal in plan.removals] == [0]
    assert started(plan) == [1]
    stats = harness.core.statistics()
    assert (stats.num_warm_started, stats.num_warm_preempted, stats.num_warm_steps_with_foreground) == (1, 1, 0)
    # Once the device is idle again, the dropped warm-up runs from the start and completes.
    harness.run_until_idle()
    rerun = [start for plan in harness.plans for start in plan.starts if getattr(start, "warm", False)]
    assert [start.sequence_id for start in rerun] == [0, 2]
    assert rerun[1].prompt_tokens == tuple(range(30))
    stats = harness.core.statistics()
    assert (stats.num_warm_started, stats.num_warm_preempted, stats.num_warm_completed) == (2, 1, 1)


def test_a_warm_up_whose_tokens_are_stored_already_ends_counted_without_running() -> None:
    harness = Harness(snapshots=True)
    tokens = tuple(range(30))
    harness.found[repr(tokens)] = Hit(length=30, payload=_Payload(length=30))
    harness.core.warm(WarmSession(context=CONTEXT, tokens=tokens))
    plan = harness.step()
    assert plan.starts == ()
    stats = harness.core.statistics()
    assert (stats.num_warm_started, stats.num_warm_completed, stats.num_warm_covered) == (0, 0, 1)
    assert not harness.core.has_work()


def test_the_next_turn_of_a_conversation_being_warmed_waits_for_its_warm_up() -> None:
    """The warm-up computes the prefix that turn resumes from: preempting it would prefill it again."""
    harness = Harness(snapshots=True)
    harness.core.warm(WarmSession(context=CONTEXT, tokens=tuple(range(30))))
    harness.step()
    harness.add("next-turn", 40, context=CONTEXT)  # the warmed 30 tokens, then the new message
    plans = []
    while not any(start.sequence_id == 1 for plan in plans for start in plan.starts):
        plans.append(harness.step())
        assert len(plans) < 10
    assert all(not plan.removals for plan in plans)  # never preempted
    stats = harness.core.statistics()
    assert (stats.num_warm_started, stats.num_warm_preempted, stats.num_warm_completed) == (1, 0, 1)
    harness.run_until_idle()
    # Another conversation's request still preempts a warm-up at once.
    harness.core.warm(WarmSession(context=CONTEXT, tokens=tuple(range(90))))
    harness.step()
    harness.add("other", 10, first=500, context=attrs.evolve(CONTEXT, session_key="other"))
    plan = harness.step()
    assert [removal.sequence_id for removal in plan.removals] == [2]
    assert harness.core.statistics().num_warm_preempted == 1


class _GoneAfterFirstToken(Clients):
    """A client of ``request_id`` that disconnects as its first streamed token arrives."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id

    def send(self, request_id: str, delta: Delta) -> bool:
        return request_id != self.request_id and super().send(request_id, delta)


@pytest.mark.parametrize("length", [10, 40])  # a direct start, and a prompt prefilled in the batch
def test_a_retaining_request_donates_its_prompt_at_the_end_of_prefill(length: int) -> None:
    harness = Harness()
    harness.add("plain", 10, context=CONTEXT, first=500)
    harness.step()
    harness.add("kept", length, context=CONTEXT, retain_seconds=3600)
    while not (starts := harness.step().starts):
        pass
    (start,) = starts
    # A one-chunk prompt skips the early donation unless it retains (a long one always donates).
    assert harness.plans[0].starts[0].donate_prompt is False
    assert start.donate_prompt is True
    # The client leaves at its first token; the device detached the prompt in the same step.
    harness.core.take_effects()
    while harness.device.batch.get(start.sequence_id, _Simulated(0, 0)).prefill_left:
        harness.step()
    plan = harness.core.schedule() if harness.core.next_lookup(0.0) is None else None
    assert plan is not None
    prompt = tuple(range(length))
    result = StepResult(
        step_number=99,
        sampled=(SampledToken(sequence_id=start.sequence_id, token=7, logprob=-1.0),),
        detached=(DetachedSequence(sequence_id=start.sequence_id, tokens=prompt, payload="kv", nbytes=64,
                                   final=False),),
        prompts_done=(start.sequence_id,),
    )
    harness.core.update(plan, result, _GoneAfterFirstToken("kept"), 0.0)
    donations = [effect for effect in harness.core.take_effects() if isinstance(effect, DonateSequence)]
    assert donations == [DonateSequence(context=CONTEXT, tokens=prompt, payload="kv", nbytes=64,
                                        prompt_len=length, retain_seconds=3600)]
    assert harness.core.statistics().num_cancelled == 1
    # Cancelled: no final donation is asked of the device.
    assert harness.core.schedule().removals[-1].donate is False


def test_a_lookup_waits_for_the_kv_of_a_reply_ended_in_its_context() -> None:
    """A stop string ends a reply while the device holds it: its KV comes back with the step that removes it.
    A lookup in that context meanwhile would miss the conversation's last turn, so it waits for that step,
    and only for it: a removal that gives no KV ends the wait too."""
    for gives_kv in (True, False):
        harness = Harness()
        harness.core.add(NewRequest(request_id="r0", prompt_tokens=tuple(range(10)),
                                    sampling=SamplingParams(temperature=0.0, stop=("b",)), max_tokens=8,
                                    cache_context=CONTEXT), harness.clients)
        harness.step()  # its first token, "a"
        harness.step()  # "b": the stop string, found on the host
        harness.add("next", 12, context=CONTEXT)
        assert harness.core.next_lookup(0.0) is None  # waiting for r0's KV
        plan = harness.core.schedule()
        assert plan.removals == (Removal(sequence_id=0, donate=True),)
        final = DetachedSequence(sequence_id=0, tokens=tuple(range(10)) + (0, 1), payload="kv", nbytes=64)
        result = harness.device.run(plan)
        harness.core.update(plan, attrs.evolve(result, detached=(final,) if gives_kv else ()), harness.clients, 0.0)
        donations = [effect for effect in harness.core.take_effects() if isinstance(effect, DonateSequence)]
        assert len(donations) == (1 if gives_kv else 0)
        lookup = harness.core.next_lookup(0.0)
        assert lookup is not None
        assert lookup.tokens == tuple(range(12))


def test_an_edge_that_processes_the_output_gets_the_sampled_tokens_and_ends_a_reply_by_stop() -> None:
    """``edge_output`` (an API process processes the output): the core sends the sampled tokens as they are, and
    the engine's last event carries its usage. A stop string the edge finds ends the reply as one found here
    does: the device drops the sequence and donates its KV. The edge reports the finished reply to the metrics,
    so the core does not."""
    harness = Harness()
    harness.core.add(NewRequest(request_id="r0", prompt_tokens=tuple(range(10)),
                                sampling=SamplingParams(temperature=0.0, stop=("b",)), max_tokens=8,
                                cache_context=CONTEXT, edge_output=True), harness.clients)
    harness.step()
    harness.step()
    harness.step()
    tokens = harness.clients.deltas["r0"]
    assert [type(token) for token in tokens] == [SampledToken] * 3  # no text made here, no stop string found
    assert [token.finish_reason for token in tokens] == [None] * 3
    harness.core.stop("r0", harness.clients, 1.0)
    final = harness.clients.deltas["r0"][-1]
    assert isinstance(final, Delta)
    assert final.finish_reason == "stop"
    assert final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (10, 3)
    assert harness.core.schedule().removals == (Removal(sequence_id=0, donate=True),)
    assert not [effect for effect in harness.core.take_effects() if isinstance(effect, RequestFinished)]
    assert harness.core.statistics().num_completed == 1
    harness.core.stop("r0", harness.clients, 2.0)  # ended already: nothing more happens
    harness.core.stop("never-seen", harness.clients, 2.0)
    assert harness.clients.deltas["r0"][-1] is final


def test_a_relayed_reply_the_device_ends_sends_its_last_token_then_the_usage() -> None:
    harness = Harness()
    harness.core.add(NewRequest(request_id="r0", prompt_tokens=tuple(range(10)), sampling=GREEDY, max_tokens=3,
                                cache_context=None, edge_output=True), harness.clients)
    harness.run_until_idle()
    *tokens, final = harness.clients.deltas["r0"]
    assert [token.finish_reason for token in tokens] == [None, None, "length"]
    assert final.finish_reason == "length"
    assert final.usage.completion_tokens == 3


def test_a_core_that_keeps_the_reply_text_processes_an_edge_request_itself() -> None:
    """The warmer needs the reply's text, so a core keeping it makes deltas even when the edge could."""
    core = SchedulerCore(Capabilities(prefill_step_size=16, context_size=4096), tokenizer=LetterTokenizer(),
                         eos_token_ids=frozenset({999}), cache=CachePlan(mode=CacheMode.SNAPSHOTS),
                         keep_reply_text=True)
    harness = Harness()
    harness.core = core
    core.add(NewRequest(request_id="r0", prompt_tokens=tuple(range(10)), sampling=GREEDY, max_tokens=3,
                        cache_context=None, edge_output=True), harness.clients)
    harness.run_until_idle()
    assert all(isinstance(delta, Delta) for delta in harness.clients.deltas["r0"])
    assert "".join(delta.text for delta in harness.clients.deltas["r0"]) == "abb"


def test_a_retaining_completion_donates_with_its_retention() -> None:
    harness = Harness()
    harness.add("kept", 10, max_tokens=1, context=CONTEXT, retain_seconds=86400)
    while (lookup := harness.core.next_lookup(0.0)) is not None:
        harness.core.resolve(lookup, Miss())
    plan = harness.core.schedule()
    (start,) = plan.starts
    # The device finished it at its first token and detached the whole sequence, in the same step.
    final = DetachedSequence(sequence_id=start.sequence_id, tokens=tuple(range(10)), payload="kv", nbytes=64)
    result = attrs.evolve(harness.device.run(plan), detached=(final,))
    assert [token.finish_reason for token in result.sampled] == ["length"]
    harness.core.update(plan, result, harness.clients, 0.0)
    (donation,) = [e for e in harness.core.take_effects() if isinstance(e, DonateSequence)]
    assert (donation.retain_seconds, donation.prompt_len) == (86400, 10)


@attrs.frozen
class _Payload:
    length: int
    nbytes: int = 1

    def can_adopt(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.length


def _snapshot_core(**changes) -> SchedulerCore:
    capabilities = Capabilities(prefill_step_size=64, context_size=100_000)
    cache = CachePlan(mode=CacheMode.SNAPSHOTS, boundary_snapshots=True, **changes)
    return SchedulerCore(capabilities, tokenizer=LetterTokenizer(), eos_token_ids=frozenset(), cache=cache)


def _request(length: int, **fields) -> NewRequest:
    return NewRequest(request_id="r", prompt_tokens=tuple(range(length)), sampling=GREEDY, max_tokens=4,
                      cache_context=CONTEXT, **fields)


def test_snapshot_points_cover_the_shared_prefix_the_boundary_and_the_last_chunks() -> None:
    core = _snapshot_core(checkpoint_spacing=1000, max_chunk_checkpoints=2)
    points = core._snapshot_points(_request(4600, shared_prefix=300, history_boundary=4500), matched=0)
    assert points == (SnapshotPoint(after=300, checkpoint=True), SnapshotPoint(after=3000, checkpoint=True),
                      SnapshotPoint(after=4000, checkpoint=True), SnapshotPoint(after=4500))
    # Past what was restored only, relative to the tokens still to prefill.
    points = core._snapshot_points(_request(4600, shared_prefix=300, history_boundary=4500), matched=3500)
    assert points == (SnapshotPoint(after=500, checkpoint=True), SnapshotPoint(after=1000))
    # The first turn's history is the system prompt: one point, a checkpoint.
    assert core._snapshot_points(_request(400, shared_prefix=300, history_boundary=300), matched=0) == (
        SnapshotPoint(after=300, checkpoint=True),)


def test_sliding_window_families_checkpoint_before_the_window_wraps() -> None:
    core = _snapshot_core(sliding_window=128)
    assert core._snapshot_points(_request(400, history_boundary=350), matched=0) == (
        SnapshotPoint(after=128, checkpoint=True), SnapshotPoint(after=350))
    assert core._snapshot_points(_request(100, history_boundary=90), matched=0) == (SnapshotPoint(after=90),)


def test_pending_warm_ups_are_kept_per_conversation() -> None:
    harness = Harness(snapshots=True)
    harness.add("busy", 10)  # not idle: warm-ups wait
    harness.core.warm(WarmSession(context=CONTEXT, tokens=(1, 2, 3)))
    harness.core.warm(WarmSession(context=CONTEXT, tokens=(7, 8, 9)))  # a sibling in the same session
    harness.core.warm(WarmSession(context=CONTEXT, tokens=(1, 2, 3, 4, 5)))  # the first one's next turn
    assert [job.tokens for job in harness.core._warm_ups.pending()] == [(7, 8, 9), (1, 2, 3, 4, 5)]


def test_a_warm_up_under_one_adapter_configuration_never_replaces_one_under_another() -> None:
    """The snapshot store keeps a session per adapter configuration, so the warm-up queue must too."""
    harness = Harness(snapshots=True)
    plain = attrs.evolve(CONTEXT, lora_id="")
    adapted = attrs.evolve(CONTEXT, lora_id="adapter-a@1.0")
    harness.core.warm(WarmSession(context=plain, tokens=(1, 2, 3)))
    # Its tokens extend the plain one's, but it warms another store session.
    harness.core.warm(WarmSession(context=adapted, tokens=(1, 2, 3, 4, 5)))
    warmed: list[str] = []
    while (lookup := harness.core.next_lookup(0.0)) is not None:
        assert lookup.kind == "warm"
        warmed.append(lookup.context.lora_id)
        # Already stored in full: nothing to run, so the next pending warm-up is asked for at once.
        harness.core.resolve(lookup, Hit(length=len(lookup.tokens), payload=None))
    assert warmed == ["", "adapter-a@1.0"]


def test_the_core_and_the_snapshot_store_name_a_session_alike() -> None:
    """One function names a session on both sides: every field of the store's session counts in the core."""
    from mlxcel.cache.key import session_id
    from mlxcel.cache.snapshots import SnapshotLimits, SnapshotStore

    store = SnapshotStore(SnapshotLimits(capacity_bytes=1 << 20))
    for change in ({"lora_id": "x"}, {"cache_salt": "tenant"}, {"session_key": "other"}, {"model_id": "n"}):
        other = attrs.evolve(CONTEXT, **change)
        assert session_id(other) != session_id(CONTEXT)
        store.insert(CONTEXT, (1, 2, 3), payload="mine", nbytes=1, now=0.0)
        store.insert(other, (1, 2, 3, 4), payload="theirs", nbytes=1, now=0.0)
        # The other session's longer snapshot did not supersede this one.
        assert {info.tokens for info in store.entries_by_recency()} == {(1, 2, 3), (1, 2, 3, 4)}
        store.reset()


def test_a_snapshot_the_device_cannot_restore_is_placed_again_from_nothing() -> None:
    """The device only reports the failure; where the start runs instead is the core's decision."""
    harness = Harness(snapshots=True)
    prompt = tuple(range(12))
    harness.found[repr(prompt)] = Hit(length=8, payload=_Payload(length=8))
    harness.add("r0", 12, max_tokens=3, context=CONTEXT)
    while (lookup := harness.core.next_lookup(0.0)) is not None:
        harness.core.resolve(lookup, harness.found.pop(repr(lookup.tokens), Miss()))
    plan = harness.core.schedule()
    (start,) = plan.starts
    assert start.restore is not None
    assert len(start.cached_tokens) == 8
    # The device could not restore it: nothing of it ran.
    failed = StepResult(step_number=1, restore_failures=((start.sequence_id, "layer shapes differ"),))
    harness.core.update(plan, failed, harness.clients, 0.0)
    assert [type(effect).__name__ for effect in harness.core.take_effects()].count("SnapshotRestoreFailed") == 1
    plan = harness.step()
    (again,) = plan.starts
    assert (again.sequence_id, again.restore, again.cached_tokens, again.prompt_tokens) == (
        start.sequence_id, None, (), prompt)
    harness.run_until_idle()
    assert "r0" in harness.clients.closed
    assert "r0" not in harness.clients.failed
    usage = [delta.usage for delta in harness.clients.deltas["r0"] if delta.usage is not None]
    assert usage[-1].cached_tokens == 0  # reported as what ran, not what the snapshot would have covered


def test_a_restore_cancelled_while_deferred_leaves_nothing_behind() -> None:
    """Restores that did not fit a step wait in the deferred list; cancelled there, the core forgets them."""
    harness = Harness(snapshots=True)
    for index in range(6):
        prompt = tuple(range(100 * index, 100 * index + 40))
        harness.found[repr(prompt)] = Hit(length=32, payload=_Payload(length=32))
        harness.add(f"r{index}", 40, max_tokens=3, context=CONTEXT, first=100 * index)
    while (lookup := harness.core.next_lookup(0.0)) is not None:
        harness.core.resolve(lookup, harness.found.pop(repr(lookup.tokens), Miss()))
    plan = harness.core.schedule()
    assert 0 < len(plan.starts) < 6  # the rest were deferred by the step's budget
    for index in range(6):
        harness.core.abort(f"r{index}", harness.clients, 0.0)
    harness.core.update(plan, harness.device.run(plan), harness.clients, 0.0)
    harness.run_until_idle()
    assert harness.core._restoring == {}


def test_a_row_whose_grammar_gave_up_fails_its_request_with_a_400_naming_the_field() -> None:
    """The device ended the row with EOS (its mask was late): the request fails, the EOS is not its reply's
    end, nothing is donated, and the sequence leaves the device; the other request goes on."""
    from mlxcel.core.plan import GrammarFailure, GrammarWork

    harness = Harness()
    harness.add("r0", 8, max_tokens=40)
    harness.add("r1", 8, max_tokens=40)
    for _ in range(3):
        harness.step()
    sequences = {request_id: sequence_id for request_id, sequence_id in harness.core._sequence_of.items()}
    sequence_id = sequences["r0"]
    plan = harness.core.schedule()
    late = GrammarFailure(sequence_id=sequence_id, timed_out=True,
                          reason="its grammar's token mask took longer than 200 ms (--grammar-mask-timeout-ms)")
    result = StepResult(step_number=99, decode_batch_size=2, grammar=GrammarWork(failures=(late,)), sampled=(
        SampledToken(sequence_id=sequence_id, token=999, logprob=-1.0, finish_reason="stop"),
        SampledToken(sequence_id=sequences["r1"], token=1, logprob=-1.0)))
    before = len(harness.clients.deltas["r0"])
    harness.core.update(plan, result, harness.clients, 0.0)
    error = harness.clients.failed["r0"]
    assert (error.status, error.code, error.param) == (400, "grammar_too_slow", "tools")
    assert "--grammar-mask-timeout-ms" in error.message
    assert len(harness.clients.deltas["r0"]) == before  # no final delta: it failed
    assert "r0" in harness.clients.closed
    assert "r1" not in harness.clients.failed
    assert not any(isinstance(effect, DonateSequence) for effect in harness.core.take_effects())
    assert any(removal.sequence_id == sequence_id for removal in harness.core.schedule().removals)


def test_an_idle_core_gathers_arrivals_while_the_batch_has_rows_for_them() -> None:
    def core(**capabilities: Any) -> SchedulerCore:
        return SchedulerCore(Capabilities(context_size=4096, **capabilities), tokenizer=LetterTokenizer(),
                             eos_token_ids=frozenset({999}))

    def arrive(into: SchedulerCore, request_id: str, length: int, *, more_pending: bool = True) -> None:
        into.add(NewRequest(request_id=request_id, prompt_tokens=tuple(range(length)), sampling=GREEDY,
                            max_tokens=4, cache_context=CONTEXT, more_pending=more_pending), Clients())

    rows = core(prefill_step_size=64, max_batch_size=2)
    assert not rows.starting_from_idle()
    arrive(rows, "a", 500)  # past the step's budget, but it may hit: what it will prefill is not known yet
    assert rows.starting_from_idle()
    arrive(rows, "b", 5)
    assert not rows.starting_from_idle()  # the batch is full: a later arrival would wait for the next step
    alone = core(prefill_step_size=64, max_batch_size=8)
    arrive(alone, "a", 5, more_pending=False)
    assert not alone.starting_from_idle()  # nothing is behind it: no wait
