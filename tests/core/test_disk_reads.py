"""The disk tier in the scheduling core: a disk hit is a start that carries its read, writes ride the plan.

No device and no files: the core is handed what the cache store and the
device would report (``OnDisk`` lookups, ``StepResult.disk_reads``), and
each test reads the plans that come out.
"""

from __future__ import annotations

import attrs

from mlxcel.core.cache_plan import CacheMode, CachePlan
from mlxcel.core.effects import CacheLookedUp, DonateSequence, DonateSnapshot
from mlxcel.core.plan import (
    Capabilities,
    DiskRead,
    DiskReadDone,
    DiskWrite,
    InsertBatch,
    StartDirect,
    StepPlan,
    StepResult,
)
from mlxcel.core.scheduler import Hit, Miss, NewRequest, OnDisk, SchedulerCore
from tests.core.test_scheduler_core import CONTEXT, GREEDY, Clients, SimulatedDevice
from tests.support import LetterTokenizer

PROMPT = tuple(range(40))


@attrs.frozen
class _KV:
    length: int
    nbytes: int = 64

    def can_adopt(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.length


class _Core:
    def __init__(self, *, snapshots: bool = False) -> None:
        cache = CachePlan(mode=CacheMode.SNAPSHOTS if snapshots else CacheMode.PREFIX)
        self.core = SchedulerCore(Capabilities(prefill_step_size=64, context_size=4096),
                                  tokenizer=LetterTokenizer(), eos_token_ids=frozenset({999}), cache=cache)
        self.device = SimulatedDevice(64)
        self.clients = Clients()

    def admit(self, found, prompt: tuple[int, ...] = PROMPT, max_tokens: int = 3) -> StepPlan:
        self.core.add(NewRequest(request_id="r", prompt_tokens=prompt, sampling=GREEDY, max_tokens=max_tokens,
                                 cache_context=CONTEXT), self.clients)
        while (lookup := self.core.next_lookup(0.0)) is not None:
            self.core.resolve(lookup, found)
        return self.core.schedule()

    def report(self, plan: StepPlan, *reads: DiskReadDone) -> None:
        """The device's report: what each read gave, and the starts that ran (the others did not)."""
        ran = {done.sequence_id for done in reads if done.started}
        runnable = attrs.evolve(plan, starts=tuple(
            start for start in plan.starts if start.disk_read is None or start.sequence_id in ran))
        result = attrs.evolve(self.device.run(runnable), disk_reads=reads)
        self.core.update(plan, result, self.clients, 0.0)

    def step(self) -> StepPlan:
        plan = self.core.schedule()
        self.core.update(plan, self.device.run(plan), self.clients, 0.0)
        return plan

    def finish(self) -> int:
        """Runs to the end; the request's reported cached tokens."""
        for _ in range(20):
            if not self.core.has_work():
                break
            self.step()
        usage = [delta.usage for delta in self.clients.deltas["r"] if delta.usage is not None]
        assert "r" not in self.clients.failed
        return usage[-1].cached_tokens


def _on_disk(num_tokens: int, *, memory: Hit | Miss | None = None, snapshot: bool = False,
             retain_seconds: float = 0.0) -> OnDisk:
    memory = memory if memory is not None else Miss()
    return OnDisk(memory=memory, read=DiskRead(
        source=("files", num_tokens), num_tokens=num_tokens, snapshot=snapshot, retain_seconds=retain_seconds,
        memory=memory.payload if isinstance(memory, Hit) else None,
        memory_tokens=memory.length if isinstance(memory, Hit) else 0))


def test_a_disk_hit_is_a_start_that_carries_its_read_and_is_donated_once_read() -> None:
    core = _Core()
    plan = core.admit(_on_disk(32, retain_seconds=60.0))
    (start,) = plan.starts
    assert isinstance(start, StartDirect)
    assert start.disk_read is not None
    assert start.disk_read.source == ("files", 32)
    # Placed as a hit of the files' length: the device adopts what it reads, nothing is adopted yet.
    assert (len(start.cached_tokens), start.prompt_tokens, start.kept, start.adopted) == (32, PROMPT[32:], 32, None)
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=_KV(32), num_tokens=32, started=True))
    effects = core.core.take_effects()
    assert CacheLookedUp(hit=True, tokens_reused=32, tokens_queried=40) in effects
    (donated,) = [effect for effect in effects if isinstance(effect, DonateSequence)]
    # The memory store learns of it; a retained prompt read back whole is pinned again.
    assert (donated.tokens, donated.payload, donated.retain_seconds) == (PROMPT[:32], _KV(32), 60.0)
    assert core.finish() == 32
    # It started in the step that read it: no start of it came again.
    assert not any(plan.starts for plan in [core.core.schedule()])


def test_a_read_that_finds_nothing_places_the_same_sequence_again_cold_in_the_next_step() -> None:
    core = _Core()
    plan = core.admit(_on_disk(32))
    (start,) = plan.starts
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=None, num_tokens=0, started=False))
    effects = core.core.take_effects()
    assert CacheLookedUp(hit=False, tokens_reused=0, tokens_queried=40) in effects
    assert not [effect for effect in effects if isinstance(effect, DonateSequence)]
    again = core.step()
    (cold,) = again.starts
    assert (cold.sequence_id, cold.disk_read, cold.adopted, cold.cached_tokens, cold.prompt_tokens) == (
        start.sequence_id, None, None, (), PROMPT)
    assert core.finish() == 0  # reported as what ran


def test_a_short_read_places_the_start_again_on_what_it_gave() -> None:
    core = _Core()
    plan = core.admit(_on_disk(32, retain_seconds=60.0))
    (start,) = plan.starts
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=_KV(16), num_tokens=16, started=False))
    (donated,) = [effect for effect in core.core.take_effects() if isinstance(effect, DonateSequence)]
    assert (donated.tokens, donated.retain_seconds) == (PROMPT[:16], 0.0)  # not the retained prefix
    (again,) = core.step().starts
    assert (again.sequence_id, again.disk_read, again.adopted, len(again.cached_tokens)) == (
        start.sequence_id, None, _KV(16), 16)
    assert core.finish() == 16


def test_a_read_that_fails_falls_back_to_memorys_match() -> None:
    core = _Core()
    plan = core.admit(_on_disk(32, memory=Hit(length=8, payload=_KV(8))))
    (start,) = plan.starts
    assert start.disk_read is not None
    assert start.disk_read.memory == _KV(8)
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=None, started=False))
    assert CacheLookedUp(hit=True, tokens_reused=8, tokens_queried=40) in core.core.take_effects()
    (again,) = core.step().starts
    assert (again.disk_read, again.adopted, len(again.cached_tokens)) == (None, _KV(8), 8)
    assert core.finish() == 8


def test_a_session_snapshot_on_disk_is_restored_by_its_start_or_the_start_runs_cold() -> None:
    core = _Core(snapshots=True)
    plan = core.admit(_on_disk(24, snapshot=True))
    (start,) = plan.starts
    assert start.disk_read is not None
    assert start.disk_read.snapshot
    assert (start.restore, len(start.cached_tokens)) == (None, 24)
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=_KV(24), num_tokens=24, started=True))
    (donated,) = [effect for effect in core.core.take_effects() if isinstance(effect, DonateSnapshot)]
    assert donated.tokens == PROMPT[:24]
    assert core.finish() == 24

    core = _Core(snapshots=True)
    plan = core.admit(_on_disk(24, snapshot=True))
    (start,) = plan.starts
    core.report(plan, DiskReadDone(sequence_id=start.sequence_id, payload=None, started=False))
    (again,) = core.step().starts
    assert isinstance(again, StartDirect | InsertBatch)
    assert (again.sequence_id, again.disk_read, again.restore, again.cached_tokens) == (
        start.sequence_id, None, None, ())
    assert core.finish() == 0


def test_disk_writes_ride_the_next_plan_and_alone_they_are_not_a_step() -> None:
    core = _Core()
    write = DiskWrite(payload=_KV(16), pieces=("piece-0",))
    assert not core.core.has_work()
    core.core.persist((write,))
    assert core.core.has_work()  # an idle device gets a plan of the writes alone
    plan = core.core.schedule()
    assert plan.only_writes
    assert plan.disk_writes == (write,)
    before = core.core.statistics().num_steps
    core.core.update(plan, StepResult(step_number=0), core.clients, 0.0)
    assert core.core.statistics().num_steps == before
    assert core.core.statistics().decode_batch_sizes == {}
    assert not core.core.has_work()
    # Beside other work they ride that work's plan, which is a step.
    core.core.persist((write,))
    plan = core.admit(Miss())
    assert plan.disk_writes == (write,)
    assert plan.starts
    assert not plan.only_writes
