"""The placement arithmetic alone: shapes and costs of starts from the device's capabilities."""

from __future__ import annotations

from mlxcel.core import placement
from mlxcel.core.placement import AlonePrefill, DirectBudget, Pending, Placement, snapshot_points
from mlxcel.core.plan import Capabilities, SnapshotPoint
from mlxcel.types import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def _pending(new: int, cached: int = 0, **fields) -> Pending:
    return Pending(sequence_id=0, prompt_tokens=tuple(range(cached, cached + new)),
                   cached_tokens=tuple(range(cached)), sampling=GREEDY, max_tokens=4, **fields)


def test_without_buckets_a_start_keeps_its_whole_prefix_and_is_never_padded() -> None:
    where = Placement(Capabilities(prefill_step_size=256, context_size=4096))
    assert (where.cut(300), where.padding(300, 5)) == (300, 0)
    assert not where.prefills_alone(_pending(1000))
    assert where.budget().charge == 0


def test_bucketed_starts_cut_to_the_alignment_pad_to_the_bucket_and_stay_inside_the_context() -> None:
    where = Placement(Capabilities(prefill_step_size=256, context_size=4096, bucket_starts=True))
    assert where.cut(300) == 300 - 300 % placement.START_PREFIX_ALIGN
    assert where.padding(256, 5) == placement.START_QUERY_BUCKET - 5
    assert where.padding(4090, 5) == 0  # would run past the context
    # A cold start (nothing kept) pads short rows to the finer buckets first.
    assert [length + where.padding(0, length) for length in (5, 32, 33, 64, 65, 129)] == [32, 32, 64, 64, 128, 256]
    # Image rows are never cut back into: the whole prefix is kept.
    assert where.kept(_pending(10, image_end=290), 300) == 300
    assert where.budget().charge == placement.DIRECT_START_TOKENS


def test_a_long_prompt_alone_ends_its_chunks_on_step_multiples_and_its_last_on_an_alignment() -> None:
    where = Placement(Capabilities(prefill_step_size=256, context_size=4096, bucket_starts=True))
    pending = _pending(700)
    assert where.prefills_alone(pending)
    prefill = AlonePrefill(pending=pending, tokens=pending.prompt_tokens, done=0)
    ends = []
    while True:
        end, last = where.alone_chunk_end(prefill)
        ends.append((end, last))
        prefill.done = end
        if last:
            break
    assert ends == [(256, False), (512, False), (640, True)]
    rest = where.alone_rest(prefill, 640)
    assert (len(rest.cached_tokens), len(rest.prompt_tokens), rest.from_alone) == (640, 60, True)


def test_the_first_direct_start_always_fits_later_ones_wait_once_over_and_cold_ones_share_a_charge() -> None:
    where = Placement(Capabilities(prefill_step_size=300, context_size=4096, bucket_starts=True))
    budget = where.budget()
    assert budget.take(where.direct(_pending(200, cached=128, adopted=object())))  # over alone: still fits
    assert not budget.take(where.direct(_pending(10)))
    cold = DirectBudget(step=300, charge=256)
    assert cold.take(where.direct(_pending(20)))
    assert cold.take(where.direct(_pending(20)))  # the pass was charged once: 256 + 20 + 20
    assert cold.num_tokens == 296


def test_snapshot_points_skip_what_was_resumed() -> None:
    points = snapshot_points(prompt_len=400, matched=100, history_boundary=350, shared_prefix=50,
                             checkpoint_spacing=0, max_chunk_checkpoints=0, sliding_window=None)
    assert points == (SnapshotPoint(after=250),)
