"""The device's half of a plan's disk reads: each start gets what its read gave, or leaves the step."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from mlxcel.core.plan import (
    AloneChunk,
    DiskRead,
    DiskReadDone,
    InsertBatch,
    StartAlone,
    StartDirect,
    StepPlan,
)
from mlxcel.disk.device import DeviceDisk, read_starts
from mlxcel.disk.index import PIECE_BLOCKS, PIECE_TOKENS
from mlxcel.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


@attrs.frozen
class _KV:
    length: int

    def can_adopt(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.length


class _Disk:
    """DeviceDisk's read, with each source's outcome given (None: nothing usable)."""

    def __init__(self, outcomes: dict[str, Any]) -> None:
        self.outcomes = outcomes
        self.reads: list[str] = []

    def read(self, read: DiskRead, prefill_seconds_per_token: float | None) -> Any:
        self.reads.append(read.source)
        return self.outcomes[read.source]


def _direct(sequence_id: int, source: str | None, cached: int = 32, **fields: Any) -> StartDirect:
    read = DiskRead(source=source, num_tokens=cached) if source is not None else None
    return StartDirect(sequence_id=sequence_id, prompt_tokens=(1, 2), cached_tokens=tuple(range(cached)),
                       sampling=GREEDY, max_tokens=4, kept=cached, disk_read=read, **fields)


def test_reads_give_their_starts_the_kv_and_short_ones_leave_the_step() -> None:
    whole, short = _KV(32), _KV(16)
    alone = StartAlone(sequence_id=3, tokens=tuple(range(400)), kept=32,
                       disk_read=DiskRead(source="gone", num_tokens=32))
    plan = StepPlan(starts=(_direct(0, "whole"), _direct(1, "short"), _direct(2, None), alone),
                    alone_chunk=AloneChunk(sequence_id=3, start=32, end=256, last=False), run_batch=True)
    disk = _Disk({"whole": whole, "short": short, "gone": None})
    ran, reads = read_starts(disk, plan, None)  # type: ignore[arg-type]
    assert disk.reads == ["whole", "short", "gone"]
    assert reads == (DiskReadDone(sequence_id=0, payload=whole, num_tokens=32, started=True),
                     DiskReadDone(sequence_id=1, payload=short, num_tokens=16, started=False),
                     DiskReadDone(sequence_id=3, payload=None, num_tokens=0, started=False))
    # The whole read is the start's adopted KV; the short one and the alone prompt (with its chunk) do not run.
    assert [start.sequence_id for start in ran.starts] == [0, 2]
    assert ran.starts[0].adopted is whole
    assert ran.starts[0].disk_read is None
    assert ran.alone_chunk is None
    assert ran.run_batch


def test_a_snapshot_read_is_the_starts_restore_and_a_plan_without_reads_is_left_alone() -> None:
    snapshot = _KV(24)
    insert = InsertBatch(sequence_id=5, prompt_tokens=(1,), cached_tokens=tuple(range(24)), sampling=GREEDY,
                         max_tokens=2, disk_read=DiskRead(source="snap", num_tokens=24, snapshot=True))
    ran, reads = read_starts(_Disk({"snap": snapshot}), StepPlan(starts=(insert,)), None)  # type: ignore[arg-type]
    assert reads == (DiskReadDone(sequence_id=5, payload=snapshot, num_tokens=24, started=True),)
    assert (ran.starts[0].restore, ran.starts[0].adopted, ran.starts[0].disk_read) == (snapshot, None, None)
    plain = StepPlan(starts=(_direct(0, None),), run_batch=True)
    assert read_starts(None, plain, None) == (plain, ())
    # No disk tier on the device (it cannot happen with a plan that reads): the start does not run.
    ran, reads = read_starts(None, StepPlan(starts=(_direct(0, "whole"),)), None)
    assert (ran.starts, reads) == ((), (DiskReadDone(sequence_id=0),))


@pytest.mark.slow
def test_a_damaged_piece_takes_its_start_out_of_the_step_with_what_came_before_it(tmp_path) -> None:
    """Real files: a whole read is the start's KV; a truncated piece ends the read, and the start waits."""
    from tests.disk.test_disk_kv import CONTEXT, LAYERS, TOKENS, open_tier, payload, pieces, write

    write(open_tier(tmp_path), payload())
    tier = open_tier(tmp_path)
    disk_plan = tier.probe(CONTEXT, TOKENS, len(TOKENS) - 1, 0)
    assert disk_plan is not None
    read = DiskRead(source=disk_plan, num_tokens=disk_plan.num_tokens)
    start = _direct(0, None, cached=disk_plan.num_tokens)
    plan = StepPlan(starts=(attrs.evolve(start, disk_read=read),))
    device = DeviceDisk(tier, LAYERS)
    ran, (done,) = read_starts(device, plan, None)
    assert (done.started, done.num_tokens) == (True, disk_plan.num_tokens)
    assert ran.starts[0].adopted is done.payload
    # The second piece in token order: the read keeps the first.
    second = next(path for path in pieces(tmp_path) if f"-{PIECE_BLOCKS:07d}-{2 * PIECE_BLOCKS:07d}-" in path.name)
    second.write_bytes(second.read_bytes()[: second.stat().st_size // 2])
    ran, (done,) = read_starts(device, plan, None)
    assert (done.started, done.num_tokens, ran.starts) == (False, PIECE_TOKENS, ())
    assert done.payload is not None
    assert tier.statistics().refusals["truncated"] == 1
    tier.close()

